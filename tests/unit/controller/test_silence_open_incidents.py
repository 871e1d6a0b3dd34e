"""A silence created while a matching incident is open: its pending notifications are
skipped ("suppressed by silence N"), later ones too, resolves still go out, and a remediation
already under way finishes (FakeClock, real SQLite, recording notifiers)."""

from __future__ import annotations

from tests.builders import Reporter
from trainguard.controller.actions.base import TransientError
from trainguard.controller.actions.notify import RecordingNotifier
from trainguard.protocol import Event


def _results(c, node: str, *, ok: bool) -> tuple[Event, ...]:
    return tuple(
        Event(
            id=100 + i,
            kind="command_result",
            ts=0.0,
            data={"command_id": cmd.id, "ok": ok, "message": "stopped" if ok else "no such job"},
        )
        for i, cmd in enumerate(c.pending_commands(node))
    )


def _timeline(c, incident_id: int) -> list[tuple[str, str]]:
    return [(t.kind, t.message) for t in c.get_incident(incident_id).timeline]


def test_silence_skips_pending_notification_and_the_running_drain_finishes(make_core, core_clock):
    notifier = RecordingNotifier("rec", errors=[TransientError("503 from the webhook")])
    c = make_core(notifiers=[notifier])
    r = Reporter("n1")
    c.ingest_report(r.report(now=core_clock.now(), dbe=1, job="train"), actor="a")
    c.tick()  # opens; notify fails (retry pending), drain sends stop_job and waits
    (incident,) = c.list_incidents()
    actions = {a.kind: a for a in c.get_incident(incident.id).actions}
    assert (actions["notify"].state, actions["drain"].state) == ("pending", "running")

    silence = c.create_silence(
        rule="gpu_dbe", node=None, duration_s=600, comment="burn-in", actor="op"
    )
    detail = c.get_incident(incident.id)
    notify = next(a for a in detail.actions if a.kind == "notify")
    assert (notify.state, notify.result) == (
        "skipped",
        f"skipped: suppressed by silence {silence.id}",
    )
    (note,) = [t for t in detail.timeline if t.kind == "silenced"]
    assert "the remediation in progress continues" in note.message
    assert detail.incident.state == "acting"
    audit = c.audit_log(limit=1)[0]
    assert audit.action == "create_silence" and audit.detail["open_incidents"] == [incident.id]

    core_clock.advance(5)  # past the notify backoff: nothing is re-sent
    c.ingest_report(
        r.report(now=core_clock.now(), dbe=1, events=_results(c, "n1", ok=True)), actor="a"
    )
    c.tick()
    assert c.get_node("n1").state == "drained"
    assert c.get_incident(incident.id).incident.state == "mitigated"
    assert notifier.sent == []


def test_pages_added_after_the_silence_are_suppressed_too(make_core, core_clock, core_notifier):
    c = make_core()
    r = Reporter("n1")
    c.ingest_report(r.report(now=core_clock.now(), dbe=1, job="train"), actor="a")
    c.tick()
    (incident,) = c.list_incidents()
    assert len(core_notifier.sent) == 1  # the trigger went out before the silence
    c.create_silence(rule=None, node="n1", duration_s=600, comment="", actor="op")
    core_clock.advance(1)
    c.ingest_report(
        r.report(now=core_clock.now(), dbe=1, events=_results(c, "n1", ok=False)), actor="a"
    )
    c.tick()  # the drain fails: escalation pages are planned, and skipped when due
    detail = c.get_incident(incident.id)
    pages = [a for a in detail.actions if a.kind == "notify" and a.params.get("page")]
    assert pages and all(a.result == "skipped: suppressed by silence 1" for a in pages)
    assert len(core_notifier.sent) == 1


def test_open_notify_only_incident_goes_suppressed_and_its_resolve_still_goes_out(
    make_core, core_clock, core_notifier
):
    c = make_core()
    r = Reporter("n1")
    c.ingest_report(r.report(now=core_clock.now(), temp=95.0), actor="a")
    c.tick()
    (incident,) = c.list_incidents()
    assert incident.state == "open" and len(core_notifier.sent) == 1
    c.create_silence(rule="gpu_hot", node="n1", duration_s=600, comment="fan swap", actor="op")
    assert c.get_incident(incident.id).incident.state == "suppressed"
    assert (
        "silenced",
        "suppressed by silence 1 (fan swap): 0 pending notification(s) skipped;"
        " no remediation in progress",
    ) in _timeline(c, incident.id)
    core_clock.advance(1)
    c.ingest_report(r.report(now=core_clock.now(), temp=50.0), actor="a")
    c.tick()
    assert c.get_incident(incident.id).incident.state == "resolved"
    # the channel was told of the trigger before the silence: it is told of the resolve
    assert [n.event for n in core_notifier.sent] == ["trigger", "resolve"]


def test_silence_for_another_rule_or_node_leaves_the_incident_alone(make_core, core_clock):
    notifier = RecordingNotifier("rec", errors=[TransientError("timeout")])
    c = make_core(notifiers=[notifier])
    c.ingest_report(Reporter("n1").report(now=core_clock.now(), temp=95.0), actor="a")
    c.tick()
    (incident,) = c.list_incidents()
    c.create_silence(rule="gpu_dbe", node=None, duration_s=600, comment="", actor="op")
    c.create_silence(rule=None, node="n2", duration_s=600, comment="", actor="op")
    detail = c.get_incident(incident.id)
    assert detail.incident.state == "open"
    assert [a.state for a in detail.actions] == ["pending"]
    assert not [t for t in detail.timeline if t.kind == "silenced"]
