"""Job states move only along the transition table: JobManager.set_state and begin_attempt
refuse a move the table does not hold, with a message naming the job, both states and what
was allowed, and leave the stored job as it was. The moves the steps make are covered by the
remediation tests (test_jobs_remediation, test_jobs_fencing, test_jobs_grow)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.unit.controller.job_sim import Sim
from trainguard.controller.jobs import JobSpec, stored_state
from trainguard.controller.jobstate import (
    TRANSITIONS,
    InvalidJobTransition,
    JobState,
    check_job_transition,
)
from trainguard.strict import build

S = JobState
# a legal way to each state from a fresh submit (pending); "begin" = JobManager.begin_attempt
PATHS: dict[JobState, tuple[JobState | str, ...]] = {
    S.PENDING: (),
    S.STARTING: ("begin",),
    S.RUNNING: ("begin", S.RUNNING),
    S.RESTARTING: ("begin", S.RUNNING, S.RESTARTING),
    S.CRASHED: ("begin", S.CRASHED),
    S.WAITING: (S.WAITING,),
    S.STOPPING: (S.STOPPING,),
    S.STOPPED: (S.STOPPING, S.STOPPED),
    S.COMPLETED: ("begin", S.COMPLETED),
    S.FAILED: (S.FAILED,),
}


def _job_in(sim: Sim, state: JobState) -> None:
    spec = build(JobSpec, {"name": "job", "command": ["train.py"], "nodes": ["n1"]}, source="t")
    assert sim.c.jobs.submit(spec, now=sim.clock.now()) is not None
    for n, step in enumerate(PATHS[state]):
        if step == "begin":
            sim.c.jobs.begin_attempt("job", key=f"k{n}")
        else:
            sim.c.jobs.set_state("job", JobState(step), reason=f"to {step}")
    assert sim.c.jobs.get("job").state == state.value  # type: ignore[union-attr]


def test_the_table_has_a_row_for_every_state() -> None:
    assert set(TRANSITIONS) == set(JobState)
    for state, targets in TRANSITIONS.items():
        assert state not in targets  # staying put is always allowed, never listed


def test_the_stored_strings_are_the_ones_the_job_table_always_held() -> None:
    assert [s.value for s in JobState] == [
        "pending",
        "starting",
        "running",
        "restarting",
        "crashed",
        "waiting",
        "stopping",
        "stopped",
        "completed",
        "failed",
        "held",  # added with the restart-loop breaker
    ]
    active = {s.value for s in JobState if s.active}
    assert active == {"starting", "running", "restarting", "crashed", "waiting"}
    finished = {s.value for s in JobState if s.finished}
    assert finished == {"stopped", "completed", "failed", "held"}


def test_every_finished_job_may_be_resubmitted() -> None:
    for state in JobState:
        if state.finished:
            assert JobState.PENDING in TRANSITIONS[state]


# (from, to, why the move is a bug)
ILLEGAL = [
    (S.PENDING, S.RUNNING, "a job runs only in an attempt that started"),
    (S.STOPPING, S.RUNNING, "a job being stopped does not run on"),
    (S.STOPPED, S.RUNNING, "a stopped job runs again only through a new attempt"),
    (S.COMPLETED, S.RUNNING, "a completed job runs again only through a new attempt"),
    (S.FAILED, S.RUNNING, "a failed job runs again only through a new attempt"),
    (S.PENDING, S.CRASHED, "nothing ran that could crash"),
    (S.STOPPING, S.CRASHED, "an exit during a stop is no crash"),
    (S.STOPPED, S.CRASHED, "an exit after a stop is no crash"),
    (S.COMPLETED, S.CRASHED, "a finished job does not crash"),
    (S.PENDING, S.COMPLETED, "nothing ran that could complete"),
    (S.RESTARTING, S.COMPLETED, "the old attempt's exit during a restart is no completion"),
    (S.CRASHED, S.COMPLETED, "a crashed attempt did not complete"),
    (S.STOPPED, S.COMPLETED, "a stopped job did not complete"),
    (S.FAILED, S.COMPLETED, "a failed job did not complete"),
    (S.PENDING, S.STOPPED, "a stop passes through stopping"),
    (S.COMPLETED, S.STOPPED, "a finished job is not stopped again"),
    (S.FAILED, S.STOPPED, "a finished job is not stopped again"),
    (S.STOPPED, S.WAITING, "a stopped job waits for no spare"),
    (S.COMPLETED, S.WAITING, "a finished job waits for no spare"),
    (S.FAILED, S.WAITING, "a failed job waits for no spare"),
    (S.RUNNING, S.PENDING, "only a resubmit makes a job pending again"),
    (S.CRASHED, S.RUNNING, "a crashed job runs again only through a restart"),
]


@pytest.mark.parametrize(
    ("current", "wanted", "why"),
    ILLEGAL,
    ids=[f"{c.value}-to-{w.value}" for c, w, _ in ILLEGAL],
)
def test_set_state_refuses_a_move_outside_the_table(
    sim: Sim, current: JobState, wanted: JobState, why: str
) -> None:
    _job_in(sim, current)
    before = sim.c.jobs.get("job")
    with pytest.raises(InvalidJobTransition) as exc:
        sim.c.jobs.set_state("job", wanted, reason=why)
    assert f"job job: cannot go from {current.value} to {wanted.value}" in str(exc.value)
    assert (exc.value.current, exc.value.wanted) == (current, wanted)
    assert sim.c.jobs.get("job") == before
    assert sim.c.store.jobs.get("job").state == current.value  # type: ignore[union-attr]


def test_the_error_says_where_the_job_may_go() -> None:
    with pytest.raises(InvalidJobTransition) as exc:
        check_job_transition("train", JobState.COMPLETED, JobState.RUNNING)
    assert str(exc.value) == (
        "job train: cannot go from completed to running"
        " (from completed it may go to pending, restarting, stopping, failed)"
    )


def test_a_new_attempt_of_a_running_job_must_pass_through_restarting(sim: Sim) -> None:
    _job_in(sim, S.RUNNING)
    with pytest.raises(InvalidJobTransition, match="cannot go from running to starting"):
        sim.c.jobs.begin_attempt("job", key="another-step")
    job = sim.c.jobs.get("job")
    assert job is not None and (job.state, job.attempt) == ("running", 1)
    # the step that began the attempt finds it again (a re-run after a crash): no move at all
    again, began = sim.c.jobs.begin_attempt("job", key="k0")
    assert (again.attempt, began) == (1, False)


def test_a_stop_ends_in_stopped_even_when_a_restart_began_an_attempt_meanwhile(sim: Sim) -> None:
    _job_in(sim, S.STOPPING)
    sim.c.jobs.begin_attempt("job", key="a-restart-racing-the-stop")
    rec = sim.c.jobs.set_state("job", JobState.STOPPED, reason="stopped on request")
    assert (rec.state, rec.attempt) == ("stopped", 1)


def test_setting_the_state_a_job_is_in_only_updates_the_reason(sim: Sim) -> None:
    _job_in(sim, S.WAITING)
    rec = sim.c.jobs.set_state("job", JobState.WAITING, reason="no spare; paged")
    assert (rec.state, rec.state_reason) == ("waiting", "no spare; paged")


def test_a_state_read_back_from_the_store_is_parsed_into_the_enum(sim: Sim) -> None:
    _job_in(sim, S.CRASHED)
    job = sim.c.jobs.get("job")
    assert job is not None and stored_state(job) is JobState.CRASHED
    with pytest.raises(ValueError, match="stored state 'paused' is not a job state"):
        stored_state(dataclasses.replace(job, state="paused"))


def test_an_unknown_job_is_a_key_error(sim: Sim) -> None:
    with pytest.raises(KeyError):
        sim.c.jobs.set_state("nope", JobState.RUNNING)


def test_docs_jobs_md_draws_the_same_table() -> None:
    text = (Path(__file__).resolve().parents[3] / "docs" / "jobs.md").read_text()
    drawn: dict[JobState, set[JobState]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and JobState.parse(cells[0]) is not None:
            drawn[JobState(cells[0])] = {JobState(s.strip()) for s in cells[1].split(",")}
    assert drawn == {state: set(targets) for state, targets in TRANSITIONS.items()}
