"""The report path's scope check (controller.jobscope): a node speaks only about what runs on
it. Pure bounds first, then a simulated cluster where node n2, with its own identity, reports
events and rank state about a job that runs on n1 only."""

from __future__ import annotations

from typing import Any

from tests.unit.controller.job_sim import Sim, running
from trainguard.controller.jobscope import FAR_MIN_STEPS, JobScope, Progress
from trainguard.protocol import Event, RankState, Report


def test_a_job_with_no_observed_progress_has_no_bound() -> None:
    assert Progress().limit(100.0) is None


def test_far_is_the_observed_rate_times_the_time_since_the_top_step_with_a_window() -> None:
    p = Progress()
    for t in range(11):  # 10 steps/s for 10 s
        p.observe(100 + 10 * t, float(t))
    assert p.top == 200 and p.rate is not None and abs(p.rate - 10.0) < 1e-6
    # at the top step's time: 4 x 10 steps/s x 30 s window = 1,200 steps of headroom
    assert p.limit(10.0) == 200 + 1200
    # the headroom grows with the time since the top step (a pause, a slow report)
    assert p.limit(110.0) == 200 + 4 * 10 * 130
    # a slow job still gets the floor
    slow = Progress()
    slow.observe(5, 0.0)
    slow.observe(5, 2.0)
    assert slow.limit(2.0) == 5 + FAR_MIN_STEPS


def test_a_restore_goes_back_and_stays_within_the_bound() -> None:
    p = Progress()
    p.observe(500, 0.0)
    p.observe(100, 1.0)  # rolled back to a checkpoint
    assert p.top == 500
    limit = p.limit(1.0)
    assert limit is not None and 100 < limit


# --- the attacks, on a simulated cluster -------------------------------------------------------


def _forge(
    sim: Sim, *, node: str, ranks: tuple[RankState, ...] = (), events: tuple[Event, ...] = ()
) -> Any:
    """A report from `node` (its own identity) with what it says about another node's job."""
    agent = sim.agents[node]
    agent.seq += 1
    report = Report(
        node=node,
        instance=agent.instance,
        seq=agent.seq,
        sent_at=sim.clock.now(),
        ranks=ranks,
        events=events,
        labels=dict(agent.labels),
    )
    return sim.c.ingest_report(report, actor=f"agent-{node}")


def _refused(sim: Sim, reason: str) -> float:
    value = sim.c.metrics.report_items_refused_total.labels(reason=reason)._value.get()
    return float(value)


def _victim(sim: Sim) -> None:
    sim.submit(nodes=["n1"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running on n1")
    sim.second(5)


def test_job_exits_from_a_node_outside_the_job_are_refused_and_never_crash_it(sim: Sim) -> None:
    _victim(sim)
    event_id = 1000
    for _ in range(3):
        event_id += 1
        exit_event = Event(
            id=event_id, kind="job_exit", ts=0.0, job="job", code=1, data={"attempt": 1}
        )
        resp = _forge(sim, node="n2", events=(exit_event,))
        assert resp.ack_event_id == event_id  # acknowledged: the agent does not resend it
        sim.second(3)
    job = sim.c.get_job("job")
    assert (job.state, job.attempt, job.restarts) == ("running", 1, 0)
    assert _refused(sim, "node_not_in_job") == 3
    audit = [a for a in sim.c.audit_log() if a.action == "report_item_refused"]
    assert len(audit) == 1  # once a minute per (node, job, reason)
    assert audit[0].target == "job" and audit[0].detail["node"] == "n2"
    assert audit[0].actor == "agent-n2"


def test_a_nan_step_far_past_the_jobs_progress_is_refused_even_from_its_own_node(
    sim: Sim,
) -> None:
    _victim(sim)
    top = sim.c.get_job("job").last_step
    assert top is not None
    nan = Event(id=5000, kind="nan_loss", ts=0.0, job="job", rank=0, data={"step": top + 12_800})
    _forge(sim, node="n1", events=(nan,))
    assert _refused(sim, "step_implausible") == 1
    assert sim.c.jobs.nan_steps("job") == []
    # a NaN at a step the job can be at is taken
    near = Event(id=5001, kind="nan_loss", ts=0.0, job="job", rank=0, data={"step": top + 2})
    _forge(sim, node="n1", events=(near,))
    assert [s for _, s in sim.c.jobs.nan_steps("job")] == [top + 2]


def test_a_checkpoint_step_from_another_node_never_poisons_the_job(sim: Sim) -> None:
    _victim(sim)
    forged = RankState(job="job", rank=0, step=10**15, ckpt_step=10**15)
    for _ in range(3):
        _forge(sim, node="n2", ranks=(forged,))
        sim.second()
    step, ckpt = sim.c.jobs.latest_steps("job")
    assert step is not None and step < 10**6
    assert ckpt is None or ckpt < 10**6
    assert (sim.c.get_job("job").ckpt_step or 0) < 10**6
    assert [n for n, _ in sim.c.jobs.ranks("job")] == ["n1"]


def test_a_rank_beyond_the_world_size_on_the_jobs_own_node_is_refused(sim: Sim) -> None:
    _victim(sim)
    step = sim.c.get_job("job").last_step or 0
    _forge(sim, node="n1", ranks=(RankState(job="job", rank=7, step=step),))
    assert _refused(sim, "rank_not_on_node") == 1


def test_a_job_the_controller_does_not_manage_is_shown_as_before(sim: Sim) -> None:
    _forge(sim, node="n2", ranks=(RankState(job="outside", rank=0, step=10**12, ckpt_step=10**12),))
    assert sim.c.jobs.latest_steps("outside") == (10**12, 10**12)
    assert sum(_refused(sim, r) for r in ("node_not_in_job", "step_implausible")) == 0


class _Scheduler:
    """A scheduler backend's view: Slurm job 77 runs on n1 and n2."""

    def job_nodes(self, job: str) -> frozenset[str] | None:
        return frozenset({"n1", "n2"}) if job == "slurm-77" else None


def test_a_scheduler_jobs_ranks_are_taken_from_its_allocation_only() -> None:
    scope = JobScope(job_record=lambda name: None, scheduler=_Scheduler())
    refused: list[Any] = []
    mine = Report(
        node="n2",
        instance="i",
        seq=1,
        sent_at=0.0,
        ranks=(RankState(job="slurm-77", rank=3, step=10), RankState(job="other", rank=0, step=5)),
    )
    assert scope.check_ranks(mine, now=0.0, refused=refused) is mine
    outside = Report(
        node="n9",
        instance="i",
        seq=1,
        sent_at=0.0,
        ranks=(RankState(job="slurm-77", rank=0, step=10), RankState(job="other", rank=0, step=5)),
    )
    kept = scope.check_ranks(outside, now=0.0, refused=refused)
    assert [(r.job, r.rank) for r in kept.ranks] == [("other", 0)]  # unmanaged: as before
    assert [(r.node, r.job, r.reason) for r in refused] == [("n9", "slurm-77", "node_not_in_job")]
    exit_event = Event(id=1, kind="job_exit", ts=0.0, job="slurm-77", code=1, data={"attempt": 0})
    assert scope.check_events("n9", [exit_event], now=0.0, refused=refused) == []
    assert scope.check_events("n1", [exit_event], now=0.0, refused=refused) == [exit_event]
