"""After a finished remediation, its leftovers do not start another: the node it took out of
the job (silent, drained) and the job's old attempt are recorded on the incident that did it,
while a new fault on a node still in the job opens a new incident (FakeClock, FakeJobAgents
through Controller.ingest_report)."""

from __future__ import annotations

from typing import Any

from tests.builders import gpu
from tests.unit.controller.job_sim import JOB_RULES, Sim, running
from trainguard.controller.model import Decision, Target

# node_silent only after 20 s: the crash restart (which swaps the dead node out) has ended by
# then, so no remediation in progress covers it any more
LATE_SILENT = JOB_RULES.replace(
    """    condition: report_age_s > 5 and role == "active" and state == "active"
    severity: critical""",
    """    condition: report_age_s > 5 and role == "active" and state == "active"
    for: 20s
    severity: critical""",
)
LATE_XID = """
  - name: gpu_xid_late
    scope: gpu
    condition: ecc_uncorrected_volatile_total > 0
    for: 30s
    severity: critical
    actions: [notify, checkpoint, drain, replace, restart]
    summary: XID 48
"""


def _rules(sim: Sim, text: str) -> None:
    with open(sim.rules, "w") as f:
        f.write(text)
    sim.c.reload_rules(actor="test")


def _crash_restart_without_n1(sim: Sim) -> Any:
    """Node death: n1 falls silent and n2's processes crash; the job_process_failed incident
    restarts the job on n3 + n2 and ends. Returns that incident's detail."""
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(5)
    sim.agents["n1"].silent = True
    sim.agents["n2"].crash("job")
    # n1 is silent: attempt 2 waits for its attempt_lease_s (6 s) to run out
    sim.until(running(sim, attempt=2), max_s=25, what="restart without n1")
    sim.until(
        lambda: sim.incident("job_process_failed").incident.state in ("mitigated", "resolved"),
        max_s=10,
        what="the crash remediation ended",
    )
    assert sim.c.get_job("job").nodes == ("n3", "n2")
    assert [i.rule for i in sim.c.list_incidents()] == ["job_process_failed"]
    return sim.incident("job_process_failed")


def test_silent_node_swapped_out_by_a_finished_restart_opens_no_second_remediation(
    sim: Sim,
) -> None:
    _rules(sim, LATE_SILENT)
    _crash_restart_without_n1(sim)
    sim.second(30)  # node_silent on n1 fires now
    assert [i.rule for i in sim.c.list_incidents()] == ["job_process_failed"]
    detail = sim.incident("job_process_failed")
    (note,) = [t for t in detail.timeline if t.kind == "correlated"]
    assert note.data["rule"] == "node_silent" and note.data["target"] == "node:n1"
    assert "n1 was taken out of job job" in note.message
    assert "not remediated again" in note.message
    # the dead node is still taken out of scheduling, on the same incident; the job is not
    steps = [(a.kind, a.state) for a in detail.actions if a.kind != "notify"]
    assert steps == [("replace", "succeeded"), ("restart", "succeeded"), ("drain", "succeeded")]
    assert sim.c.node_state("n1") == "drained"
    job = sim.c.get_job("job")
    assert (job.attempt, job.restarts, job.state) == (2, 1, "running")
    assert [a["attempt"] for a in sim.cmds("n2", "start_job")] == [1, 2]


def test_new_fault_on_a_node_still_in_the_job_after_the_restart_opens_a_new_incident(
    sim: Sim,
) -> None:
    _rules(sim, LATE_SILENT)
    sim.add("n4", role="spare")
    _crash_restart_without_n1(sim)
    sim.second(30)
    sim.agents["n2"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=3), max_s=30, what="a restart for the new fault")
    detail = sim.incident("gpu_dbe")
    assert detail.incident.state in ("acting", "mitigated")
    assert sim.c.get_job("job").nodes == ("n3", "n4")
    assert sim.c.get_job("job").restarts == 2


def test_drained_nodes_own_hardware_rule_does_not_drain_or_restart_again(
    sim: Sim,
) -> None:
    _rules(sim, JOB_RULES + LATE_XID)
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(5)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    sim.until(
        lambda: sim.incident("gpu_dbe").incident.state == "mitigated", max_s=10, what="mitigated"
    )
    sim.second(40)  # gpu_xid_late fires on the drained n1 now
    assert [i.rule for i in sim.c.list_incidents()] == ["gpu_dbe"]
    detail = sim.incident("gpu_dbe")
    (note,) = [t for t in detail.timeline if t.kind == "correlated"]
    assert note.data["rule"] == "gpu_xid_late" and "n1 is drained" in note.message
    assert [a.kind for a in detail.actions].count("drain") == 1
    assert sim.c.get_job("job").restarts == 1


def test_hardware_rule_on_a_node_an_operator_drained_notifies_but_remediates_nothing(
    sim: Sim,
) -> None:
    sim.c.drain("n1", reason="maintenance", actor="ops")
    sim.second(2)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.second(2)
    detail = sim.incident("gpu_dbe")
    states = {a.kind: (a.state, a.result) for a in detail.actions}
    assert states["notify"][0] in ("succeeded", "running", "pending")
    for kind in ("checkpoint", "drain", "replace", "restart"):
        assert states[kind] == ("skipped", "skipped: n1 is drained, out of every job already")


def _decision(
    target: Target,
    *,
    rule: str,
    since: float,
    actions: tuple[str, ...] = ("notify", "collect_stacks", "restart"),
) -> Decision:
    return Decision(
        rule=rule,
        target=target,
        state="firing",
        severity="critical",
        actions=actions,
        since=since,
    )


def test_old_attempt_rank_and_job_decisions_are_recorded_not_remediated(
    sim: Sim,
) -> None:
    host = _crash_restart_without_n1(sim)
    job = sim.c.store.jobs.get("job")
    assert job is not None and job.attempt_started_at is not None
    now = sim.clock.now()
    old_rank = _decision(
        Target(scope="rank", job="job", rank=0, node="n1"), rule="rank_silent", since=now
    )
    old_stall = _decision(
        Target(scope="job", job="job"), rule="training_stall", since=job.attempt_started_at - 1
    )
    assert sim.c.apply_decisions([old_rank, old_stall], now=now) == []
    notes = {
        t.data["rule"]: t.message
        for t in sim.c.get_incident(host.incident.id).timeline
        if t.kind == "correlated"
    }
    assert "rank 0 on n1 is not part of attempt 2 of job job" in notes["rank_silent"]
    assert "began before attempt 2 of job job started" in notes["training_stall"]
    # the same decisions on the next tick add nothing more
    sim.c.apply_decisions([old_rank, old_stall], now=now + 1)
    again = [
        t.data["rule"]
        for t in sim.c.get_incident(host.incident.id).timeline
        if t.kind == "correlated"
    ]
    assert sorted(again) == ["node_silent", "rank_silent", "training_stall"]
    assert sim.c.get_job("job").attempt == 2


def test_current_attempt_rank_decision_opens_an_incident(sim: Sim) -> None:
    _crash_restart_without_n1(sim)
    now = sim.clock.now()
    current = _decision(
        Target(scope="rank", job="job", rank=1, node="n2"), rule="rank_silent", since=now
    )
    (opened,) = sim.c.apply_decisions([current], now=now)
    detail = sim.c.get_incident(opened)
    assert [a.kind for a in detail.actions if a.kind != "notify"] == ["collect_stacks", "restart"]
    assert all(a.state == "pending" for a in detail.actions if a.kind != "notify")


def test_a_notify_only_rule_that_outlasts_a_restart_still_notifies(sim: Sim) -> None:
    # throughput_drop began before the restart and still holds after it: nothing to
    # remediate twice, but someone should hear of it
    _crash_restart_without_n1(sim)
    job = sim.c.store.jobs.get("job")
    assert job is not None and job.attempt_started_at is not None
    now = sim.clock.now()
    drop = _decision(
        Target(scope="job", job="job"),
        rule="throughput_drop",
        since=job.attempt_started_at - 1,
        actions=("notify",),
    )
    (opened,) = sim.c.apply_decisions([drop], now=now)
    detail = sim.c.get_incident(opened)
    assert detail.incident.rule == "throughput_drop"
    assert [a.kind for a in detail.actions] == ["notify"] * len(detail.actions)
