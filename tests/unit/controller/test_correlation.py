"""One fault, one remediation: decisions that fire while an incident is remediating the same
node or job attach to it (FakeClock, FakeJobAgents through Controller.ingest_report)."""

from __future__ import annotations

from tests.builders import gpu
from tests.unit.controller.job_sim import JOB_RULES, Sim, running

SECOND_RULE = """
  - name: gpu_dbe_xid
    scope: gpu
    condition: ecc_uncorrected_volatile_total > 0
    severity: critical
    actions: [notify, checkpoint, drain, replace, restart]
    summary: XID 48
"""


def test_two_rules_for_one_fault_make_one_incident_and_one_restart(sim: Sim) -> None:
    with open(sim.rules, "w") as f:
        f.write(JOB_RULES + SECOND_RULE)
    assert sim.c.reload_rules(actor="test") == 5
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(5)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    sim.second(5)
    incidents = sim.c.list_incidents()
    assert len(incidents) == 1, [(i.rule, i.target) for i in incidents]
    detail = sim.c.get_incident(incidents[0].id)
    correlated = [t for t in detail.timeline if t.kind == "correlated"]
    assert len(correlated) == 1 and correlated[0].data["target"] == "gpu:n1:0"
    assert [a.kind for a in detail.actions].count("restart") == 1
    assert [a["attempt"] for a in sim.cmds("n2", "start_job")] == [1, 2]
    assert sim.c.get_job("job").restarts == 1


def test_dead_node_during_a_crash_restart_is_swapped_and_drained_in_the_same_incident(
    sim: Sim,
) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(5)
    # node death: n1 falls silent and its peer's processes crash in the collective
    sim.agents["n1"].silent = True
    sim.agents["n2"].crash("job")
    sim.until(running(sim, attempt=2), max_s=40, what="restart without n1")
    sim.until(lambda: sim.c.node_state("n1") == "drained", max_s=10, what="n1 drained")
    assert sim.c.get_job("job").nodes == ("n3", "n2")
    incidents = sim.c.list_incidents()
    assert [i.rule for i in incidents] == ["job_process_failed"]
    detail = sim.c.get_incident(incidents[0].id)
    steps = [(a.kind, a.state) for a in detail.actions if a.kind != "notify"]
    assert steps == [("replace", "succeeded"), ("restart", "succeeded"), ("drain", "succeeded")]
    assert any(t.kind == "correlated" and t.data["rule"] == "node_silent" for t in detail.timeline)
    assert sim.c.get_job("job").restarts == 1
