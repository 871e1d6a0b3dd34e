"""A job spec's `checkpoint` block: the periodic interval (fixed steps, or `auto`: the
controller sets it at run time within `min_every_steps`..`max_every_steps`) and the retention
tiers, validated at submit, and the launch environment they become
(`TRAINGUARD_CHECKPOINT_INTERVAL`, `TRAINGUARD_RETENTION`: trainguard.ckpt_env)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from trainguard.ckpt_env import (
    INTERVAL_ENV,
    RETENTION_ENV,
    CheckpointInterval,
    check_retention,
    format_interval,
)
from trainguard.decode import Invalid
from trainguard.protocol import MAX_CHECKPOINT_EVERY_STEPS

__all__ = ["CheckpointSpec", "check_env_checkpoint_settings", "checkpoint_env"]

AUTO = "auto"


@dataclass(frozen=True)
class CheckpointSpec:
    """`checkpoint:` in a job spec. `interval`: None (the program's own `checkpoint_every`),
    a number of steps (fixed: the program's is overridden), or "auto" (the controller sends
    the optimal interval, clamped to [min_every_steps, max_every_steps], while the job runs;
    the ranks start at `initial_every_steps`, min_every_steps when unset). `retention`: the
    trainer's retention tiers (recent_last, recent_hours, daily_days, weekly_weeks)."""

    # Any: "auto" or an integer (the one decoder takes no str | int union); checked below
    interval: Any = None
    min_every_steps: int = 10
    max_every_steps: int = 100_000
    initial_every_steps: int | None = None
    retention: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        top = MAX_CHECKPOINT_EVERY_STEPS
        value = self.interval
        if value is not None and value != AUTO:
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise Invalid(
                    "interval", f"must be 'auto' or a number of steps in [1, {top}], got {value!r}"
                )
        if not 1 <= self.min_every_steps <= top:
            raise Invalid("min_every_steps", f"must be in [1, {top}], got {self.min_every_steps}")
        if not self.min_every_steps <= self.max_every_steps <= top:
            raise Invalid(
                "max_every_steps",
                f"must be in [min_every_steps ({self.min_every_steps}), {top}],"
                f" got {self.max_every_steps}",
            )
        initial = self.initial_every_steps
        if initial is not None:
            if value != AUTO:
                raise Invalid("initial_every_steps", "is for interval: auto only")
            if not self.min_every_steps <= initial <= self.max_every_steps:
                raise Invalid(
                    "initial_every_steps",
                    f"must be within [min_every_steps, max_every_steps], got {initial}",
                )
        if self.retention is not None:
            try:
                check_retention(self.retention)
            except Invalid as e:
                raise Invalid(f"retention.{e.key}" if e.key else "retention", e.reason) from None

    @property
    def auto(self) -> bool:
        return self.interval == AUTO

    def clamp(self, every_steps: int) -> int:
        """`every_steps` within the spec's bounds."""
        return max(self.min_every_steps, min(self.max_every_steps, every_steps))

    @property
    def start_every_steps(self) -> int | None:
        """The interval the ranks start with: the fixed one, auto's initial; None: the
        program's own."""
        if self.auto:
            return self.initial_every_steps or self.min_every_steps
        return self.interval if isinstance(self.interval, int) else None


def checkpoint_env(
    spec: CheckpointSpec | None, *, every_steps: int | None = None
) -> dict[str, str]:
    """The launch environment of a `checkpoint` block; `every_steps`: auto's current interval
    (the controller's last decision), so that a restarted attempt starts at it."""
    if spec is None:
        return {}
    env: dict[str, str] = {}
    start = spec.start_every_steps
    if spec.auto and every_steps is not None:
        start = spec.clamp(every_steps)
    if start is not None:
        env[INTERVAL_ENV] = format_interval(CheckpointInterval(every_steps=start, auto=spec.auto))
    if spec.retention is not None:
        env[RETENTION_ENV] = json.dumps(spec.retention, sort_keys=True)
    return env


def check_env_checkpoint_settings(env: dict[str, str], spec: CheckpointSpec | None) -> None:
    """A job's `env` may carry TRAINGUARD_RETENTION itself (a JSON object): checked here as the
    trainer would at start; set by both `env` and `checkpoint.retention`, or the interval by
    both, the spec is ambiguous. Raises Invalid naming the key."""
    raw = env.get(RETENTION_ENV)
    if raw is not None:
        if spec is not None and spec.retention is not None:
            raise Invalid(f"env.{RETENTION_ENV}", "is set by checkpoint.retention: use one")
        try:
            data = json.loads(raw) if raw.strip() else {}
        except ValueError:
            raise Invalid(f"env.{RETENTION_ENV}", "not a JSON object") from None
        try:
            check_retention(data)
        except Invalid as e:
            where = f"env.{RETENTION_ENV}" + (f".{e.key}" if e.key else "")
            raise Invalid(where, e.reason) from None
    if INTERVAL_ENV in env:
        raise Invalid(f"env.{INTERVAL_ENV}", "set it as checkpoint.interval")
