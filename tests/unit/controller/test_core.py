"""Controller: ingest (registration, freshness batching, event dedupe, commands), the tick
from decisions to incidents and actions, safety rails end to end, restart and the service."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest

from tests.builders import Reporter
from tests.helpers import wait_for
from tests.integration.postgres_proc import BOTH_STORES
from trainguard.controller.actions.notify import RecordingNotifier
from trainguard.controller.errors import BadRequest, NotFound
from trainguard.controller.model import Decision, Target
from trainguard.controller.rules import engine
from trainguard.controller.rules.loader import default_rules_path
from trainguard.protocol import Event, FaultSpec, RankState, Report
from trainguard.strict import ConfigError


def _result_event(event_id: int, command_id: str, *, ok: bool = True) -> Event:
    return Event(
        id=event_id,
        kind="command_result",
        ts=0.0,
        data={"command_id": command_id, "ok": ok, "message": "done" if ok else "boom"},
    )


def test_first_report_registers_node_active_whatever_its_role_hint(make_core, core_clock):
    c = make_core()
    resp = c.ingest_report(
        Reporter("spare-1", role="spare").report(now=core_clock.now()), actor="a"
    )
    assert resp.ack_event_id == 0 and resp.commands == ()
    node = c.get_node("spare-1")
    assert (node.role, node.state, node.reporting, node.gpus) == ("active", "active", True, 1)
    assert c.list_spares() == []
    # a spare is one because an operator said so
    c.set_role("spare-1", role="spare", actor="ops")
    assert [n.name for n in c.list_spares()] == ["spare-1"]
    c.ingest_report(Reporter("spare-1", role="active").report(now=core_clock.now()), actor="a")
    assert [n.name for n in c.list_spares()] == ["spare-1"]


def test_freshness_is_flushed_to_the_store_on_tick_not_per_report(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    assert c.store.nodes.get("n1").last_report_at is None
    c.tick()
    assert c.store.nodes.get("n1").last_report_at == core_clock.now()


@BOTH_STORES
def test_resent_events_are_stored_once_and_acked(make_core, core_clock):
    c = make_core()
    r = Reporter("n1")
    events = (Event(id=1, kind="xid", ts=1.0, code=13), Event(id=2, kind="xid", ts=2.0, code=13))
    assert (
        c.ingest_report(r.report(now=core_clock.now(), events=events), actor="a").ack_event_id == 2
    )
    # the response was lost: the agent sends the same events again, plus a new one
    again = (*events, Event(id=3, kind="xid", ts=3.0, code=13))
    assert (
        c.ingest_report(r.report(now=core_clock.now(), events=again), actor="a").ack_event_id == 3
    )
    assert c.store.events.count("n1") == 3


def test_new_agent_instance_starts_its_own_event_ids(make_core, core_clock):
    c = make_core()
    ev = (Event(id=1, kind="xid", ts=1.0, code=13),)
    c.ingest_report(Reporter("n1", instance="a").report(now=0, events=ev), actor="a")
    resp = c.ingest_report(Reporter("n1", instance="b").report(now=0, events=ev), actor="a")
    assert resp.ack_event_id == 1
    assert c.store.events.count("n1") == 2


def test_event_dedupe_survives_a_controller_restart(make_core, core_clock):
    c = make_core()
    r = Reporter("n1")
    ev = (Event(id=1, kind="xid", ts=1.0, code=13),)
    c.ingest_report(r.report(now=0, events=ev), actor="a")
    c.stop()
    c2 = make_core()
    assert c2.ingest_report(r.report(now=0, events=ev), actor="a").ack_event_id == 1
    assert c2.store.events.count("n1") == 1


def test_command_is_resent_until_its_result_arrives(make_core, core_clock):
    c = make_core()
    r = Reporter("n1")
    c.ingest_report(r.report(now=0), actor="a")
    command_id = c.inject_fault("n1", FaultSpec(kind="dbe"), actor="op")
    first = c.ingest_report(r.report(now=0), actor="a")
    second = c.ingest_report(r.report(now=0), actor="a")  # first response lost
    assert [x.id for x in first.commands] == [x.id for x in second.commands] == [command_id]
    assert first.commands[0].kind == "inject_fault" and first.commands[0].args["kind"] == "dbe"
    done = c.ingest_report(r.report(now=0, events=(_result_event(1, command_id),)), actor="a")
    assert done.commands == ()
    record = c.store.commands.get(command_id)
    assert record.ok is True and record.delivered_at is not None
    assert c.audit_log()[0].action == "inject_fault"


def test_command_without_result_times_out_as_failed(make_core, core_clock):
    c = make_core(actions={"command_timeout_s": 30.0})
    c.ingest_report(Reporter("n1").report(now=0), actor="a")
    command_id = c.inject_fault("n1", FaultSpec(kind="clear"), actor="op")
    core_clock.advance(31)
    c.tick()
    record = c.store.commands.get(command_id)
    assert record.ok is False and "30 s" in record.result
    assert c.pending_commands("n1") == []


def _fire_dbe(c, core_clock, reporter, **kw):
    c.ingest_report(reporter.report(now=core_clock.now(), dbe=1, **kw), actor="a")
    c.tick()


def test_fatal_fault_opens_incident_notifies_and_drains_idle_node(
    make_core, core_clock, core_notifier
):
    c = make_core()
    _fire_dbe(c, core_clock, Reporter("n1"))
    (incident,) = c.list_incidents()
    assert (incident.rule, incident.state, incident.node) == ("gpu_dbe", "mitigated", "n1")
    detail = c.get_incident(incident.id)
    kinds = [t.kind for t in detail.timeline]
    assert kinds.index("opened") < kinds.index("acting") < kinds.index("mitigated")
    assert [(a.kind, a.state) for a in detail.actions] == [
        ("notify", "succeeded"),
        ("drain", "succeeded"),
    ]
    assert [n.event for n in core_notifier.sent] == ["trigger"]
    assert c.get_node("n1").state == "drained"


def test_drain_of_node_running_a_job_waits_for_stop_job_result(make_core, core_clock):
    c = make_core()
    r = Reporter("n1")
    _fire_dbe(c, core_clock, r, job="job-a")
    assert c.get_node("n1").state == "draining"
    (incident,) = c.list_incidents()
    assert incident.state == "acting"
    (cmd,) = c.ingest_report(r.report(now=core_clock.now(), dbe=1, job="job-a"), actor="a").commands
    assert cmd.kind == "stop_job" and cmd.args["job"] == "job-a"
    core_clock.advance(1)
    c.ingest_report(
        r.report(now=core_clock.now(), dbe=1, events=(_result_event(1, cmd.id),)), actor="a"
    )
    c.tick()
    assert c.get_node("n1").state == "drained"
    assert c.get_incident(incident.id).incident.state == "mitigated"


def test_failed_stop_job_fails_the_drain_and_escalates(make_core, core_clock):
    pager = RecordingNotifier("pager", min_severity="critical")
    c = make_core(notifiers=[pager])
    r = Reporter("n1")
    _fire_dbe(c, core_clock, r, job="job-a")
    cmd = c.pending_commands("n1")[0]
    core_clock.advance(1)
    c.ingest_report(
        r.report(now=core_clock.now(), dbe=1, events=(_result_event(1, cmd.id, ok=False),)),
        actor="a",
    )
    c.tick()
    (incident,) = c.list_incidents()
    drain = next(a for a in c.get_incident(incident.id).actions if a.kind == "drain")
    assert drain.state == "failed" and "boom" in drain.result
    assert [n.page for n in pager.sent] == [False, True]


def test_resolved_condition_resolves_incident_and_sends_resolve(
    make_core, core_clock, core_notifier
):
    c = make_core()
    r = Reporter("n1")
    _fire_dbe(c, core_clock, r)
    core_clock.advance(1)
    c.ingest_report(r.report(now=core_clock.now(), dbe=0), actor="a")
    c.tick()
    (incident,) = c.list_incidents()
    assert incident.state == "resolved" and incident.resolved_at == core_clock.now()
    assert [n.event for n in core_notifier.sent] == ["trigger", "resolve"]


def test_firing_again_within_cooldown_opens_no_new_incident(make_core, core_clock):
    c = make_core()
    r = Reporter("n1")
    _fire_dbe(c, core_clock, r)
    core_clock.advance(1)
    c.ingest_report(r.report(now=core_clock.now(), dbe=0), actor="a")
    c.tick()
    core_clock.advance(60)  # cooldown is 10 minutes
    _fire_dbe(c, core_clock, r)
    core_clock.advance(1)
    c.tick()
    (incident,) = c.list_incidents()
    notes = [t for t in c.get_incident(incident.id).timeline if t.kind == "cooldown"]
    assert len(notes) == 1


def test_silenced_rule_suppresses_incident_without_actions(make_core, core_clock, core_notifier):
    c = make_core()
    c.create_silence(rule="gpu_dbe", node=None, duration_s=600, comment="burn-in", actor="op")
    _fire_dbe(c, core_clock, Reporter("n1"))
    (incident,) = c.list_incidents()
    assert incident.state == "suppressed"
    assert c.get_incident(incident.id).actions == ()
    assert core_notifier.sent == [] and c.get_node("n1").state == "active"


def test_expired_silence_no_longer_matches(make_core, core_clock):
    c = make_core()
    c.create_silence(rule=None, node="n1", duration_s=10, comment="", actor="op")
    core_clock.advance(11)
    _fire_dbe(c, core_clock, Reporter("n1"))
    assert c.list_incidents()[0].state == "mitigated"
    assert c.list_silences() == [] and len(c.list_silences(include_expired=True)) == 1


@pytest.mark.parametrize(
    ("rule", "node", "duration_s"),
    [(None, None, 60.0), ("gpu_dbe", None, 0.0)],
    ids=["no-rule-no-node", "zero-duration"],
)
def test_bad_silence_is_rejected(make_core, rule, node, duration_s):
    c = make_core()
    with pytest.raises(BadRequest):
        c.create_silence(rule=rule, node=node, duration_s=duration_s, comment="", actor="op")


def test_dry_run_records_intended_actions_and_executes_none(make_core, core_clock, core_notifier):
    c = make_core(safety={"dry_run": True})
    _fire_dbe(c, core_clock, Reporter("n1"))
    (incident,) = c.list_incidents()
    actions = c.get_incident(incident.id).actions
    assert {a.state for a in actions} == {"skipped"}
    assert all("dry-run" in a.result for a in actions)
    assert core_notifier.sent == [] and c.get_node("n1").state == "active"


def test_exhausted_drain_budget_pages_instead_of_draining(make_core, core_clock, core_notifier):
    c = make_core(safety={"drain_budget": 1, "breaker_threshold": 10})
    _fire_dbe(c, core_clock, Reporter("n1"))
    _fire_dbe(c, core_clock, Reporter("n2"))
    assert c.get_node("n1").state == "drained" and c.get_node("n2").state == "active"
    second = c.list_incidents(node="n2")[0]
    detail = c.get_incident(second.id)
    drain = next(a for a in detail.actions if a.kind == "drain")
    assert drain.state == "skipped" and "budget exhausted" in drain.result
    assert any(t.kind == "safety" and "budget" in t.message for t in detail.timeline)
    pages = [n for n in core_notifier.sent if n.page]
    assert len(pages) == 1 and pages[0].incident_id == second.id


@BOTH_STORES
def test_breaker_trips_when_many_nodes_hit_one_rule_and_pages_once(
    make_core, core_clock, core_notifier
):
    c = make_core(safety={"breaker_threshold": 2, "drain_budget": 10})
    for name in ("n1", "n2", "n3", "n4"):
        _fire_dbe(c, core_clock, Reporter(name))
    states = {n: c.get_node(n).state for n in ("n1", "n2", "n3", "n4")}
    assert states == {"n1": "drained", "n2": "drained", "n3": "active", "n4": "active"}
    pages = [n for n in core_notifier.sent if n.page]
    assert len(pages) == 1 and "circuit breaker" in pages[0].reason
    n4 = c.get_incident(c.list_incidents(node="n4")[0].id)
    drain = next(a for a in n4.actions if a.kind == "drain")
    assert drain.state == "skipped" and "paged on incident" in drain.result


def test_drain_is_not_executed_on_stale_node_data(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    core_clock.advance(30)  # node silent for longer than stale_after_s (10 s)
    decision = Decision(
        rule="gpu_dbe",
        target=Target(scope="gpu", node="n1", gpu=0),
        state="firing",
        severity="critical",
        actions=("drain",),
    )
    c.apply_decisions([decision], now=core_clock.now())
    c.run_actions(now=core_clock.now())
    (incident,) = c.list_incidents()
    (drain,) = c.get_incident(incident.id).actions
    assert drain.state == "skipped" and "stale" in drain.result
    assert c.get_node("n1").state == "active"


def test_node_silent_rule_may_drain_on_stale_data(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    core_clock.advance(30)
    decision = Decision(
        rule="node_silent",
        target=Target(scope="node", node="n1"),
        state="firing",
        severity="critical",
        actions=("drain",),
    )
    c.apply_decisions([decision], now=core_clock.now())
    c.run_actions(now=core_clock.now())
    assert c.get_node("n1").state == "drained"


def test_job_steps_for_a_node_without_a_job_are_skipped_with_a_timeline_entry(
    make_core, core_clock
):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    decision = Decision(
        rule="gpu_dbe",
        target=Target(scope="gpu", node="n1", gpu=0),
        state="firing",
        severity="critical",
        actions=("checkpoint", "drain", "replace", "restart"),
    )
    c.apply_decisions([decision], now=core_clock.now())
    c.run_actions(now=core_clock.now())
    detail = c.get_incident(c.list_incidents()[0].id)
    assert [(a.kind, a.state) for a in detail.actions] == [
        ("checkpoint", "skipped"),
        ("drain", "succeeded"),
        ("replace", "skipped"),
        ("restart", "skipped"),
    ]
    skipped = [t.message for t in detail.timeline if t.kind == "action_skipped"]
    assert any("replace" in m and "no job runs on n1" in m for m in skipped)


def test_open_incident_whose_condition_cleared_during_downtime_resolves_after_restart(
    make_core, core_clock
):
    c = make_core()
    r = Reporter("n1")
    _fire_dbe(c, core_clock, r)
    c.stop()
    c2 = make_core()
    core_clock.advance(1)
    c2.ingest_report(r.report(now=core_clock.now(), dbe=0), actor="a")
    c2.tick()
    assert c2.list_incidents()[0].state == "resolved"


def test_incident_survives_restart_and_is_not_reopened(make_core, core_clock):
    c = make_core()
    r = Reporter("n1")
    _fire_dbe(c, core_clock, r)
    c.stop()
    c2 = make_core()
    core_clock.advance(1)
    _fire_dbe(c2, core_clock, r)
    assert len(c2.list_incidents()) == 1


@BOTH_STORES
def test_operator_drain_is_idempotent_and_audited(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    assert c.drain("n1", reason="bad fan", actor="alice").state == "drained"
    assert c.drain("n1", reason="bad fan", actor="alice").state == "drained"
    assert c.get_node("n1").drain_reason == "bad fan"
    assert c.undrain("n1", actor="bob").state == "active"
    assert [(e.actor, e.action) for e in c.audit_log()] == [
        ("bob", "undrain"),
        ("alice", "drain"),
        ("alice", "drain"),
    ]


def test_operator_calls_on_unknown_node_raise_not_found(make_core):
    c = make_core()
    for call in (
        lambda: c.get_node("nope"),
        lambda: c.drain("nope", reason="x", actor="a"),
        lambda: c.undrain("nope", actor="a"),
        lambda: c.set_role("nope", role="spare", actor="a"),
        lambda: c.inject_fault("nope", FaultSpec(kind="dbe"), actor="a"),
        lambda: c.get_incident(99),
        lambda: c.get_job("nope"),
        lambda: c.delete_silence(99, actor="a"),
    ):
        with pytest.raises(NotFound):
            call()


def test_set_role_marks_spare(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    assert c.set_role("n1", role="spare", actor="op").role == "spare"
    assert c.audit_log()[0].detail == {"role": "spare"}


def test_jobs_are_listed_from_reported_ranks(make_core, core_clock):
    c = make_core()
    report = Report(
        node="n1",
        instance="i",
        seq=1,
        sent_at=0,
        ranks=(
            RankState(job="job-a", rank=0, step=10, ckpt_step=8),
            RankState(job="job-a", rank=1, step=11),
        ),
    )
    c.ingest_report(report, actor="a")
    job = c.get_job("job-a")
    assert (job.nodes, job.ranks, job.last_step, job.ckpt_step) == (("n1",), 2, 11, 8)
    assert c.get_node("n1").job == "job-a"


def test_the_job_view_shows_the_checkpoint_health_of_its_ranks(make_core, core_clock):
    c = make_core()
    report = Report(
        node="n1",
        instance="i",
        seq=1,
        sent_at=0,
        ranks=(
            RankState(job="job-a", rank=0, step=40, ckpt_step=30, ckpt_age_s=12.0),
            RankState(job="job-a", rank=1, step=40, ckpt_step=20, ckpt_age_s=95.0, ckpt_failures=1),
        ),
    )
    c.ingest_report(report, actor="a")
    job = c.get_job("job-a")
    # the oldest rank's commit and the most failures in a row any rank has
    assert (job.ckpt_age_s, job.ckpt_failures) == (95.0, 1)
    (listed,) = c.list_jobs()
    assert (listed.ckpt_age_s, listed.ckpt_failures) == (95.0, 1)


def test_checkpoint_failing_opens_an_incident_and_notifies(make_core, core_clock, core_notifier):
    c = make_core(rules=[str(default_rules_path())])
    r = Reporter("n1")
    failing = (
        RankState(job="job-a", rank=0, step=500, ckpt_step=100, ckpt_failures=3, ckpt_age_s=9.0),
    )
    for _ in range(62):  # past the rule's for: 1m
        core_clock.advance(1)
        report = dataclasses.replace(r.report(now=core_clock.now()), ranks=failing)
        c.ingest_report(report, actor="a")
        c.tick()
    (incident,) = [i for i in c.list_incidents() if i.rule == "checkpoint_failing"]
    assert (incident.target, incident.job, incident.severity) == (
        "job:job-a",
        "job-a",
        "warning",
    )
    detail = c.get_incident(incident.id)
    assert [(a.kind, a.state) for a in detail.actions] == [("notify", "succeeded")]
    assert "trigger" in [n.event for n in core_notifier.sent]
    assert c.get_job("job-a").ckpt_failures == 3


def test_reload_with_a_bad_rule_file_keeps_the_old_rules(make_core, core_config, tmp_path):
    c = make_core()
    assert c.reload_rules(actor="op") == 3
    (tmp_path / "rules.yaml").write_text("rules:\n  - name: x\n")
    with pytest.raises(BadRequest, match="running rules stay"):
        c.reload_rules(actor="op")
    assert c.rule_count == 3


def test_start_and_stop_run_ticks_in_the_background(make_core, core_clock):
    c = make_core(tick_interval_s=0.05, stale_after_s=1.0)
    c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    c.start()
    wait_for(
        lambda: c.store.nodes.get("n1").last_report_at is not None,
        timeout_s=10,
        what="the tick thread to flush freshness",
    )
    c.stop()
    assert not c.running


def test_a_wedged_tick_stops_counting_as_ticking_on_the_injected_clock(
    make_core, core_clock, monkeypatch
):
    """The systemd watchdog's liveness is measured on the controller's clock: a tick round
    that hangs is no longer ticking once that clock has passed the limit."""
    entered, release = threading.Event(), threading.Event()
    evaluate = engine.evaluate

    def wedged(**kwargs: Any) -> Any:
        entered.set()
        release.wait(30)
        return evaluate(**kwargs)

    monkeypatch.setattr(engine, "evaluate", wedged)
    c = make_core(tick_interval_s=0.05)
    c.start()
    try:
        wait_for(entered.is_set, timeout_s=10, what="the tick thread to start a round")
        assert c.ticking(within_s=30)
        core_clock.advance(31)
        assert not c.ticking(within_s=30)
    finally:
        release.set()
        c.stop()


def test_open_incident_is_not_resolved_after_restart_before_its_node_reports(make_core, core_clock):
    c = make_core()
    r = Reporter("n1")
    _fire_dbe(c, core_clock, r)
    c.stop()
    c2 = make_core()
    for _ in range(3):
        core_clock.advance(1)
        c2.tick()  # no report yet: the signals know nothing about n1
    assert c2.list_incidents()[0].state == "mitigated"
    _fire_dbe(c2, core_clock, r)  # reports again, still faulty: the same incident
    assert len(c2.list_incidents()) == 1


def test_unusable_store_is_reported_as_a_config_error(make_core, tmp_path):
    bad = tmp_path / "not-a-db"
    bad.write_bytes(b"garbage" * 1000)
    with pytest.raises(ConfigError, match=r"store\.path: .*not an SQLite database"):
        make_core(store={"path": str(bad)})
