"""In-process recovery on a FakeClock (job_sim.Sim, FakeJobAgents): a job with
`recovery.in_process` whose node fails is recovered by the survivors rejoining with the spare's
warm standby, no relaunch; anything that fails falls back to the full restart with the reason
in the timeline; a controller killed at any step of the path neither repeats nor loses one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.builders import gpu
from tests.unit.controller.job_sim import Sim, running
from trainguard.controller.actions.inprocess import InProcessRecovery, job_module, plan_world
from trainguard.controller.jobs import JobSpec
from trainguard.membership import Membership
from trainguard.protocol import RankState, StandbyState
from trainguard.strict import build

MODULE = "train"  # examples/train.py runs as module `train` in a standby


def start(sim: Sim, *, ready: bool = True, **spec: Any) -> None:
    sim.agents["n3"].standby = StandbyState(module=MODULE, ready=ready)
    sim.submit(nodes=["n1", "n2"], recovery={"in_process": True}, **spec)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)


def restart_output(sim: Sim) -> dict[str, Any]:
    detail = sim.incident("gpu_dbe")
    (restart,) = [a for a in detail.actions if a.kind == "restart"]
    return sim.c.store.actions.output(restart.id)


def text_of_restart(sim: Sim) -> str:
    (restart,) = [a for a in sim.incident("gpu_dbe").actions if a.kind == "restart"]
    return restart.result


def timeline(sim: Sim) -> str:
    return " | ".join(t.message for t in sim.incident("gpu_dbe").timeline)


def members(sim: Sim, node: str) -> list[Membership]:
    out = []
    for args in sim.cmds(node, "rejoin"):
        out += [Membership.from_json(r["membership"]) for r in args["ranks"]]
    for args in sim.cmds(node, "assign_standby"):
        out.append(Membership.from_json(args["membership"]))
    return out


def test_a_lost_node_is_recovered_in_process_with_the_spares_standby(sim: Sim) -> None:
    start(sim)
    survivor_pid = sim.agents["n2"].launches["job"].pids[0]
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="recovered under epoch 2")
    sim.until(
        lambda: sim.incident("gpu_dbe").incident.state == "mitigated", max_s=10, what="mitigated"
    )
    # no relaunch: the survivor kept its process, the spare's standby became the rank
    assert [a["attempt"] for a in sim.cmds("n2", "start_job")] == [1]
    # launched with static rendezvous: no torchrun polls the first node's store meanwhile
    assert [(a["rdzv_backend"], a["node_rank"]) for a in sim.cmds("n2", "start_job")] == [
        ("static", 1)
    ]
    assert sim.cmds("n3", "start_job") == []
    assert sim.agents["n2"].launches["job"].pids[0] == survivor_pid
    # rank 0 (n1) was lost: the survivor becomes rank 0 and runs the store, the standby rank 1
    (survivor,) = members(sim, "n2")
    (standby,) = members(sim, "n3")
    assert (survivor.rank, survivor.host_store, survivor.store_host) == (0, True, "10.0.0.1")
    assert (standby.rank, standby.host_store, standby.world_size) == (1, False, 2)
    assert survivor.epoch == standby.epoch == 2
    assert survivor.store_port == standby.store_port == 29600 + 2 % 16
    assign = sim.cmds("n3", "assign_standby")[0]
    assert (assign["module"], assign["epoch"]) == (MODULE, 2)
    # the lost node's ranks: killed at once by the drain (no SIGTERM agreement to stop)
    assert {a["grace_s"] for a in sim.cmds("n1", "stop_job")} == {0.0}
    out = restart_output(sim)
    assert out["mode"] == "in_process" and out["in_process"]["phase"] == "done"
    assert set(out["phases_s"]) >= {"detect", "restart", "mttr"}
    # lost work: the newest step any rank reached, less the survivor's (its state goes on)
    kept = out["in_process"]["survivor_step"]
    assert out["lost_steps"] == out["in_process"]["last_step"] - kept >= 0
    assert f"lost steps {out['lost_steps']}" in text_of_restart(sim)
    text = timeline(sim)
    assert "in-process recovery: n1's rank(s) go to the warm standby on n3" in text
    assert "recovered in process: epoch 2" in text
    job = sim.c.get_job("job")
    assert (job.nodes, job.attempt, job.recovery) == (("n3", "n2"), 2, "in_process")


def test_the_spare_placed_in_the_job_is_still_told_to_keep_its_standby_until_it_runs_a_rank(
    sim: Sim,
) -> None:
    """The replace step makes n3 an active node of the job before the restart step assigns
    its standby; an answer saying "not a spare" in between would make its agent stop the
    standby it is about to assign (seen in the soak: "the warm standby is not ready")."""
    start(sim)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(lambda: "n3" in sim.c.get_job("job").nodes, max_s=30, what="n3 placed")
    assert sim.c.live.node_role("n3") == "active" and "job" not in sim.agents["n3"].launches
    resp = sim.c.ingest_report(sim.agents["n3"].report(now=sim.clock.now()), actor="t")
    assert resp.spare is True
    sim.until(running(sim, attempt=2), max_s=30, what="recovered under epoch 2")
    resp = sim.c.ingest_report(sim.agents["n3"].report(now=sim.clock.now()), actor="t")
    assert resp.spare is False  # its standby is the job's rank now
    # a node of a job that never ran in process is never told to keep one
    resp = sim.c.ingest_report(sim.agents["n2"].report(now=sim.clock.now()), actor="t")
    assert resp.spare is False


def test_the_replace_step_takes_a_spare_with_a_ready_standby_before_one_earlier_by_name(
    sim: Sim,
) -> None:
    """n0 sorts before n3 but its standby is not ready: n3 takes the job and heals it in
    process (by name, n0 would have forced a full restart)."""
    sim.add("n0", role="spare").standby = StandbyState(module=MODULE, ready=False)
    start(sim)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="recovered under epoch 2")
    assert sim.c.get_job("job").nodes == ("n3", "n2")
    assert restart_output(sim)["mode"] == "in_process"
    assert sim.cmds("n0", "assign_standby") == [] and sim.cmds("n0", "start_job") == []


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
    ],
    ids=["no-standby", "not-ready", "other-module"],
)
def test_without_a_ready_standby_the_full_restart_runs_and_says_why(
    sim: Sim, setup: Callable[[Sim], None], reason: str
) -> None:
    start(sim)
    setup(sim)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="full restart")
    assert [a["attempt"] for a in sim.cmds("n3", "start_job")] == [2]
    assert sim.cmds("n2", "rejoin") == [] and sim.cmds("n3", "assign_standby") == []
    assert f"in-process recovery fell back to a full restart ({reason})" in timeline(sim)
    assert restart_output(sim)["in_process"]["reason"] == reason
    sim.until(
        lambda: any(a.kind == "restart" and a.state == "succeeded"
                    for a in sim.incident("gpu_dbe").actions),
        max_s=30,
        what="the restart step done",
    )  # fmt: skip
    (restart,) = [a for a in sim.incident("gpu_dbe").actions if a.kind == "restart"]
    assert restart.result.startswith(f"in-process recovery fell back to a full restart ({reason});")


def test_a_refused_assignment_falls_back_to_a_restart_of_a_newer_attempt(sim: Sim) -> None:
    start(sim)
    sim.agents["n3"].assign_fails = "the warm standby is not ready"
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=3), max_s=40, what="full restart after the fallback")
    # the rejoin went out under epoch 2, so the restart is attempt 3: newer than anything
    # the rejoin may have started; every node of the job was stopped first
    assert [a["attempt"] for a in sim.cmds("n3", "start_job")] == [3]
    assert [a["attempt"] for a in sim.cmds("n2", "start_job")] == [1, 3]
    assert len(sim.cmds("n2", "rejoin")) == 1
    assert "assign_standby on n3 failed: the warm standby is not ready" in timeline(sim)


def test_a_world_that_does_not_train_by_the_deadline_falls_back(sim: Sim) -> None:
    start(sim)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(lambda: bool(sim.cmds("n3", "assign_standby")), max_s=30, what="assigned")
    sim.agents["n3"].launches["job"].state = "hung"  # the standby rank never reports
    sim.until(running(sim, attempt=3), max_s=120, what="full restart after the deadline")
    assert "showed no step past" in timeline(sim)


# --- a controller killed at each step of the path ------------------------------------------


class Crash(BaseException):
    """kill -9: nothing after it runs, and no handler catches it (the worker catches
    Exception)."""


def _crash_once(
    monkeypatch: pytest.MonkeyPatch,
    owner: Any,
    name: str,
    *,
    after: bool,
    when: Callable[..., bool] = lambda *a, **kw: True,
) -> None:
    original = getattr(owner, name)
    fired: list[bool] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not when(*args, **kwargs):
            return original(*args, **kwargs)
        if not fired and not after:
            fired.append(True)
            raise Crash(name)
        result = original(*args, **kwargs)
        if not fired and after:
            fired.append(True)
            raise Crash(name)
        return result

    monkeypatch.setattr(owner, name, wrapper)


@pytest.mark.parametrize(
    "where",
    ["before-decide", "before-send", "mid-send", "after-send", "attempt-begun", "before-done"],
)
def test_a_controller_killed_at_any_step_neither_repeats_nor_loses_one(
    sim: Sim, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    start(sim)
    if where == "before-decide":  # the replace step done, the restart step just begun
        _crash_once(monkeypatch, InProcessRecovery, "_decide", after=False)
    elif where == "before-send":  # the decision is stored, no command sent
        _crash_once(monkeypatch, InProcessRecovery, "_send", after=False)
    elif where == "mid-send":  # the lost node's stop_job is queued, the rest not
        _crash_once(
            monkeypatch,
            type(sim.c.jobs.nodes),
            "queue_command",
            after=True,
            when=lambda *a, command_id, **kw: command_id.startswith("inproc-"),
        )
    elif where == "after-send":  # every command queued, the phase not yet stored
        _crash_once(monkeypatch, InProcessRecovery, "_send", after=True)
    elif where == "attempt-begun":  # the job's attempt raised, the step's state not stored
        _crash_once(monkeypatch, type(sim.c.jobs), "begin_attempt", after=True)
    else:  # every rank trains under the new epoch, the step not yet done
        _crash_once(monkeypatch, InProcessRecovery, "_done", after=False)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    crashed = False
    for _ in range(40):
        try:
            sim.second()
        except Crash:
            crashed = True
            sim.c.stop()
            sim.c = sim.new_controller()
            monkeypatch.undo()
            sim.c.tick()  # a restarted controller resumes its steps before any node reports
            break
    assert crashed, f"the controller never reached {where}"
    sim.until(running(sim, attempt=2), max_s=40, what="recovered in process after the crash")
    sim.until(
        lambda: sim.incident("gpu_dbe").incident.state == "mitigated", max_s=20, what="mitigated"
    )
    sim.second(3)
    # one decision, sent once: every command id once, nothing relaunched, attempt 2 once
    for node, kind in (("n2", "rejoin"), ("n3", "assign_standby")):
        ids = [c.id for c in sim.agents[node].commands if c.kind == kind]
        assert len(ids) == 1, (node, kind, ids)
    assert [a["attempt"] for n in ("n2", "n3") for a in sim.cmds(n, "start_job")] == [1]
    assert sim.c.get_job("job").attempt == 2
    assert restart_output(sim)["mode"] == "in_process"


# --- the pure planner ------------------------------------------------------------------------


def _rank(rank: int, *, step: int = 10, world: int = 4) -> RankState:
    return RankState(job="j", rank=rank, step=step, world_size=world)


def _plan(ranks: list[tuple[str, RankState]], replaced: dict[str, str]) -> Any:
    return plan_world(
        ranks=ranks,
        replaced=replaced,
        world_size=4,
        epoch=7,
        address=lambda n: f"addr-{n}",
        store_port=29607,
        timeout_s=30.0,
    )


def test_survivors_keep_their_ranks_and_the_standby_takes_the_lost_one() -> None:
    ranks = [("a", _rank(0, step=12)), ("b", _rank(1, step=11)), ("d", _rank(3))]
    plan = _plan(ranks, {"c": "s"})
    assert {n: {r: m.rank for r, m in rs.items()} for n, rs in plan.rejoin.items()} == {
        "a": {0: 0},
        "b": {1: 1},
        "d": {3: 3},
    }
    assert plan.assign["s"].rank == 2 and plan.step == 10
    assert plan.rejoin["a"][0].host_store and plan.rejoin["a"][0].store_host == "addr-a"
    assert plan.where() == {0: "a", 1: "b", 2: "s", 3: "d"}


def test_a_lost_rank_0_makes_the_first_survivor_rank_0_and_the_store_host() -> None:
    plan = _plan([("b", _rank(1)), ("c", _rank(2)), ("d", _rank(3))], {"a": "s"})
    assert plan.rejoin["b"][1].rank == 0 and plan.rejoin["b"][1].host_store
    assert plan.assign["s"].rank == 1 and plan.assign["s"].store_host == "addr-b"
    assert sorted(plan.where()) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("ranks", "replaced", "why"),
    [
        ([], {"a": "s"}, "no surviving rank reports"),
        ([("b", _rank(1)), ("c", _rank(2))], {"a": "s"}, "2 rank(s) to replace"),
        ([("b", _rank(1, world=3))], {"a": "s"}, "reports world size 3, not 4"),
    ],
    ids=["none-left", "a-rank-missing", "another-world"],
)
def test_a_world_that_cannot_be_planned_says_why(
    ranks: list[tuple[str, RankState]], replaced: dict[str, str], why: str
) -> None:
    result = _plan(ranks, replaced)
    assert isinstance(result, str) and why in result


@pytest.mark.parametrize(
    ("command", "module"),
    [(["-m", "pkg.train", "--x"], "pkg.train"), (["examples/train_rejoin.py"], "train_rejoin")],
)
def test_the_standby_module_of_a_job(command: list[str], module: str) -> None:
    spec = build(JobSpec, {"name": "j", "command": command, "nodes": ["a"]}, source="t")
    assert job_module(spec) == module
