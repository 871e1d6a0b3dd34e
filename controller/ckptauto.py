"""`checkpoint.interval: auto`: the controller keeps a running job's periodic checkpoint
interval at the optimal one (controller.ckptadvisor), within the spec's bounds.

`decide` is the pure rule: the advice is looked at every `economics.auto_interval_check_s`
and sent only when it moved by more than `economics.auto_interval_change` from the interval in
force. `AutoInterval` is its edge, run by the tick: a change is a decision row (ActionKind
CHECKPOINT_INTERVAL, key `ckpt-interval:<job>:<seq>`) written before anything is sent, then a
`set_checkpoint_interval` command to each node of the job's attempt, its id derived from the
decision and the attempt, its request id the decision's key. A controller killed in between
finds the row and sends the same decision under the same ids (the store keeps one command per
id, the ranks act once per request id), never another; a restarted attempt gets the newest
decision once its ranks run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from trainguard.clock import Clock
from trainguard.command_args import SetCheckpointIntervalArgs
from trainguard.controller.actionkinds import ActionKind
from trainguard.controller.ckptadvisor import CheckpointAdvisor
from trainguard.controller.ckptspec import CheckpointSpec
from trainguard.controller.config import EconomicsConfig
from trainguard.controller.jobs import JobManager
from trainguard.controller.jobstate import JobState
from trainguard.controller.records import JobRecord, NewAction
from trainguard.controller.store import Store
from trainguard.controller.store.errors import StoreUnavailable

__all__ = ["KEY_PREFIX", "AutoInterval", "IntervalDecision", "decide"]

log = logging.getLogger("trainguard.controller.ckptauto")

KEY_PREFIX = "ckpt-interval:"
_KIND = ActionKind.CHECKPOINT_INTERVAL.value


@dataclass(frozen=True)
class IntervalDecision:
    """One job's newest interval decision, as stored."""

    key: str  # the row's idempotency key, the trainer's request id
    seq: int  # 1, 2, ... per job
    every_steps: int
    ts: float  # when it was decided, unix s
    before: int = 0  # the interval it replaced (0: the program's own)


def decide(
    *,
    spec: CheckpointSpec,
    optimal_every_steps: int | None,
    current_every_steps: int,
    change: float,
) -> int | None:
    """The interval to send, or None to keep `current_every_steps`: the optimal one clamped to
    the spec's bounds, when it differs from the current one by more than the fraction
    `change` (hysteresis: a small drift of the advice never churns the ranks)."""
    if optimal_every_steps is None:
        return None
    target = spec.clamp(optimal_every_steps)
    if current_every_steps <= 0:
        return target
    if abs(target - current_every_steps) <= change * current_every_steps:
        return None
    return target


class AutoInterval:
    """Runs `decide` for every running auto job on the tick, and sends what it decided."""

    def __init__(
        self,
        *,
        store: Store,
        jobs: JobManager,
        advisor: CheckpointAdvisor,
        config: EconomicsConfig,
        clock: Clock,
    ) -> None:
        self.store = store
        self.jobs = jobs
        self.advisor = advisor
        self.config = config
        self.clock = clock
        self._next_look: dict[str, float] = {}  # job -> when its advice is looked at next
        self._latest: dict[str, IntervalDecision | None] = {}  # read from the store once
        self._sent: dict[str, tuple[str, int]] = {}  # job -> (decision key, attempt) queued
        self._specs: dict[str, tuple[float, CheckpointSpec | None]] = {}  # (updated_at, block)

    def tick(self, now: float) -> None:
        for job in self.jobs.records():
            if job.state != JobState.RUNNING.value:
                continue
            ck = self._checkpoint_spec(job)
            if ck is None or not ck.auto:
                continue
            try:
                self._tick_job(job, ck, now=now)
            except StoreUnavailable:
                return  # the next tick tries again, from what is stored

    def _checkpoint_spec(self, job: JobRecord) -> CheckpointSpec | None:
        """The job's checkpoint block, decoded once per version of its row (not per tick)."""
        kept = self._specs.get(job.name)
        if kept is None or kept[0] != job.updated_at:
            kept = (job.updated_at, self.jobs.spec(job).checkpoint)
            self._specs[job.name] = kept
        return kept[1]

    def latest(self, job: str) -> IntervalDecision | None:
        """The job's newest decision (from the store on first ask, then kept)."""
        if job not in self._latest:
            rows = self.store.actions.recent_of(_KIND, target=job)
            self._latest[job] = (
                _decision(rows[0].params, key=rows[0].idempotency_key, ts=rows[0].created_at)
                if rows
                else None
            )
        return self._latest[job]

    def history(self, job: str, *, limit: int = 10) -> list[IntervalDecision]:
        """The job's newest `limit` decisions, newest first (for `describe job`)."""
        return [
            _decision(r.params, key=r.idempotency_key, ts=r.created_at)
            for r in self.store.actions.recent_of(_KIND, target=job, limit=limit)
        ]

    def _tick_job(self, job: JobRecord, ck: CheckpointSpec, *, now: float) -> None:
        latest = self.latest(job.name)
        # the cadence runs on from the stored decision (a restarted controller sends the
        # decision it finds before it looks at the advice again)
        first_look = 0.0 if latest is None else latest.ts + self.config.auto_interval_check_s
        if now >= self._next_look.get(job.name, first_look):
            self._next_look[job.name] = now + self.config.auto_interval_check_s
            advice = self.advisor.advice(job.name, nodes=len(job.nodes))
            current = latest.every_steps if latest is not None else ck.start_every_steps or 0
            target = decide(
                spec=ck,
                optimal_every_steps=None if advice is None else advice.optimal_every_steps,
                current_every_steps=current,
                change=self.config.auto_interval_change,
            )
            if target is not None and advice is not None:
                latest = self._record(
                    job.name,
                    seq=1 if latest is None else latest.seq + 1,
                    every_steps=target,
                    before=current,
                    detail={
                        "optimal_s": round(advice.optimal_s, 3),
                        "optimal_every_steps": advice.optimal_every_steps,
                        "checkpoint_s": round(advice.checkpoint_s, 4),
                        "mtbf_s": round(advice.mtbf_s, 1),
                        "restart_s": round(advice.restart_s, 3),
                        "step_time_s": advice.step_time_s,
                    },
                    now=now,
                )
        if latest is not None:
            self._send(job, latest)

    def _record(
        self,
        job: str,
        *,
        seq: int,
        every_steps: int,
        before: int,
        detail: dict[str, Any],
        now: float,
    ) -> IntervalDecision:
        """Write the decision row (before anything is sent); the row already stored under
        this key wins (a decision is never replaced by another)."""
        key = f"{KEY_PREFIX}{job}:{seq}"
        params = {"seq": seq, "every_steps": every_steps, "before": before, **detail}
        self.store.actions.add(
            None,
            [
                NewAction(
                    kind=_KIND,
                    target=job,
                    idempotency_key=key,
                    params=params,
                    state="succeeded",
                    result=f"checkpoint every {every_steps} steps (was {before})",
                )
            ],
            ts=now,
        )
        row = self.store.actions.by_key(key)
        decision = _decision(params if row is None else row.params, key=key, ts=now)
        self._latest[job] = decision
        log.info(
            "event=checkpoint_interval_decided job=%s key=%s every_steps=%d before=%d optimal_s=%s",
            job,
            key,
            decision.every_steps,
            before,
            detail.get("optimal_s"),
        )
        return decision

    def _send(self, job: JobRecord, decision: IntervalDecision) -> None:
        """Queue the decision to each node of the attempt, once per (decision, attempt)."""
        if self._sent.get(job.name) == (decision.key, job.attempt):
            return
        args = SetCheckpointIntervalArgs(
            job=job.name, every_steps=decision.every_steps, request_id=decision.key
        )
        for node in job.attempt_nodes or job.nodes:
            self.jobs.nodes.queue_command(
                node, args, command_id=f"{decision.key}:a{job.attempt}:{node}"
            )
        self._sent[job.name] = (decision.key, job.attempt)


def _decision(params: dict[str, Any], *, key: str, ts: float = 0.0) -> IntervalDecision:
    return IntervalDecision(
        key=key,
        seq=int(params.get("seq", 0)),
        every_steps=int(params["every_steps"]),
        ts=ts,
        before=int(params.get("before", 0)),
    )
