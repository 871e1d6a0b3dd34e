"""The checkpoint settings a job spec passes to its ranks through the environment, each with
its one check (the controller's at submit and the trainer's at start are the same):
`TRAINGUARD_CHECKPOINT_INTERVAL` (the periodic interval: `N` steps, or `auto` / `auto:N`, the
controller's to set at run time, N until it does) and `TRAINGUARD_RETENTION` (a JSON object of
retention tiers, with their bounds)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.decode import Invalid
from trainguard.protocol import MAX_CHECKPOINT_EVERY_STEPS

__all__ = [
    "INTERVAL_ENV",
    "RETENTION_BOUNDS",
    "RETENTION_ENV",
    "CheckpointInterval",
    "check_retention",
    "format_interval",
    "parse_interval",
]

INTERVAL_ENV = "TRAINGUARD_CHECKPOINT_INTERVAL"
RETENTION_ENV = "TRAINGUARD_RETENTION"

# Each tier's key and its upper bound (0 turns a tier off). A typo (hours given as seconds)
# fails at construction instead of keeping every checkpoint for a century.
RETENTION_BOUNDS: Mapping[str, float] = {
    "recent_last": 10_000,
    "recent_hours": 24 * 366,
    "daily_days": 3660,
    "weekly_weeks": 520,
}
_FRACTIONAL = frozenset({"recent_hours"})


def check_retention(data: Any) -> dict[str, int | float]:
    """The retention settings in `data` (a mapping of some of RETENTION_BOUNDS' keys), or
    Invalid naming the key: an unknown key, a wrong type (integers but `recent_hours`, never
    a bool) or a value outside [0, bound]."""
    if not isinstance(data, Mapping):
        raise Invalid("", f"must be a mapping, got {type(data).__name__}")
    out: dict[str, int | float] = {}
    for key, value in data.items():
        if key not in RETENTION_BOUNDS:
            raise Invalid(str(key), f"unknown key (known: {', '.join(sorted(RETENTION_BOUNDS))})")
        kind = float if key in _FRACTIONAL else int
        if isinstance(value, bool) or not isinstance(value, int | kind):
            name = "a number" if kind is float else "an integer"
            raise Invalid(key, f"must be {name}, got {value!r}")
        if not 0 <= value <= RETENTION_BOUNDS[key]:
            raise Invalid(key, f"must be in [0, {RETENTION_BOUNDS[key]:g}], got {value!r}")
        out[key] = value
    return out


@dataclass(frozen=True)
class CheckpointInterval:
    """A periodic checkpoint interval: every `every_steps` steps (0: none), `auto` when the
    controller sets it at run time (`every_steps` is then the interval until it does)."""

    every_steps: int
    auto: bool = False


def parse_interval(text: str) -> CheckpointInterval:
    """`N`, `auto` or `auto:N` (N steps, 0 <= N <= MAX_CHECKPOINT_EVERY_STEPS), else Invalid."""
    raw = text.strip()
    auto = raw == "auto" or raw.startswith("auto:")
    number = raw[len("auto:") :] if raw.startswith("auto:") else ("0" if auto else raw)
    if not (number.isascii() and number.isdigit()) or int(number) > MAX_CHECKPOINT_EVERY_STEPS:
        raise Invalid(
            INTERVAL_ENV,
            f"must be N, 'auto' or 'auto:N' with N steps in [0, {MAX_CHECKPOINT_EVERY_STEPS}],"
            f" got {text!r}",
        )
    return CheckpointInterval(every_steps=int(number), auto=auto)


def format_interval(interval: CheckpointInterval) -> str:
    """The variable's value for `interval` (parse_interval reads it back)."""
    if interval.auto:
        return f"auto:{interval.every_steps}"
    return str(interval.every_steps)
