"""Controller-side fencing on a FakeClock: after a controller restart the steps wait for the
nodes they act on to report again (unknown, bounded by jobs.resume_grace_s); attempt N+1
starts only when every node of attempt N confirmed its stop or has been silent past
jobs.attempt_lease_s; a node that never stops fails the step instead; a report of an older
attempt is answered with the job's current one (ReportResponse.job_attempts). Agents are
FakeJobAgents fed through Controller.ingest_report (job_sim.Sim)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from tests.builders import Reporter, gpu
from tests.fakes.job_agent import FakeJobAgent
from tests.unit.controller.job_sim import Sim, running
from trainguard.controller.actions.drain import LocalDrainBackend
from trainguard.controller.config import JobsConfig
from trainguard.controller.model import Decision, Target
from trainguard.protocol import Command, JobProcess
from trainguard.strict import ConfigError

GRACE_S = JobsConfig.resume_grace_s
LEASE_S = JobsConfig.attempt_lease_s


def _alive(sim: Sim) -> set[tuple[str, int]]:
    """(node, attempt) of every launch of the job the fake agents run now."""
    return {
        (name, launch.attempt)
        for name, agent in sim.agents.items()
        for job, launch in agent.launches.items()
        if job == "job" and launch.state == "running"
    }


def _seconds(sim: Sim, n: int) -> None:
    """`n` simulated seconds, checking after each that no two attempts are alive together."""
    for _ in range(n):
        sim.second()
        attempts = {a for _, a in _alive(sim)}
        assert len(attempts) <= 1, f"two attempts alive together: {sorted(_alive(sim))}"


def _until(sim: Sim, cond: Any, *, max_s: int, what: str) -> None:
    for _ in range(max_s):
        if cond():
            return
        _seconds(sim, 1)
    assert cond(), f"not within {max_s} simulated s: {what}"


def _started(sim: Sim, attempt: int) -> list[str]:
    return [n for n in sim.agents if any(a["attempt"] == attempt for a in sim.cmds(n, "start_job"))]


def _ignore_stop(agent: FakeJobAgent) -> None:
    """The node answers stop_job but its processes go on (a hung GPU, a D-state process)."""
    execute = agent._execute

    def stubborn(cmd: Command) -> tuple[bool, str]:
        if cmd.kind == "stop_job":
            return True, f"stopping job {cmd.args['job']}"
        return execute(cmd)

    agent._execute = stubborn  # type: ignore[method-assign]


def _dbe_decided_then_controller_dies(sim: Sim, *, down_s: int) -> None:
    """A DBE on n1: the incident and its steps are written, then the controller dies before
    any step runs and is down for `down_s` while the job trains on unobserved."""
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(12)  # a checkpoint at step 10
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    now = sim.clock.now()
    decision = Decision(
        rule="gpu_dbe",
        target=Target(scope="gpu", node="n1", gpu=0),
        state="firing",
        severity="critical",
        actions=("notify", "checkpoint", "drain", "replace", "restart"),
        since=now,
    )
    assert sim.c.apply_decisions([decision], now=now)
    sim.c.stop()
    for _ in range(down_s):
        sim.clock.advance(1.0)
        for agent in sim.agents.values():
            agent.train()


def _steps(sim: Sim) -> dict[str, tuple[str, str]]:
    detail = sim.incident("gpu_dbe")
    return {a.kind: (a.state, a.result) for a in detail.actions if a.kind != "notify"}


def test_resumed_steps_wait_for_the_sick_node_to_report_after_a_controller_restart(sim):
    # the hand-found case: stored report ages say n1 is silent (the controller was down
    # 8 s); it is alive and reports again 3 s after the restart (its agent's back-off)
    _dbe_decided_then_controller_dies(sim, down_s=8)
    sim.agents["n1"].silent = True
    sim.c = sim.new_controller()
    assert sim.c.jobs.presence("n1") == "unknown"
    _seconds(sim, 3)
    assert sim.c.jobs.presence("n1") == "unknown" and sim.c.jobs.presence("n2") == "reporting"
    state, result = _steps(sim)["checkpoint"]
    assert state == "running" and "waiting for n1 to report again" in result
    assert _steps(sim)["drain"][0] == "pending" and sim.c.node_state("n1") == "active"
    assert not _started(sim, 2)
    sim.agents["n1"].silent = False
    _until(sim, running(sim, attempt=2), max_s=30, what="restart onto the spare")
    steps = _steps(sim)
    assert {k: s for k, (s, _) in steps.items()} == {
        k: "succeeded" for k in ("checkpoint", "drain", "replace", "restart")
    }
    ckpt_id = next(a for a in sim.incident("gpu_dbe").actions if a.kind == "checkpoint").id
    assert sim.c.store.actions.output(ckpt_id)["proactive"] is True
    assert len(sim.cmds("n1", "stop_job")) == 1  # the drain's, answered before the start
    assert _alive(sim) == {("n3", 2), ("n2", 2)}


def test_unknown_node_counts_as_silent_after_the_resume_grace(sim):
    _dbe_decided_then_controller_dies(sim, down_s=8)
    sim.agents["n1"].silent = True  # powered off for good: nothing runs there any more
    sim.agents["n1"].launches.clear()
    sim.c = sim.new_controller()
    restarted_at = sim.clock.now()
    _until(sim, lambda: bool(_started(sim, 2)), max_s=int(GRACE_S) + 10, what="attempt 2")
    # nothing acted on n1 before the grace ran out; then it was silent (and past its lease)
    assert sim.clock.now() - restarted_at >= GRACE_S
    steps = _steps(sim)
    assert "no proactive checkpoint (n1 is not reporting" in steps["checkpoint"][1]
    # the safety rail as before: no drain on data that old (a person drains a dead node)
    assert steps["drain"][0] == "skipped" and "not draining on stale data" in steps["drain"][1]
    _until(sim, running(sim, attempt=2), max_s=10, what="attempt 2 trains")
    timeline = " | ".join(t.message for t in sim.incident("gpu_dbe").timeline)
    assert (
        "attempt 2 started on n3, n2" in timeline
        and f"silent past the {LEASE_S:g} s lease" in timeline
    )
    assert sim.c.get_job("job").nodes == ("n3", "n2")


def test_a_node_silent_before_the_controller_stopped_is_silent_at_once(sim):
    sim.add("n4")
    sim.agents["n4"].silent = True
    sim.second(10)
    sim.c.stop()
    sim.c = sim.new_controller()
    jobs = sim.c.jobs
    assert (jobs.presence("n4"), jobs.presence("n1")) == ("silent", "unknown")
    assert jobs.unknown(["n4", "n1"], spares=True) == ["n1", "n3"]
    sim.second()
    assert (jobs.presence("n4"), jobs.presence("n1")) == ("silent", "reporting")
    assert jobs.unknown(["n4", "n1"], spares=True) == []


def test_no_attempt_starts_while_a_node_reports_the_old_one_and_a_stop_timeout_fails(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    _ignore_stop(sim.agents["n1"])
    sim.agents["n2"].crash("job")
    limit_s = 2 + 5  # the sim's stop_grace_s + stop_timeout_s
    _seconds(sim, limit_s - 1)
    assert sim.cmds("n1", "stop_job") and not _started(sim, 2)
    state, result = _steps_of(sim, "job_process_failed")["restart"]
    assert state == "running" and "waiting for attempt 1 to stop on n1" in result
    _seconds(sim, 3)
    state, result = _steps_of(sim, "job_process_failed")["restart"]
    assert state == "failed"
    assert "attempt 1 of job job still runs on n1" in result
    assert "not starting attempt 2 beside it" in result
    job = sim.c.get_job("job")
    assert (job.state, job.attempt) == ("failed", 1)
    assert "attempt 1 did not stop on n1" in job.state_reason
    detail = sim.incident("job_process_failed")
    assert any(a.params.get("page") for a in detail.actions if a.kind == "notify")
    _seconds(sim, 10)
    assert not _started(sim, 2) and _alive(sim) == {("n1", 1)}


def test_a_slow_stop_delays_the_start_until_the_node_confirms(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    _ignore_stop(sim.agents["n1"])
    sim.agents["n2"].crash("job")
    _seconds(sim, 4)
    assert not _started(sim, 2)
    sim.agents["n1"].launches["job"].state = "exited"  # SIGKILL after the grace
    _until(sim, running(sim, attempt=2), max_s=5, what="attempt 2 after n1 stopped")
    assert sorted(_started(sim, 2)) == ["n1", "n2"]


def _steps_of(sim: Sim, rule: str) -> dict[str, tuple[str, str]]:
    detail = sim.incident(rule)
    return {a.kind: (a.state, a.result) for a in detail.actions if a.kind != "notify"}


def test_a_silent_node_of_the_attempt_is_waited_for_until_its_lease_runs_out(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(5)
    last_heard = sim.clock.now()
    sim.agents["n1"].silent = True  # cut off: its attempt 1 trains on, unobserved
    sim.agents["n2"].crash("job")
    while not _started(sim, 2):
        sim.second()
        assert sim.clock.now() - last_heard <= LEASE_S + 3, "attempt 2 never started"
    # start_job rides on the response to the first report after it was queued (<= 1 s)
    assert sim.clock.now() - last_heard > LEASE_S
    assert sim.c.get_job("job").nodes == ("n3", "n2")
    # n1 was sent the stop while silent; it reads it, and the fence, when it comes back
    assert not sim.cmds("n1", "stop_job")
    response = sim.c.ingest_report(sim.agents["n1"].report(now=sim.clock.now()), actor="t")
    assert response.job_attempts == {"job": 2}
    assert [c.kind for c in response.commands] == ["stop_job"]


def test_job_attempts_answers_only_a_live_older_attempt(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.c.job_action("job", "restart", actor="ops")
    sim.until(running(sim, attempt=2), max_s=10, what="attempt 2")
    base = sim.agents["n2"].report(now=sim.clock.now())

    def answer(*procs: JobProcess) -> dict[str, int] | None:
        report = dataclasses.replace(base, jobs=procs, ranks=(), events=())
        return sim.c.ingest_report(report, actor="t").job_attempts

    assert answer(JobProcess(job="job", attempt=1, state="running", pid=7)) == {"job": 2}
    assert answer(JobProcess(job="job", attempt=1, state="stopping", pid=7)) == {"job": 2}
    assert answer(JobProcess(job="job", attempt=1, state="starting", pid=7)) == {"job": 2}
    assert answer(JobProcess(job="job", attempt=1, state="exited", pid=7)) is None
    assert answer(JobProcess(job="job", attempt=2, state="running", pid=7)) is None
    assert answer(JobProcess(job="other", attempt=1, state="running", pid=7)) is None
    assert answer() is None
    both = (
        JobProcess(job="job", attempt=2, state="running", pid=8),
        JobProcess(job="job", attempt=1, state="stopping", pid=7),
    )
    assert answer(*both) == {"job": 2}


def test_the_fence_sees_an_older_attempt_beside_the_current_one_on_one_node(sim):
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    report = sim.agents["n1"].report(now=sim.clock.now())
    two = (
        JobProcess(job="job", attempt=1, state="exited", pid=7),
        JobProcess(job="job", attempt=1, state="running", pid=8),
    )
    sim.c.ingest_report(dataclasses.replace(report, jobs=two, events=()), actor="t")
    assert sim.c.jobs.runs_attempt("job", "n1", attempt=1)
    one = (JobProcess(job="job", attempt=1, state="exited", pid=7),)
    sim.c.ingest_report(dataclasses.replace(report, jobs=one, ranks=(), events=()), actor="t")
    assert not sim.c.jobs.runs_attempt("job", "n1", attempt=1)


def test_local_drain_waits_for_a_node_unknown_after_a_restart(make_core, core_clock):
    c = make_core()
    for node in ("n1", "n2"):
        c.ingest_report(Reporter(node).report(now=core_clock.now(), job="job-a"), actor="a")
    c.tick()
    c.stop()
    core_clock.advance(10.0)  # the controller was down: the stored reports are 10 s old
    c = make_core()
    backend = LocalDrainBackend(c, silent_after_s=5.0, presence=c.jobs.presence)
    states = {n: backend.drain(n, reason="dbe", key=f"k-{n}") for n in ("n1", "n2")}
    assert {n: s for n, (s, _) in states.items()} == {"n1": "draining", "n2": "draining"}
    assert c.pending_commands("n1") == []  # which job n1 runs is not known yet
    # n1 reports again: its job gets the stop, and the drain waits for the result
    c.ingest_report(
        Reporter("n1", instance="i2").report(now=core_clock.now(), job="job-a"), actor="a"
    )
    assert backend.poll("n1", key="k-n1", progress=states["n1"][1]) == "draining"
    assert [cmd.kind for cmd in c.pending_commands("n1")] == ["stop_job"]
    # n2 never does: silent once the resume grace has passed
    assert backend.poll("n2", key="k-n2", progress=states["n2"][1]) == "draining"
    core_clock.advance(GRACE_S)
    assert backend.poll("n2", key="k-n2", progress=states["n2"][1]) == "drained"


def test_without_presence_a_stale_node_drains_at_once(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now(), job="job-a"), actor="a")
    core_clock.advance(10.0)
    state, _ = LocalDrainBackend(c, silent_after_s=5.0).drain("n1", reason="dbe", key="k")
    assert state == "drained"


@pytest.mark.parametrize(
    ("jobs", "key"),
    [
        ({"resume_grace_s": 4.0}, "jobs.resume_grace_s"),
        ({"attempt_lease_s": 5.0}, "jobs.attempt_lease_s"),
        ({"attempt_lease_s": 0.0}, "attempt_lease_s"),
    ],
    ids=["grace-below-silent", "lease-not-past-silent", "lease-zero"],
)
def test_config_refuses_a_grace_or_lease_shorter_than_silence(core_config, jobs, key):
    with pytest.raises(ConfigError) as e:
        core_config(jobs=jobs)
    assert key in str(e.value)


def test_a_report_answer_says_whether_the_node_is_a_spare(sim):
    # the agent keeps its warm standby by this (agent.standby.keeps_standby), not by its hint
    now = sim.clock.now()
    assert sim.c.ingest_report(sim.agents["n3"].report(now=now), actor="t").spare is True
    assert sim.c.ingest_report(sim.agents["n1"].report(now=now), actor="t").spare is False
