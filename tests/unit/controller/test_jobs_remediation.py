"""The closed loop on a FakeClock: job submit, sick node -> checkpoint -> drain -> replace ->
restart -> mitigated, shrink and no-spare waits, silent node, crashed process, NaN rollback,
operator stop, the min_nodes floor, and a controller restart in the middle of a restart.
Agents are FakeJobAgents fed through Controller.ingest_report; every command is recorded."""

from __future__ import annotations

import math

import pytest

from tests.builders import gpu
from tests.integration.postgres_proc import BOTH_STORES
from tests.unit.controller.job_sim import Sim, running
from trainguard.controller.errors import Conflict
from trainguard.controller.jobs import JobSpec, shrink_plan
from trainguard.controller.jobstate import JobState
from trainguard.strict import ConfigError, build


def test_submit_starts_one_attempt_on_every_node_with_one_rendezvous_host(sim):
    sim.submit(nodes=["n1", "n2"], nproc_per_node=2, ckpt_dir="/ck/job")
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    starts = [sim.cmds(n, "start_job") for n in ("n1", "n2")]
    assert [len(s) for s in starts] == [1, 1]
    a1, a2 = starts[0][0], starts[1][0]
    assert (a1["node_rank"], a2["node_rank"]) == (0, 1)
    assert a1["rdzv_endpoint"] == a2["rdzv_endpoint"] == "10.0.0.0:29501"
    assert a1["rdzv_id"] == "job-1" and a1["attempt"] == 1 and a1["nnodes"] == 2
    assert a1["ckpt_dir"] == "/ck/job" and a1["nproc_per_node"] == 2
    job = sim.c.get_job("job")
    assert (job.nodes, job.world_size, job.restarts) == (("n1", "n2"), 4, 0)


@BOTH_STORES
def test_sick_node_is_checkpointed_drained_replaced_and_restarted(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(13)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    sim.until(
        lambda: sim.incident("gpu_dbe").incident.state == "mitigated", max_s=10, what="mitigated"
    )
    detail = sim.incident("gpu_dbe")
    kinds = [(a.kind, a.state) for a in detail.actions if a.kind != "notify"]
    assert kinds == [(k, "succeeded") for k in ("checkpoint", "drain", "replace", "restart")]
    # checkpoint: one request id, sent to both nodes, committed proactively
    (req1,) = sim.cmds("n1", "checkpoint")
    (req2,) = sim.cmds("n2", "checkpoint")
    assert req1["request_id"] == req2["request_id"]
    ckpt_out = sim.c.store.actions.output(detail.actions[1].id)
    assert ckpt_out["proactive"] is True and isinstance(ckpt_out["step"], int)
    # drain stopped n1; the restart stopped n2 and started attempt 2 on n3 + n2
    assert len(sim.cmds("n1", "stop_job")) == 1 and len(sim.cmds("n2", "stop_job")) == 1
    assert sim.c.node_state("n1") == "drained"
    assert [a["attempt"] for a in sim.cmds("n3", "start_job")] == [2]
    assert [a["attempt"] for a in sim.cmds("n2", "start_job")] == [1, 2]
    assert sim.cmds("n3", "start_job")[0]["node_rank"] == 0
    job = sim.c.get_job("job")
    assert job.nodes == ("n3", "n2") and job.restarts == 1
    assert sim.c.get_node("n3").role == "active"
    restart_out = sim.c.store.actions.output(detail.actions[-1].id)
    assert restart_out["first_step"] > ckpt_out["step"]
    assert set(restart_out["phases_s"]) == {"detect", "checkpoint", "drain", "restart", "mttr"}
    assert restart_out["lost_steps"] <= 1
    timeline = " | ".join(t.message for t in detail.timeline)
    assert "replaced n1 -> n3" in timeline and "lost steps" in timeline
    assert sim.c.metrics.remediation_lost_steps.collect()[0].samples[0].value >= 0
    mttr = [
        s.value
        for m in sim.c.metrics.remediation_phase_seconds.collect()
        for s in m.samples
        if s.name.endswith("_count") and s.labels.get("phase") == "mttr"
    ]
    assert mttr == [1.0]


def test_no_spare_shrinks_to_fewer_nodes_keeping_the_world_size(sim):
    sim.c.set_role("n3", role="active", actor="t")
    sim.submit(nodes=["n1", "n2"], min_nodes=1, max_nproc_per_node=2)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart on one node")
    job = sim.c.get_job("job")
    assert (job.nodes, job.nproc_per_node, job.world_size) == (("n2",), 2, 2)
    assert sim.cmds("n2", "start_job")[-1]["nnodes"] == 1
    assert sim.cmds("n2", "start_job")[-1]["nproc_per_node"] == 2
    timeline = " | ".join(t.message for t in sim.incident("gpu_dbe").timeline)
    assert "shrinking job job to 1 node(s) x 2 process(es), world size 2 kept" in timeline


@BOTH_STORES
def test_no_spare_with_shrink_world_restarts_on_fewer_ranks(sim):
    sim.c.set_role("n3", role="active", actor="t")
    sim.submit(nodes=["n1", "n2"], nproc_per_node=2, min_nodes=1, shrink="world")
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart on one node")
    job = sim.c.get_job("job")
    assert (job.nodes, job.nproc_per_node, job.world_size) == (("n2",), 2, 2)
    assert job.full_world_size == 4
    start = sim.cmds("n2", "start_job")[-1]
    assert (start["nnodes"], start["nproc_per_node"], start["attempt"]) == (1, 2, 2)
    timeline = " | ".join(t.message for t in sim.incident("gpu_dbe").timeline)
    assert "shrunk from 4 to 2 ranks" in timeline


def test_shrink_world_below_min_nodes_waits_for_a_spare(sim):
    sim.c.set_role("n3", role="active", actor="t")
    sim.submit(nodes=["n1", "n2", "n3"], min_nodes=2, shrink="world")
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.agents["n1"].silent = True
    sim.agents["n2"].gpus = (gpu(0, dbe=1),)
    sim.until(lambda: sim.c.get_job("job").state == "waiting", max_s=30, what="waiting")
    assert sim.c.get_job("job").full_world_size == 3


@pytest.mark.parametrize(
    ("fields", "key"),
    [
        ({"shrink": "fewer"}, "shrink"),
        ({"shrink": "world"}, "shrink"),  # min_nodes defaults to every node: nothing to shrink
        ({"shrink": "world", "min_nodes": 2}, "shrink"),
    ],
    ids=["unknown-mode", "world-without-min-nodes", "world-min-nodes-all"],
)
def test_job_spec_refuses_a_shrink_it_cannot_do(fields, key):
    data = {"name": "j", "command": ["train.py"], "nodes": ["a", "b"], **fields}
    with pytest.raises(ConfigError) as e:
        build(JobSpec, data, source="test")
    assert key in str(e.value)


def test_no_spare_and_no_shrink_waits_then_pages(sim):
    sim.c.set_role("n3", role="active", actor="t")
    sim.submit(nodes=["n1", "n2"], min_nodes=1)  # no max_nproc_per_node: world size cannot fit
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(lambda: sim.c.get_job("job").state == "waiting", max_s=20, what="waiting")
    timeline = " | ".join(t.message for t in sim.incident("gpu_dbe").timeline)
    assert "waiting up to 10 s for a spare" in timeline
    assert "the trainer resumes only at the same world size" in timeline
    sim.second(15)
    detail = sim.incident("gpu_dbe")
    states = {a.kind: a.state for a in detail.actions if a.kind != "notify"}
    assert states["replace"] == "failed" and states["restart"] == "skipped"
    assert any(a.params.get("page") for a in detail.actions if a.kind == "notify")
    assert not sim.cmds("n2", "start_job")[1:]


def test_spare_that_appears_while_waiting_is_taken(sim):
    sim.c.set_role("n3", role="active", actor="t")
    sim.submit(nodes=["n1", "n2"], min_nodes=1)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(lambda: sim.c.get_job("job").state == "waiting", max_s=20, what="waiting")
    sim.c.set_role("n3", role="spare", actor="t")
    sim.until(running(sim, attempt=2), max_s=20, what="restart onto the new spare")
    assert sim.c.get_job("job").nodes == ("n3", "n2")


def test_silent_node_uses_the_latest_checkpoint_and_is_not_waited_for(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(12)
    committed = sim.ckpts.committed["job"]
    sim.agents["n1"].silent = True
    sim.until(running(sim, attempt=2), max_s=40, what="restart without n1")
    detail = sim.incident("node_silent")
    ckpt_out = sim.c.store.actions.output(detail.actions[1].id)
    assert ckpt_out["proactive"] is False and ckpt_out["step"] == committed
    assert not sim.cmds("n2", "checkpoint")
    assert sim.c.get_job("job").nodes == ("n3", "n2")
    sim.until(
        lambda: sim.incident("node_silent").incident.state == "resolved",
        max_s=10,
        what="resolved after the remediation",
    )
    kinds = [t.kind for t in sim.incident("node_silent").timeline]
    assert kinds.index("mitigated") < kinds.index("resolved")


def test_crashed_process_restarts_on_the_same_nodes_at_once(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(5)
    sim.agents["n2"].crash("job")
    sim.until(running(sim, attempt=2), max_s=10, what="restart")
    assert sim.c.get_job("job").nodes == ("n1", "n2")
    assert len(sim.cmds("n1", "stop_job")) == 1  # the survivor is stopped first
    assert not sim.cmds("n2", "stop_job")  # the crashed node runs nothing to stop
    detail = sim.incident("job_process_failed")
    assert [(a.kind, a.state) for a in detail.actions if a.kind != "notify"] == [
        ("replace", "succeeded"),
        ("restart", "succeeded"),
    ]


def test_a_job_that_ends_between_two_ticks_keeps_the_step_it_ended_at(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(5)
    ticked = sim.c.get_job("job").last_step
    for agent in (sim.agents["n1"], sim.agents["n2"]):
        agent.train()  # a last step and the exit within one report, no tick between
        agent.finish("job")
        sim._report(agent)
    for agent in (sim.agents["n1"], sim.agents["n2"]):
        sim._report(agent)  # the exited ranks are gone from the live view
    job = sim.c.get_job("job")
    assert (job.state, job.ranks) == ("completed", 0), job
    assert job.last_step == ticked + 1


def test_a_job_that_completes_while_its_incident_acts_is_not_restarted(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(5)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim._report(sim.agents["n1"])
    sim.c.tick()  # the incident opens, its plan begins
    for agent in (sim.agents["n1"], sim.agents["n2"]):
        agent.finish("job")  # the run reaches its end before the plan stops it
        sim._report(agent)
    sim.until(
        lambda: sim.incident("gpu_dbe").incident.state != "acting", max_s=60, what="the plan to end"
    )
    job = sim.c.get_job("job")
    assert (job.state, job.attempt, job.restarts) == ("completed", 1, 0), job
    steps = {a.kind: a.state for a in sim.incident("gpu_dbe").actions}
    assert steps["drain"] == "succeeded"  # the sick node still leaves service
    assert (steps["replace"], steps["restart"]) == ("skipped", "skipped"), steps
    assert not sim.cmds("n3", "start_job")


def test_stopped_exit_is_not_a_crash(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.c.job_action("job", "stop", actor="ops")
    sim.until(lambda: sim.c.get_job("job").state == "stopped", max_s=10, what="stopped")
    sim.second(3)
    assert not [i for i in sim.c.list_incidents() if i.rule == "job_process_failed"]
    with pytest.raises(Conflict):
        sim.c.job_action("job", "stop", actor="ops")


def test_nan_loss_rolls_back_on_the_same_nodes_skipping_the_bad_batches(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(13)  # checkpoint at step 10, now at step ~14
    ckpt = sim.ckpts.committed["job"]
    bad_step = sim.agents["n1"].launches["job"].step
    sim.agents["n1"].event("nan_loss", job="job", rank=0, data={"step": bad_step})
    sim.agents["n1"].loss = math.nan
    sim.second()
    sim.agents["n1"].loss = 1.0
    sim.until(running(sim, attempt=2), max_s=15, what="rollback restart")
    env = sim.cmds("n1", "start_job")[-1]["env"]
    assert env["TRAINGUARD_RESUME_SKIP_BATCHES"] == str(bad_step - ckpt)
    assert sim.c.get_job("job").nodes == ("n1", "n2")
    assert sim.c.node_state("n1") == "active"


def test_trainer_rollback_in_process_makes_the_controller_rollback_a_no_op(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)
    sim.agents["n1"].event(
        "trainer_event", job="job", rank=0, message="nan_rollback", data={"step": 3, "to_step": 0}
    )
    sim.agents["n1"].loss = math.nan
    sim.second(2)
    sim.agents["n1"].loss = 1.0
    sim.second(3)
    rollback = [a for a in sim.incident("nan_loss").actions if a.kind == "rollback"]
    assert rollback[0].state == "skipped" and "rolled back in process" in rollback[0].result
    assert sim.c.get_job("job").attempt == 1


def test_drain_that_would_leave_a_job_below_min_nodes_pages_instead(sim):
    sim.c.set_role("n3", role="active", actor="t")
    sim.submit(nodes=["n1", "n2"], min_nodes=2)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.second(3)
    detail = sim.incident("gpu_dbe")
    states = {a.kind: a.state for a in detail.actions if a.kind != "notify"}
    # a checkpoint is not disruptive: it still runs; the node stays in the job
    assert states == {
        "checkpoint": "succeeded",
        **{k: "skipped" for k in ("drain", "replace", "restart")},
    }
    assert any("below min_nodes 2" in t.message for t in detail.timeline)
    assert any(a.params.get("page") for a in detail.actions if a.kind == "notify")
    assert sim.c.node_state("n1") == "active"
    assert sim.c.get_job("job").state == "running"


def test_a_drain_planned_before_the_job_s_other_nodes_report_after_a_restart_still_drains(sim):
    # min_nodes 2 with one spare: the drain may go ahead, as the store knows the cluster. The
    # controller restarts and the sick node's reports come in before its job's other node or
    # the spare have reported to it: they are not yet known, not lost (the floor once took
    # them for lost and paged instead of draining, leaving the job on the failed GPU)
    sim.submit(nodes=["n1", "n2"], min_nodes=2)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.c.stop()
    sim.c = sim.new_controller()
    for name in ("n2", "n3"):
        sim.agents[name].silent = True
    for dbe in (0, 1):
        sim.clock.advance(1.0)
        sim.agents["n1"].gpus = (gpu(0, dbe=dbe),)
        sim.agents["n1"].train()
        sim._report(sim.agents["n1"])
        sim.c.tick()
    detail = sim.incident("gpu_dbe")
    assert not any("below min_nodes" in t.message for t in detail.timeline)
    for name in ("n2", "n3"):
        sim.agents[name].silent = False
    sim.until(running(sim, attempt=2), max_s=60, what="restart onto the spare")
    detail = sim.incident("gpu_dbe")
    states = {a.kind: a.state for a in detail.actions if a.kind != "notify"}
    assert states == {k: "succeeded" for k in ("checkpoint", "drain", "replace", "restart")}
    assert sim.c.node_state("n1") == "drained"


@BOTH_STORES
def test_controller_restart_mid_restart_never_starts_another_attempt(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(lambda: bool(sim.cmds("n3", "start_job")), max_s=30, what="start_job to spare")
    # the controller dies right after queueing attempt 2 (state as on disk), then comes back
    sim.c.stop()
    sim.c = sim.new_controller()
    sim.until(running(sim, attempt=2), max_s=20, what="restart confirmed after recovery")
    sim.second(5)
    starts = [a["attempt"] for n in ("n1", "n2", "n3") for a in sim.cmds(n, "start_job")]
    assert sorted(starts) == [1, 1, 2, 2]
    assert sim.c.get_job("job").attempt == 2


@pytest.mark.parametrize(
    ("world", "healthy", "min_nodes", "max_nproc", "expected"),
    [
        (4, 1, 1, 4, 1),
        (4, 3, 1, 2, 2),
        (4, 3, 1, 1, None),
        (6, 4, 2, 3, 3),
        (8, 3, 3, 8, None),
    ],
    ids=["one-node", "largest-divisor", "no-capacity", "three-of-four", "below-min"],
)
def test_shrink_plan_keeps_the_world_size(world, healthy, min_nodes, max_nproc, expected):
    assert (
        shrink_plan(world_size=world, healthy=healthy, min_nodes=min_nodes, max_nproc=max_nproc)
        == expected
    )


def ettr_and_start(sim: Sim) -> tuple[float | None, float | None]:
    job = sim.c.get_job("job")
    return job.ettr, job.started_at


def test_ettr_starts_when_the_job_first_runs_even_if_a_step_marked_it_running(sim):
    # The restart step's confirmation may mark a job running before the tick's own check
    # does; ETTR's wall clock must start then too, or the productive time counted without
    # it pushes ETTR to 1 after the next restart.
    sim.submit(nodes=["n1", "n2"])
    assert sim.c.get_job("job").state == "starting"
    marked_at = sim.clock.now()
    sim.c.jobs.set_state("job", JobState.RUNNING)
    assert ettr_and_start(sim)[1] == marked_at
    sim.second(30)
    ettr, started = ettr_and_start(sim)
    assert started == marked_at
    assert ettr is not None and 0.8 < ettr <= 1.0


def test_ettr_counts_a_restart_as_lost_time(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(60)
    before = ettr_and_start(sim)[0]
    assert before is not None and before > 0.9
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    sim.second(5)
    after = ettr_and_start(sim)[0]
    assert after is not None and after < before
