"""The ranks a warm standby became (an `assign_standby`, agent.inprocess): this node's share of
the job from then on, reported, fenced, stopped and reaped as a torchrun launch is
(agent.jobs), so `stop_job`, exit reporting and heartbeats work the same.

The standby runs the rank in its own process (trainer/standby_child.py), in a session of its
own, so a signal to its process group reaches the rank and its data-loader workers. Unlike a
torchrun launch it is the agent's child: an agent restart does not re-adopt it (docs/agent.md,
"Warm standbys").
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from dataclasses import dataclass
from typing import Literal

from trainguard.agent.jobs import JobEvent
from trainguard.agent.launchrec import proc_start_ticks
from trainguard.agent.standby import Child
from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.protocol import EventKind, JobProcess

__all__ = ["StandbyRanks"]

log = logging.getLogger("trainguard.agent.standby_ranks")

KEEP_EXITED_S = 300.0  # an exited rank stays in the reports this long (its exit code shown)


@dataclass
class _Rank:
    job: str
    attempt: int
    child: Child
    start_ticks: int | None
    state: Literal["running", "stopping", "exited"] = "running"
    kill_at: float | None = None  # monotonic deadline for SIGKILL while stopping
    stopped: bool = False  # asked to stop (an exit then is no crash)
    exit_code: int | None = None
    reported: bool = False  # its job_exit was handed out
    exited_mono: float | None = None


class StandbyRanks:
    """job -> the rank a standby became on this node (at most one per job: a spare gives one
    standby). Thread-safe: the command handlers and the agent's loop both call it."""

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._ranks: dict[str, _Rank] = {}

    def add(self, *, job: str, attempt: int, child: Child) -> None:
        with self._lock:
            self._ranks[job] = _Rank(
                job=job, attempt=attempt, child=child, start_ticks=proc_start_ticks(child.pid)
            )
        log.info("event=standby_rank job=%s attempt=%d pid=%d", job, attempt, child.pid)

    def running(self, job: str) -> bool:
        with self._lock:
            r = self._ranks.get(job)
            return r is not None and r.state != "exited"

    def retag(self, job: str, *, attempt: int) -> bool:
        """The rank joined attempt `attempt` in process (a later `rejoin`): report it so."""
        with self._lock:
            r = self._ranks.get(job)
            if r is None or r.state == "exited" or r.attempt >= attempt:
                return False
            r.attempt = attempt
            return True

    def stop(self, job: str, *, grace_s: float, reason: str = "stop_job") -> bool:
        """SIGTERM the rank now, SIGKILL after `grace_s` (poll); False when none runs."""
        with self._lock:
            r = self._ranks.get(job)
            if r is None or r.state == "exited":
                return False
            self._stop_locked(r, grace_s=grace_s, reason=reason)
            return True

    def stop_stale(self, job: str, *, current_attempt: int, grace_s: float = 0.0) -> bool:
        """Fencing: a rank of an older attempt than `current_attempt` is stopped at once."""
        with self._lock:
            r = self._ranks.get(job)
            if r is None or r.state == "exited" or r.attempt >= current_attempt:
                return False
            self._stop_locked(r, grace_s=grace_s, reason=f"stale_attempt_current_{current_attempt}")
            return True

    def _stop_locked(self, r: _Rank, *, grace_s: float, reason: str) -> None:
        deadline = self._clock.monotonic() + grace_s
        r.stopped = True
        if r.state == "stopping" and r.kill_at is not None and r.kill_at <= deadline:
            return
        r.state, r.kill_at = "stopping", deadline
        self._signal(r, signal.SIGKILL if grace_s <= 0 else signal.SIGTERM)
        log.info(
            "event=standby_rank_stopping job=%s attempt=%d pid=%d grace_s=%g reason=%s",
            r.job,
            r.attempt,
            r.child.pid,
            grace_s,
            reason,
        )

    def _signal(self, r: _Rank, sig: signal.Signals) -> None:
        if r.child.poll() is not None:
            return  # reaped: its pid (and group) may belong to another process now
        try:
            os.killpg(r.child.pid, sig)  # its own session: the rank and its workers
        except OSError:
            with contextlib.suppress(OSError):
                os.kill(r.child.pid, sig)

    def poll(self) -> list[JobEvent]:
        """Reap exits, SIGKILL overdue stops; a `job_exit` for each rank that ended, once."""
        events: list[JobEvent] = []
        with self._lock:
            now = self._clock.monotonic()
            for r in self._ranks.values():
                if r.state == "exited":
                    continue
                code = r.child.poll()
                if code is None:
                    if r.state == "stopping" and r.kill_at is not None and now >= r.kill_at:
                        self._signal(r, signal.SIGKILL)
                        r.kill_at = None
                    continue
                r.state, r.exit_code, r.exited_mono = "exited", code, now
                if not r.reported:
                    r.reported = True
                    events.append(
                        JobEvent(
                            kind=EventKind.JOB_EXIT,
                            job=r.job,
                            attempt=r.attempt,
                            ts=self._clock.now(),
                            exit_code=code,
                            message=f"standby rank exited with code {code}",
                            data={"stopped": r.stopped, "standby": True},
                        )
                    )
                log.info(
                    "event=standby_rank_exited job=%s attempt=%d pid=%d code=%d stopped=%s",
                    r.job,
                    r.attempt,
                    r.child.pid,
                    code,
                    r.stopped,
                )
            for job in [
                j
                for j, r in self._ranks.items()
                if r.exited_mono is not None and now - r.exited_mono > KEEP_EXITED_S
            ]:
                del self._ranks[job]
        return events

    def processes(self) -> tuple[JobProcess, ...]:
        with self._lock:
            return tuple(
                JobProcess(
                    job=r.job,
                    attempt=r.attempt,
                    state=r.state,
                    pid=r.child.pid,
                    exit_code=r.exit_code if r.state == "exited" else None,
                )
                for r in self._ranks.values()
            )

    def launch_leaders(self) -> dict[tuple[int, int], str]:
        """(pid, start ticks) -> job of every live rank: its heartbeats speak for the job."""
        with self._lock:
            return {
                (r.child.pid, r.start_ticks): r.job
                for r in self._ranks.values()
                if r.state != "exited" and r.start_ticks is not None
            }

    def running_jobs(self) -> frozenset[str]:
        with self._lock:
            return frozenset(r.job for r in self._ranks.values() if r.state != "exited")

    def close(self) -> None:
        """The agent stops: a rank that is its child cannot be re-adopted by the next
        instance (its heartbeats would be refused), so it ends with the agent and the job
        recovers as from a lost rank."""
        with self._lock:
            for r in self._ranks.values():
                if r.state != "exited":
                    self._stop_locked(r, grace_s=0.0, reason="agent_stopping")
