"""The job state machine: the states of the job table and the moves allowed between them.

Every write of a job's state goes through `check_job_transition` (JobManager.set_state,
JobManager.begin_attempt, JobManager.submit); a move outside `TRANSITIONS` raises
InvalidJobTransition. Setting a job to the state it is in is always allowed (it only updates
the reason). The stored strings are the members' values. docs/jobs.md draws the table.
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    PENDING = "pending"  # submitted (or resubmitted), no attempt started since
    STARTING = "starting"  # start_job sent for an attempt
    RUNNING = "running"  # a rank of the attempt reports
    RESTARTING = "restarting"  # a remediation or operator restart is under way
    CRASHED = "crashed"  # a process exited non-zero unasked, or an attempt did not start
    WAITING = "waiting"  # no spare yet for a node the job must leave
    STOPPING = "stopping"  # a stop step is under way
    STOPPED = "stopped"  # stopped on request
    COMPLETED = "completed"  # every node's processes exited 0 unasked
    FAILED = "failed"  # gave up: max_restarts, no stop of the old attempt, ...
    # not restarted again: it crash-looped without checkpoint progress (the restart-loop
    # breaker, controller.actions.restartloop); a person restarts or resubmits it
    HELD = "held"

    @classmethod
    def parse(cls, state: str) -> JobState | None:
        """The member a stored state names; None for a string outside the table (a record
        the Slurm backend made from a Slurm job state, never stored)."""
        try:
            return cls(state)
        except ValueError:
            return None

    @property
    def active(self) -> bool:
        """The job holds its nodes: a node of it belongs to it (job_of_node)."""
        return self in _ACTIVE

    @property
    def finished(self) -> bool:
        """The job is over; only a resubmit or a restart brings it back."""
        return self in _FINISHED


_ACTIVE = frozenset(
    {JobState.STARTING, JobState.RUNNING, JobState.RESTARTING, JobState.CRASHED, JobState.WAITING}
)
_FINISHED = frozenset({JobState.STOPPED, JobState.COMPLETED, JobState.FAILED, JobState.HELD})

_S = JobState
# state -> the other states a job in it may move to. Who makes each move:
#   submit (a new job, or a finished one resubmitted) -> pending
#   restart/rollback/grow step: a later attempt -> restarting; begin_attempt -> starting;
#     a node it cannot start on -> crashed (pending before the first attempt); no stop of the
#     old attempt, or max_restarts -> failed; a step past the checkpoint -> running
#   tick: starting -> running once a rank of the attempt reports
#   agent exit events: starting/running -> crashed (non-zero, unasked) / completed (all 0)
#   replace step: running/starting/crashed -> restarting; no spare -> waiting
#   stop step: -> stopping -> stopped
#   restart/rollback step: a job restarted restart_loop_restarts times without checkpoint
#     progress -> held (the restart-loop breaker)
# A stop ends in stopped even when another step moved the job while it ran (a restart that
# began an attempt meanwhile): the operator's stop wins, so every active state may go there.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _S.PENDING: frozenset({_S.STARTING, _S.RESTARTING, _S.WAITING, _S.STOPPING, _S.FAILED}),
    _S.STARTING: frozenset(
        {
            _S.RUNNING,
            _S.RESTARTING,
            _S.CRASHED,
            _S.WAITING,
            _S.STOPPING,
            _S.STOPPED,
            _S.COMPLETED,
            _S.FAILED,
        }
    ),
    _S.RUNNING: frozenset(
        {_S.RESTARTING, _S.CRASHED, _S.WAITING, _S.STOPPING, _S.STOPPED, _S.COMPLETED, _S.FAILED}
    ),
    _S.RESTARTING: frozenset(
        {_S.STARTING, _S.RUNNING, _S.CRASHED, _S.WAITING, _S.STOPPING, _S.STOPPED, _S.FAILED}
    ),
    _S.CRASHED: frozenset({_S.RESTARTING, _S.WAITING, _S.STOPPING, _S.STOPPED, _S.FAILED}),
    # the first attempt of a job that waited for a spare starts without a restart
    _S.WAITING: frozenset(
        {_S.PENDING, _S.STARTING, _S.RESTARTING, _S.STOPPING, _S.STOPPED, _S.FAILED}
    ),
    # an operator may restart a job while its stop is under way
    _S.STOPPING: frozenset({_S.STOPPED, _S.PENDING, _S.STARTING, _S.RESTARTING, _S.FAILED}),
    # a finished job comes back by a resubmit (pending) or an operator's restart; a job
    # stopped before its first attempt starts that attempt without a restart
    _S.STOPPED: frozenset({_S.PENDING, _S.STARTING, _S.RESTARTING, _S.STOPPING, _S.FAILED}),
    _S.COMPLETED: frozenset({_S.PENDING, _S.RESTARTING, _S.STOPPING, _S.FAILED}),
    _S.FAILED: frozenset({_S.PENDING, _S.RESTARTING, _S.STOPPING}),
    # the restart-loop breaker held it: a person resubmits, restarts or stops it
    _S.HELD: frozenset({_S.PENDING, _S.RESTARTING, _S.STOPPING, _S.FAILED}),
}
# The restart-loop breaker (a restart or rollback step) holds a job from any state a restart
# begins in.
for _held_from in (_S.STARTING, _S.RUNNING, _S.RESTARTING, _S.CRASHED, _S.WAITING):
    TRANSITIONS[_held_from] = TRANSITIONS[_held_from] | {_S.HELD}


class InvalidJobTransition(ValueError):
    """A write of a job's state that the table does not allow (a bug or a race between two
    steps on the same job: the step that tried it fails and a person looks)."""

    def __init__(self, job: str, current: JobState, wanted: JobState) -> None:
        allowed = ", ".join(s.value for s in JobState if s in TRANSITIONS[current]) or "nothing"
        super().__init__(
            f"job {job}: cannot go from {current.value} to {wanted.value}"
            f" (from {current.value} it may go to {allowed})"
        )
        self.job = job
        self.current = current
        self.wanted = wanted


def check_job_transition(job: str, current: JobState, wanted: JobState) -> None:
    """Raise InvalidJobTransition unless `current` may move to `wanted` (or equals it)."""
    if wanted != current and wanted not in TRANSITIONS[current]:
        raise InvalidJobTransition(job, current, wanted)


__all__ = [
    "TRANSITIONS",
    "InvalidJobTransition",
    "JobState",
    "check_job_transition",
]
