"""The restart-loop breaker: a job that rules restarted `jobs.restart_loop_restarts` times
within `jobs.restart_loop_window_s` without checkpoint progress is not restarted again.

No progress: the newest committed step after each of those restarts (the step the next one
resumed from, or the job's newest committed step now for the last) is not greater than the
step it resumed from. An operator's restart (no incident) is never held and ends the count:
a person who restarts a held job gets the full count again. The restart and rollback steps
of every backend ask `find_loop` in their begin step, over the job's earlier restart rows
(`past_restarts`: what each recorded in its output), and keep the verdict in their progress
(`LOOP_KEY`) before they act on it, so a controller killed between the decision and its
effect (the job held, the page) finds the decision again and never decides twice.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: the job manager imports the store and the live state
    from trainguard.controller.jobs import JobManager

__all__ = ["LOOP_KEY", "PastRestart", "RestartLoop", "find_loop", "past_restarts", "restart_loop"]

# The key of a restart step's progress that holds the breaker's verdict.
LOOP_KEY = "restart_loop"
# How much of each restart's result the evidence keeps (the exit reason and output tail).
_RESULT_CHARS = 240


@dataclass(frozen=True)
class PastRestart:
    """One earlier restart of the job, as its action row recorded it."""

    action_id: int
    kind: str  # restart | rollback
    at: float  # unix s it started the new attempt
    ckpt_step: int | None  # the checkpoint it resumed from (None: from scratch)
    operator: bool  # a person's restart (no incident)
    state: str  # the row's state: succeeded, failed, running
    result: str  # how it ended: the exit reason of an attempt that crashed again
    cause: str = ""  # why it restarted: its incident's summary (the crash before it)

    def to_output(self) -> dict[str, Any]:
        return {
            "action_id": self.action_id,
            "kind": self.kind,
            "at": self.at,
            "ckpt_step": self.ckpt_step,
            "state": self.state,
            "result": self.result[-_RESULT_CHARS:],
            "cause": self.cause[-_RESULT_CHARS:],
        }


@dataclass(frozen=True)
class RestartLoop:
    """The breaker's verdict: the restarts without progress (oldest first) and the newest
    committed step now."""

    job: str
    restarts: tuple[PastRestart, ...]
    ckpt_step: int | None
    window_s: float
    last_exit: str = ""  # the crash that asked for this restart (its incident's summary)

    def reason(self) -> str:
        """One line for the job's state reason."""
        steps = sorted({_order(r.ckpt_step) for r in self.restarts})
        newest = "none" if self.ckpt_step is None else f"step {self.ckpt_step}"
        return (
            f"restart loop: {len(self.restarts)} restart{'' if len(self.restarts) == 1 else 's'}"
            f" in {self.window_s / 60:g} min without"
            f" checkpoint progress (resumed from {', '.join(_step_text(s) for s in steps)};"
            f" newest committed checkpoint: {newest}); not restarted again"
        )

    def evidence(self) -> str:
        """The page's text: the reason, then each restart with its time, the step it resumed
        from and how it ended."""
        lines = [f"job {self.job}: {self.reason()}"]
        for r in self.restarts:
            cause = f" after {r.cause[-_RESULT_CHARS:]!r}" if r.cause else ""
            lines.append(
                f"- {r.kind} #{r.action_id} at {_utc(r.at)}{cause}, from"
                f" {_step_text(r.ckpt_step)}: {r.state}: {r.result[-_RESULT_CHARS:] or 'no result'}"
            )
        if self.last_exit:
            lines.append(f"- then: {self.last_exit[-_RESULT_CHARS:]}")
        lines.append(f"Fix the cause, then `agentctl restart {self.job}` (or resubmit it).")
        return "\n".join(lines)

    def to_output(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "restarts": [r.to_output() for r in self.restarts],
            "ckpt_step": self.ckpt_step,
            "window_s": self.window_s,
            "last_exit": self.last_exit[-_RESULT_CHARS:],
            "reason": self.reason(),
        }

    @classmethod
    def from_output(cls, data: dict[str, Any]) -> RestartLoop:
        """The verdict a step's progress kept."""
        return cls(
            job=str(data["job"]),
            restarts=tuple(
                PastRestart(
                    action_id=int(r["action_id"]),
                    kind=str(r["kind"]),
                    at=float(r["at"]),
                    ckpt_step=_int_or_none(r.get("ckpt_step")),
                    operator=False,
                    state=str(r.get("state", "")),
                    result=str(r.get("result", "")),
                    cause=str(r.get("cause", "")),
                )
                for r in data.get("restarts", [])
            ),
            ckpt_step=_int_or_none(data.get("ckpt_step")),
            window_s=float(data["window_s"]),
            last_exit=str(data.get("last_exit", "")),
        )


def find_loop(
    job: str,
    history: Sequence[PastRestart],
    *,
    ckpt_now: int | None,
    now: float,
    limit: int,
    window_s: float,
    last_exit: str = "",
) -> RestartLoop | None:
    """The verdict when the newest restarts of `history` (within `window_s` of `now`) are
    `limit` or more in a row without checkpoint progress; None when the job may restart.
    `ckpt_now`: the job's newest committed step now (what the last restart led to)."""
    if limit <= 0:
        return None
    recent = sorted((r for r in history if r.at >= now - window_s), key=lambda r: r.at)
    chain: list[PastRestart] = []
    after = ckpt_now
    for r in reversed(recent):
        if r.operator or _order(after) > _order(r.ckpt_step):
            break  # a person restarted it, or a checkpoint newer than its start committed
        chain.append(r)
        after = r.ckpt_step
    if len(chain) < limit:
        return None
    return RestartLoop(
        job=job,
        restarts=tuple(reversed(chain)),
        ckpt_step=ckpt_now,
        window_s=window_s,
        last_exit=last_exit,
    )


def past_restarts(jobs: JobManager, job: str, *, now: float, exclude: int) -> list[PastRestart]:
    """The job's restart and rollback rows of the breaker's window that started an attempt
    (their output has started_at), but the step `exclude` (the one asking)."""
    config = jobs.config
    rows = jobs.store.actions.restarts_of(
        # the asking step and rows that started no attempt come back too: room for them
        job,
        since=now - config.restart_loop_window_s,
        limit=2 * config.restart_loop_restarts + 2,
    )
    out = []
    for action, output in rows:
        at = output.get("started_at")
        if action.id == exclude or not isinstance(at, int | float) or action.state == "skipped":
            continue
        incident = (
            jobs.store.incidents.get(action.incident_id) if action.incident_id is not None else None
        )
        out.append(
            PastRestart(
                action_id=action.id,
                kind=action.kind,
                at=float(at),
                ckpt_step=_int_or_none(output.get("ckpt_step")),
                operator=action.incident_id is None,
                state=action.state,
                result=action.result,
                cause=incident.summary if incident is not None else "",
            )
        )
    return out


def restart_loop(
    jobs: JobManager,
    job: str,
    *,
    now: float,
    ckpt_now: int | None,
    exclude: int,
    last_exit: str = "",
) -> RestartLoop | None:
    """`find_loop` over the job's stored restarts and the breaker's config; `last_exit`: the
    asking step's incident summary (the crash it answers)."""
    config = jobs.config
    if config.restart_loop_restarts <= 0:
        return None
    return find_loop(
        job,
        past_restarts(jobs, job, now=now, exclude=exclude),
        ckpt_now=ckpt_now,
        now=now,
        limit=config.restart_loop_restarts,
        window_s=config.restart_loop_window_s,
        last_exit=last_exit,
    )


def _order(step: int | None) -> int:
    return -1 if step is None else step


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _step_text(step: int | None) -> str:
    return "scratch" if step is None or step < 0 else f"step {step}"


def _utc(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
