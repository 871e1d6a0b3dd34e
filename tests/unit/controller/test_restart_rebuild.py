"""What a restarted controller rebuilds before it decides (FakeClock, Controller over a real
SQLite file): acknowledged events are replayed into the signal history, so each is evaluated
exactly once across a crash, and a restored incident whose windowed condition lost its history
stays open until its node has reported again and a full rule window has passed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.builders import Reporter
from trainguard.clock import FakeClock
from trainguard.controller.composition import Controller
from trainguard.controller.model import Target
from trainguard.protocol import Event

RULES = """
rules:
  - name: gpu_fatal_xid
    scope: gpu
    condition: increase(xid_fatal_total[5m]) > 0
    severity: critical
    actions: [notify]
    cooldown: 15m
    summary: fatal XID
  - name: gpu_uncorrectable_ecc
    scope: gpu
    condition: increase(ecc_uncorrected_volatile_total[10m]) > 0
    severity: critical
    actions: [notify]
    cooldown: 15m
    summary: uncorrectable ECC error
"""
GPU0 = Target(scope="gpu", node="n1", gpu=0)


@pytest.fixture
def make(make_core: Callable[..., Controller], tmp_path: Path) -> Callable[..., Controller]:
    rules = tmp_path / "restart_rules.yaml"
    rules.write_text(RULES)

    def build(**overrides: Any) -> Controller:
        return make_core(rules=[str(rules)], **overrides)

    return build


def _xid48(event_id: int, now: float) -> Event:
    return Event(id=event_id, kind="xid", ts=now, gpu=0, code=48, message="DBE")


def _report(c: Controller, clock: FakeClock, r: Reporter, **kw: Any) -> None:
    c.ingest_report(r.report(now=clock.now(), **kw), actor="agent")


def _incidents(c: Controller, rule: str) -> list[Any]:
    return [i for i in c.list_incidents() if i.rule == rule]


def test_event_acknowledged_but_never_evaluated_opens_exactly_one_incident_after_restart(
    make, core_clock
):
    c = make()
    r = Reporter("n1")
    _report(c, core_clock, r)
    c.tick()
    core_clock.advance(1)
    _report(c, core_clock, r, events=(_xid48(1, core_clock.now()),))  # stored, acked
    c.stop()  # down before any tick evaluated it

    c2 = make()
    core_clock.advance(1)
    c2.tick()
    assert c2.list_incidents() == []  # n1 has not reported since: no action on stale data
    for _ in range(5):
        core_clock.advance(1)
        _report(c2, core_clock, r)  # the same counters, no new event
        c2.tick()
    (incident,) = c2.list_incidents()
    assert incident.rule == "gpu_fatal_xid" and incident.severity == "critical"
    assert incident.state != "resolved"


def test_event_that_opened_an_incident_before_the_crash_opens_nothing_new(make, core_clock):
    c = make()
    r = Reporter("n1")
    _report(c, core_clock, r)
    c.tick()
    core_clock.advance(1)
    _report(c, core_clock, r, events=(_xid48(1, core_clock.now()),))
    c.tick()
    (before,) = c.list_incidents()
    c.stop()

    c2 = make()
    for _ in range(5):
        core_clock.advance(1)
        _report(c2, core_clock, r)
        c2.tick()
    (after,) = c2.list_incidents()
    assert after.id == before.id and after.state != "resolved"


def test_replayed_event_counts_from_when_it_was_received(make, core_clock):
    """An event acknowledged but never evaluated opens its incident after the restart, and
    the replayed increase ends 5 minutes after the event arrived, not after the restart."""
    c = make()
    r = Reporter("n1")
    _report(c, core_clock, r)
    c.tick()
    core_clock.advance(1)
    received_at = core_clock.now()
    _report(c, core_clock, r, events=(_xid48(1, received_at),))
    c.stop()

    core_clock.advance(100)
    c2 = make()
    now = core_clock.now()
    assert c2.signals.value(GPU0, "xid_fatal_total", now=now, stale_after_s=1e9) == 1
    while core_clock.now() < received_at + 320:
        core_clock.advance(5)
        _report(c2, core_clock, r)
        c2.tick()
    (incident,) = c2.list_incidents()
    assert incident.opened_at <= received_at + 110
    assert incident.state == "resolved"
    assert incident.resolved_at is not None
    assert received_at + 300 <= incident.resolved_at <= received_at + 310


def test_resent_event_after_restart_is_not_counted_twice(make, core_clock):
    c = make()
    r = Reporter("n1")
    _report(c, core_clock, r)
    core_clock.advance(1)
    event = _xid48(1, core_clock.now())
    _report(c, core_clock, r, events=(event,))
    c.stop()

    c2 = make()
    core_clock.advance(1)
    _report(c2, core_clock, r, events=(event,))  # the ack was lost: the agent resends it
    c2.tick()
    assert c2.signals.value(GPU0, "xid_fatal_total", now=core_clock.now()) == 1


def test_events_older_than_the_signal_history_are_not_replayed(make, core_clock):
    c = make(history_s=60)
    r = Reporter("n1")
    _report(c, core_clock, r)
    core_clock.advance(1)
    _report(c, core_clock, r, events=(_xid48(1, core_clock.now()),))
    c.stop()

    core_clock.advance(61)
    c2 = make(history_s=60)
    _report(c2, core_clock, r)
    c2.tick()
    assert c2.list_incidents() == []
    assert c2.signals.value(GPU0, "xid_fatal_total", now=core_clock.now()) == 0


def _open_dbe_incident(make: Callable[..., Controller], clock: FakeClock) -> tuple[Reporter, int]:
    c = make()
    r = Reporter("n1")
    _report(c, clock, r, dbe=0)
    c.tick()
    clock.advance(1)
    _report(c, clock, r, dbe=1)
    c.tick()
    (incident,) = c.list_incidents()
    assert incident.rule == "gpu_uncorrectable_ecc"
    c.stop()
    return r, incident.id


def test_restored_dbe_incident_stays_open_while_its_node_reports_the_same_counters(
    make, core_clock
):
    r, incident_id = _open_dbe_incident(make, core_clock)
    core_clock.advance(1)
    c2 = make()
    started = core_clock.now()
    # the first report after the restart shows the counter at 1 with no history: no increase
    while core_clock.now() < started + 590:
        core_clock.advance(10)
        _report(c2, core_clock, r, dbe=1)
        c2.tick()
    assert c2.get_incident(incident_id).incident.state != "resolved"
    assert len(c2.list_incidents()) == 1


def test_restored_dbe_incident_resolves_after_a_full_window_once_it_really_cleared(
    make, core_clock
):
    r, incident_id = _open_dbe_incident(make, core_clock)
    core_clock.advance(1)
    c2 = make()
    started = core_clock.now()
    while core_clock.now() < started + 590:
        core_clock.advance(10)
        _report(c2, core_clock, r, dbe=1)
        c2.tick()
        assert c2.get_incident(incident_id).incident.state != "resolved"
    core_clock.advance(10)  # 600 s: the rule's 10 minute window has passed since the start
    _report(c2, core_clock, r, dbe=1)
    c2.tick()
    detail = c2.get_incident(incident_id)
    assert detail.incident.state == "resolved"
    (resolved,) = [t for t in detail.timeline if t.kind == "resolved"]
    assert resolved.ts == started + 600
    assert resolved.message.startswith("condition cleared")
    assert len(c2.list_incidents()) == 1


def test_restored_incident_whose_node_never_reports_again_is_held_past_the_window(make, core_clock):
    _, incident_id = _open_dbe_incident(make, core_clock)
    c2 = make()
    for _ in range(70):
        core_clock.advance(10)
        c2.tick()
    assert c2.get_incident(incident_id).incident.state != "resolved"


def test_restored_incident_with_new_evidence_resolves_when_that_evidence_ages_out(make, core_clock):
    """The counter rises again after the restart: the window then counts from that rise."""
    r, incident_id = _open_dbe_incident(make, core_clock)
    c2 = make()
    core_clock.advance(1)
    _report(c2, core_clock, r, dbe=1)
    c2.tick()
    core_clock.advance(300)
    rose_at = core_clock.now()
    _report(c2, core_clock, r, dbe=2)
    c2.tick()
    while core_clock.now() < rose_at + 590:
        core_clock.advance(10)
        _report(c2, core_clock, r, dbe=2)
        c2.tick()
        assert c2.get_incident(incident_id).incident.state != "resolved"
    while core_clock.now() < rose_at + 620:
        core_clock.advance(10)
        _report(c2, core_clock, r, dbe=2)
        c2.tick()
    assert c2.get_incident(incident_id).incident.state == "resolved"
    assert len(c2.list_incidents()) == 1
