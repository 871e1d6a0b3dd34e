"""Grow-back on a FakeClock: a `shrink: world` job that lost a node with no spare free runs
shrunk, and once a spare is free the controller's tick plans a `grow` step that checkpoints
the job, and only on a commit restarts it at full size on its nodes plus the spare; a
controller restart in the middle of a grow starts no extra attempt."""

from __future__ import annotations

from tests.builders import gpu
from tests.unit.controller.job_sim import Sim, running
from trainguard.protocol import Command


def shrunk(sim: Sim) -> None:
    """Job on n1+n2 (2 processes each, shrink: world), n1's GPU fails with no spare free: the
    job runs attempt 2 on n2 alone, 2 of 4 ranks."""
    sim.c.set_role("n3", role="active", actor="t")
    sim.submit(nodes=["n1", "n2"], nproc_per_node=2, min_nodes=1, shrink="world")
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="shrunk restart on n2")
    job = sim.c.get_job("job")
    assert (job.nodes, job.world_size, job.full_world_size) == (("n2",), 2, 4)


def test_a_shrunk_job_grows_back_to_full_size_when_a_spare_is_free(sim):
    shrunk(sim)
    sim.second(5)
    assert sim.c.store.actions.by_key("grow:job:2") is None  # no spare free: runs shrunk
    sim.add("n4", role="spare")
    sim.until(running(sim, attempt=3), max_s=30, what="grown attempt 3")
    sim.until(
        lambda: (
            (a := sim.c.store.actions.by_key("grow:job:2")) is not None and a.state == "succeeded"
        ),
        max_s=10,
        what="grow step succeeded",
    )
    job = sim.c.get_job("job")
    assert (job.nodes, job.world_size, job.full_world_size) == (("n2", "n4"), 4, 4)
    assert job.restarts == 1  # the grow is no restart
    assert sim.c.get_node("n4").role == "active" and sim.c.get_node("n4").job == "job"
    # checkpoint first (one request id to the shrunk attempt's node), then the restart
    grow = sim.c.store.actions.by_key("grow:job:2")
    assert grow is not None and grow.incident_id is None
    grow_ckpts = [c for c in sim.cmds("n2", "checkpoint") if c["request_id"] == "grow:job:2"]
    assert len(grow_ckpts) == 1
    out = sim.c.store.actions.output(grow.id)
    assert out["checkpoint"]["proactive"] is True
    assert out["restart"]["ckpt_step"] == out["checkpoint"]["step"]
    starts = {n: sim.cmds(n, "start_job")[-1] for n in ("n2", "n4")}
    assert {s["attempt"] for s in starts.values()} == {3}
    assert sorted(s["node_rank"] for s in starts.values()) == [0, 1]
    assert all(s["nnodes"] == 2 and s["nproc_per_node"] == 2 for s in starts.values())
    # the shrunk attempt was stopped for the grow, not taken for a crash
    assert [i.rule for i in sim.c.list_incidents() if i.rule == "job_process_failed"] == []
    messages = [t.message for t in sim.incident("gpu_dbe").timeline]
    assert sum("grown back to 4 ranks" in m for m in messages) == 1, messages
    # one grow per attempt: the full-size job plans none
    sim.second(10)
    assert sim.c.get_job("job").attempt == 3
    assert [a.kind for a, _ in sim.c.store.actions.open()] == []


def test_a_grow_whose_checkpoint_does_not_commit_leaves_the_job_shrunk(sim):
    shrunk(sim)
    agent = sim.agents["n2"]
    execute = agent._execute

    def no_commit(cmd: Command) -> tuple[bool, str]:
        if cmd.kind == "checkpoint":
            return True, "sent to 2 ranks"  # ...and the save never commits
        return execute(cmd)

    agent._execute = no_commit  # type: ignore[method-assign]
    sim.add("n4", role="spare")
    sim.until(
        lambda: (
            (a := sim.c.store.actions.by_key("grow:job:2")) is not None and a.state == "skipped"
        ),
        max_s=30,
        what="grow skipped",
    )
    grow = sim.c.store.actions.by_key("grow:job:2")
    assert grow is not None and "checkpoint did not commit" in grow.result
    job = sim.c.get_job("job")
    assert (job.nodes, job.attempt, job.world_size) == (("n2",), 2, 2)
    assert sim.c.get_node("n4").role == "spare" and sim.c.get_node("n4").job is None
    assert sim.cmds("n4", "start_job") == []


def test_controller_restart_mid_grow_never_starts_another_attempt(sim):
    shrunk(sim)
    sim.add("n4", role="spare")
    sim.until(lambda: bool(sim.cmds("n4", "start_job")), max_s=30, what="start_job to n4")
    sim.c.stop()
    sim.c = sim.new_controller()
    sim.until(running(sim, attempt=3), max_s=20, what="grow confirmed after recovery")
    sim.second(5)
    starts = sorted(a["attempt"] for n in ("n1", "n2", "n4") for a in sim.cmds(n, "start_job"))
    assert starts == [1, 1, 2, 3, 3]
    job = sim.c.get_job("job")
    assert (job.attempt, job.world_size, job.restarts) == (3, 4, 1)


def test_a_grow_spare_whose_preflight_fails_is_drained_and_the_next_one_joins(sim):
    shrunk(sim)
    sim.add("n4", role="spare").preflight_fails = {"ecc": "2 uncorrectable errors on gpu 1"}
    sim.add("n5", role="spare")
    sim.until(running(sim, attempt=3), max_s=40, what="grown attempt 3")
    grow = sim.c.store.actions.by_key("grow:job:2")
    assert grow is not None and grow.params["spares"] == ["n4"]  # the plan named n4
    job = sim.c.get_job("job")
    assert (job.nodes, job.world_size) == (("n2", "n5"), 4)
    n4 = sim.c.get_node("n4")
    assert (n4.state, n4.drain_reason) == (
        "drained",
        "preflight failed: ecc: 2 uncorrectable errors on gpu 1",
    )
    assert sim.cmds("n4", "start_job") == []
    assert len(sim.cmds("n4", "preflight")) == 1 and len(sim.cmds("n5", "preflight")) == 1
    # the preflights ran before the checkpoint: one checkpoint request, after them
    assert len([c for c in sim.cmds("n2", "checkpoint") if c["request_id"] == "grow:job:2"]) == 1
    assert sim.c.store.actions.output(grow.id)["spares"] == ["n5"]


def test_a_grow_with_no_spare_passing_its_preflight_is_skipped_before_any_checkpoint(sim):
    shrunk(sim)
    sim.add("n4", role="spare").preflight_fails = {"row_remaps": "1 pending row remap on gpu 0"}
    sim.until(
        lambda: (
            (a := sim.c.store.actions.by_key("grow:job:2")) is not None and a.state == "skipped"
        ),
        max_s=30,
        what="grow skipped",
    )
    grow = sim.c.store.actions.by_key("grow:job:2")
    assert grow is not None and "failed the preflight" in grow.result
    assert [c for c in sim.cmds("n2", "checkpoint") if c["request_id"] == "grow:job:2"] == []
    job = sim.c.get_job("job")
    assert (job.nodes, job.attempt) == (("n2",), 2)
    assert sim.c.get_node("n4").state == "drained"
