"""Tiered checkpoint retention: the policy and the pure choice of what each checkpoint is kept as.

A checkpoint is kept when any tier holds it: `newest` (the newest verified one, never deleted,
and anything newer than it), `base` (the full checkpoint a kept delta checkpoint is encoded
against: a delta without its base is useless), `milestone` (the newest checkpoint carrying each
name the job marked, kept forever), `recent` (the newest `recent_last`, and everything from the
last `recent_hours`), `daily` (the newest of each of the last `daily_days` UTC days), `weekly`
(the newest of each of the last `weekly_weeks` ISO weeks, Monday to Sunday, UTC). A policy with
every tier at 0 keeps everything. No I/O here: the trainer, the S3 store and trainguard-ckpt
apply the same `select` to what they list.
"""

from __future__ import annotations

import enum
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from trainguard.ckpt_env import RETENTION_ENV, check_retention
from trainguard.decode import Invalid

__all__ = [
    "CheckpointInfo",
    "RetentionPolicy",
    "Tier",
    "check_milestone_name",
    "retention_from_env",
    "select",
]

_DAY_S = 86400.0
# 1970-01-01 was a Thursday: day 4 since the epoch is the first Monday.
_FIRST_MONDAY_DAY = 4
_MILESTONE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class Tier(enum.StrEnum):
    """Why a checkpoint is kept, strongest first (a checkpoint may be held by several)."""

    NEWEST = "newest"  # the newest verified checkpoint, or newer than it
    MILESTONE = "milestone"
    RECENT = "recent"
    DAILY = "daily"
    WEEKLY = "weekly"
    ALL = "all"  # a policy with every tier at 0 keeps everything
    BASE = "base"  # the base of a delta checkpoint another tier keeps


def check_milestone_name(name: str) -> str:
    """The name, or ValueError: 1-64 characters of letters, digits, `.`, `_`, `-`."""
    if not isinstance(name, str) or not _MILESTONE_NAME.fullmatch(name):
        raise ValueError(
            f"milestone name must be 1-64 letters, digits, '.', '_' or '-' starting with a "
            f"letter or digit, got {name!r}"
        )
    return name


@dataclass(frozen=True)
class RetentionPolicy:
    """How many checkpoints each tier keeps; 0 turns a tier off, all 0 keeps everything."""

    # The newest K committed checkpoints (the former `keep_last`): fast rollback.
    recent_last: int = 3
    # Every checkpoint from the last H hours (0: off).
    recent_hours: float = 0.0
    # The newest checkpoint of each of the last D UTC days, today included (0: off).
    daily_days: int = 0
    # The newest checkpoint of each of the last W ISO weeks, this one included (0: off).
    weekly_weeks: int = 0

    def __post_init__(self) -> None:
        # the one check of these settings (the controller's job spec runs it at submit)
        try:
            check_retention(asdict(self))
        except Invalid as e:
            raise ValueError(f"retention.{e.key}: {e.reason}") from None

    @property
    def keeps_all(self) -> bool:
        return not (self.recent_last or self.recent_hours or self.daily_days or self.weekly_weeks)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "retention") -> RetentionPolicy:
        """Strict: an unknown key or a bad value raises ValueError naming `where.key`."""
        try:
            return cls(**check_retention(data))  # type: ignore[arg-type]  # checked per key
        except Invalid as e:
            raise ValueError(
                f"{where}.{e.key}: {e.reason}" if e.key else f"{where} {e.reason}"
            ) from None
        except ValueError as e:
            raise ValueError(str(e).replace("retention.", f"{where}.", 1)) from None


def retention_from_env(env: Mapping[str, str] | None = None) -> RetentionPolicy | None:
    """The policy in `TRAINGUARD_RETENTION` (a JSON object of RetentionPolicy fields;
    unset or empty: None). Strict: bad JSON, an unknown key or a bad value raise ValueError
    naming the variable and the key."""
    raw = (os.environ if env is None else env).get(RETENTION_ENV, "").strip()
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{RETENTION_ENV}: not a JSON object: {e}") from None
    return RetentionPolicy.from_json(data, where=RETENTION_ENV)


@dataclass(frozen=True)
class CheckpointInfo:
    """What selection needs of one checkpoint. `created_at` None: its manifest is unreadable
    (only the count of `recent_last` and `newest` can hold it)."""

    step: int
    created_at: float | None
    milestones: tuple[str, ...] = ()
    base_step: int | None = None  # a delta checkpoint: the full checkpoint it needs


def _newest_per_bucket(
    infos: Iterable[CheckpointInfo], *, bucket_of: Any, first_bucket: int
) -> set[int]:
    best: dict[int, CheckpointInfo] = {}
    for c in infos:
        if c.created_at is None:
            continue
        b = bucket_of(c.created_at)
        if b < first_bucket:
            continue
        held = best.get(b)
        if held is None or (c.created_at, c.step) > (held.created_at or 0.0, held.step):
            best[b] = c
    return {c.step for c in best.values()}


def _day(t: float) -> int:
    return int(t // _DAY_S)


def _week(t: float) -> int:
    return (_day(t) - _FIRST_MONDAY_DAY) // 7


def select(
    *,
    policy: RetentionPolicy,
    checkpoints: Iterable[CheckpointInfo],
    now: float,
    newest_good_step: int | None,
) -> dict[int, tuple[Tier, ...]]:
    """Every checkpoint's step -> the tiers that keep it, strongest first; () means delete.

    `newest_good_step`: the newest verified checkpoint (None: none is known, and then nothing
    is deleted, since the only good copy might be among them)."""
    infos = sorted(checkpoints, key=lambda c: c.step, reverse=True)
    out: dict[int, list[Tier]] = {c.step: [] for c in infos}
    if newest_good_step is None or policy.keeps_all:
        tier = Tier.ALL if policy.keeps_all else Tier.NEWEST
        return {step: (tier,) for step in out}
    for c in infos:
        if c.step >= newest_good_step:
            out[c.step].append(Tier.NEWEST)
    named: dict[str, CheckpointInfo] = {}
    for c in infos:
        for name in c.milestones:
            held = named.get(name)
            if held is None or (c.created_at or 0.0, c.step) > (held.created_at or 0.0, held.step):
                named[name] = c
    for c in {c.step: c for c in named.values()}.values():
        out[c.step].append(Tier.MILESTONE)
    recent = {c.step for c in infos[: policy.recent_last]}
    if policy.recent_hours:
        since = now - policy.recent_hours * 3600.0
        recent |= {c.step for c in infos if c.created_at is not None and c.created_at >= since}
    for step in recent:
        out[step].append(Tier.RECENT)
    if policy.daily_days:
        first = _day(now) - policy.daily_days + 1
        for step in _newest_per_bucket(infos, bucket_of=_day, first_bucket=first):
            out[step].append(Tier.DAILY)
    if policy.weekly_weeks:
        first = _week(now) - policy.weekly_weeks + 1
        for step in _newest_per_bucket(infos, bucket_of=_week, first_bucket=first):
            out[step].append(Tier.WEEKLY)
    # Last: a base is kept for whatever keeps one of its deltas (a base is always a full
    # checkpoint, so no base needs a base of its own).
    for c in infos:
        if out[c.step] and c.base_step is not None and c.base_step in out:
            if Tier.BASE not in out[c.base_step]:
                out[c.base_step].append(Tier.BASE)
    return {step: tuple(tiers) for step, tiers in out.items()}
