"""In-process recovery of a killed rank on a FakeClock (job_sim.Sim, FakeJobAgents): a rank of
a job with `recovery.in_process` exits non-zero on a healthy node, the job crashes, and
job_process_failed's replace step gives that node's slot to the spare's warm standby
(controller.actions.standbyswap); the survivors rejoin under the next epoch, no relaunch, and
the crashed node joins the spares. Anything missing: the full restart, the reason in the
timeline; a job without recovery.in_process restarts in full as ever."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.controller.job_sim import Sim, running
from tests.unit.controller.test_inprocess_recovery import MODULE, Crash, _crash_once, members
from trainguard.controller.actions.standbyswap import StandbySwap
from trainguard.controller.jobs import JobManager
from trainguard.protocol import StandbyState

RULE = "job_process_failed"


def start(sim: Sim, *, in_process: bool = True, **spec: Any) -> None:
    sim.agents["n3"].standby = StandbyState(module=MODULE, ready=True)
    recovery = {"recovery": {"in_process": True}} if in_process else {}
    sim.submit(nodes=["n1", "n2"], **recovery, **spec)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)


def outputs(sim: Sim, kind: str) -> dict[str, Any]:
    (step,) = [a for a in sim.incident(RULE).actions if a.kind == kind]
    return sim.c.store.actions.output(step.id)


def timeline(sim: Sim) -> str:
    return " | ".join(t.message for t in sim.incident(RULE).timeline)


def mitigated(sim: Sim) -> Callable[[], bool]:
    return lambda: sim.incident(RULE).incident.state in ("mitigated", "resolved")


def assert_recovered_in_process(sim: Sim, *, survivor_pid: int) -> None:
    # no relaunch: the survivor kept its process, the spare's standby took the killed rank
    assert [a["attempt"] for n in ("n1", "n2") for a in sim.cmds(n, "start_job")] == [1, 1]
    assert sim.cmds("n3", "start_job") == []
    assert sim.agents["n2"].launches["job"].pids[0] == survivor_pid
    (survivor,) = members(sim, "n2")
    (standby,) = members(sim, "n3")
    assert (survivor.rank, survivor.host_store, standby.rank) == (0, True, 1)
    assert survivor.epoch == standby.epoch == 2
    job = sim.c.get_job("job")
    assert (job.nodes, job.attempt, job.state) == (("n3", "n2"), 2, "running")
    # the crashed node is healthy: not drained, out of the job, a spare (the pool keeps size)
    n1 = sim.c.get_node("n1")
    assert (n1.role, n1.state, n1.job) == ("spare", "active", None)
    assert sim.c.get_node("n3").role == "active"
    replace = outputs(sim, "replace")
    assert (replace["mode"], replace["replaced"], replace["to_spares"]) == (
        "spare",
        {"n1": "n3"},
        ["n1"],
    )
    assert outputs(sim, "restart")["mode"] == "in_process"


def test_a_killed_rank_is_recovered_in_process_and_its_node_becomes_a_spare(sim: Sim) -> None:
    start(sim)
    survivor_pid = sim.agents["n2"].launches["job"].pids[0]
    sim.agents["n1"].crash("job", code=-9)
    sim.until(running(sim, attempt=2), max_s=30, what="recovered under epoch 2")
    sim.until(mitigated(sim), max_s=10, what="mitigated")
    assert_recovered_in_process(sim, survivor_pid=survivor_pid)
    text = timeline(sim)
    assert (
        "a rank exited on n1 (the node is healthy): its slot goes to the warm standby on n3" in text
    )
    assert "replaced n1 -> n3" in text and "n1 is a spare" in text
    assert "recovered in process: epoch 2" in text
    assert "fell back" not in text
    # the swap was decided once, applied once
    assert sim.c.store.nodes.get("n1").role == "spare"


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        (lambda s: setattr(s.agents["n3"], "standby", None), "spare n3 reports no warm standby"),
        (
            lambda s: setattr(s.agents["n3"], "standby", StandbyState(module=MODULE)),
            "spare n3's warm standby is not ready",
        ),
        (
            lambda s: setattr(s.agents["n3"], "standby", StandbyState(module="other", ready=True)),
            "spare n3's standby runs module 'other', not 'train'",
        ),
        (lambda s: s.c.set_role("n3", role="active", actor="t"), "no free spare"),
        (lambda s: s.agents["n2"].crash("job"), "ranks exited on 2 nodes (n1, n2)"),
        (
            lambda s: s.agents["n2"].crash("job", code=0),
            "n2 report(s) no rank of the job: no survivor to rejoin",
        ),
    ],
    ids=["no-standby", "not-ready", "other-module", "no-spare", "two-nodes", "no-survivor"],
)
def test_without_what_the_swap_needs_the_full_restart_runs_and_says_why(
    sim: Sim, setup: Callable[[Sim], None], reason: str
) -> None:
    start(sim)
    setup(sim)
    sim.agents["n1"].crash("job")
    sim.until(running(sim, attempt=2), max_s=40, what="full restart")
    # today's restart: the same nodes relaunched, nothing swapped, n1 still in the job
    assert [a["attempt"] for a in sim.cmds("n1", "start_job")] == [1, 2]
    assert sim.cmds("n2", "rejoin") == [] and sim.cmds("n3", "assign_standby") == []
    assert sim.c.get_job("job").nodes == ("n1", "n2")
    assert sim.c.get_node("n1").role == "active"
    assert f"in-process recovery fell back to a full restart ({reason}" in timeline(sim)
    assert reason in outputs(sim, "restart")["in_process"]["reason"]


def test_several_ranks_per_node_restart_in_full(sim: Sim) -> None:
    start(sim, nproc_per_node=2)
    sim.agents["n1"].crash("job")
    sim.until(running(sim, attempt=2), max_s=40, what="full restart")
    assert sim.c.get_job("job").nodes == ("n1", "n2")
    assert "2 ranks per node: a spare's standby is one rank" in timeline(sim)


def test_a_job_without_in_process_recovery_restarts_in_full_as_ever(sim: Sim) -> None:
    start(sim, in_process=False)
    sim.agents["n1"].crash("job")
    sim.until(running(sim, attempt=2), max_s=40, what="full restart")
    assert [a["attempt"] for n in ("n1", "n2") for a in sim.cmds(n, "start_job")] == [1, 2, 1, 2]
    assert sim.cmds("n3", "assign_standby") == [] and sim.c.get_node("n3").role == "spare"
    assert sim.c.get_node("n1").role == "active"
    replace = outputs(sim, "replace")
    assert replace["mode"] == "none" and "standby_swap_skipped" not in replace
    text = timeline(sim)
    assert "in-process" not in text and "standby" not in text


@pytest.mark.parametrize("where", ["decided", "placed"])
def test_a_controller_killed_mid_swap_swaps_once(
    sim: Sim, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    start(sim)
    survivor_pid = sim.agents["n2"].launches["job"].pids[0]
    if where == "decided":  # the decision stored, the job not yet moved
        _crash_once(monkeypatch, StandbySwap, "_apply", after=False)
    else:  # the job moved (n1 a spare), the step's outcome not stored
        _crash_once(monkeypatch, JobManager, "place", after=True)
    sim.agents["n1"].crash("job")
    crashed = False
    for _ in range(20):
        try:
            sim.second()
        except Crash:
            crashed = True
            sim.c.stop()
            sim.c = sim.new_controller()
            monkeypatch.undo()
            break
    assert crashed, f"the controller never reached {where}"
    sim.until(running(sim, attempt=2), max_s=40, what="recovered in process after the crash")
    sim.until(mitigated(sim), max_s=20, what="mitigated")
    assert_recovered_in_process(sim, survivor_pid=survivor_pid)
    assert len(sim.cmds("n3", "assign_standby")) == 1
