"""What failures cost a job, as pure functions: GPU-hours lost to each recovery (the downtime
and the steps redone from the last checkpoint, times the job's GPUs), the checkpoint overhead
(the time saves held the loop, times the GPUs), and money at a price per GPU-hour.

A recovery is the output of an incident's restart or rollback step (controller.actions
.recovery): `phases_s.mttr` (fault to training again; else the restart phase) is the downtime,
`lost_steps` the steps past the checkpoint it resumed from, redone at the job's step time.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FailureCost", "failure_cost", "recovery_loss"]

_H = 3600.0


@dataclass(frozen=True)
class FailureCost:
    """GPU-hours (and money, with a price) a job or an incident cost."""

    gpus: int  # the job's GPUs the hours are counted at
    failures: int  # recoveries counted
    downtime_gpu_hours: float
    redone_gpu_hours: float  # steps redone from the last checkpoint (0 without a step time)
    lost_gpu_hours: float  # downtime + redone
    checkpoint_overhead_gpu_hours: float | None = None  # saves holding the loop (jobs only)
    gpu_hour_price: float | None = None  # cost.gpu_hour
    lost_money: float | None = None
    checkpoint_overhead_money: float | None = None


def recovery_loss(output: Mapping[str, Any]) -> tuple[float, int] | None:
    """(downtime s, lost steps) of one recovery's output; None when it measured no phase."""
    phases = output.get("phases_s")
    if not isinstance(phases, Mapping):
        return None
    down = phases.get("mttr", phases.get("restart"))
    if not isinstance(down, int | float) or not math.isfinite(down) or down < 0:
        return None
    lost = output.get("lost_steps")
    return float(down), lost if isinstance(lost, int) and lost > 0 else 0


def failure_cost(
    *,
    recoveries: Iterable[Mapping[str, Any]],
    gpus: int,
    step_time_s: float | None,
    checkpoint_block_s: float | None = None,
    gpu_hour_price: float | None = None,
) -> FailureCost:
    """The cost of `recoveries` for a job of `gpus` GPUs at `step_time_s` a step, plus
    `checkpoint_block_s` seconds its saves held the loop (None: not counted)."""
    if gpus < 0:
        raise ValueError("gpus must be >= 0")
    down_s = 0.0
    redone_steps = 0
    failures = 0
    for out in recoveries:
        loss = recovery_loss(out)
        if loss is None:
            continue
        failures += 1
        down_s += loss[0]
        redone_steps += loss[1]
    step_s = step_time_s if step_time_s is not None and math.isfinite(step_time_s) else 0.0
    downtime = down_s * gpus / _H
    redone = redone_steps * max(0.0, step_s) * gpus / _H
    overhead = None if checkpoint_block_s is None else checkpoint_block_s * gpus / _H
    price = gpu_hour_price
    return FailureCost(
        gpus=gpus,
        failures=failures,
        downtime_gpu_hours=downtime,
        redone_gpu_hours=redone,
        lost_gpu_hours=downtime + redone,
        checkpoint_overhead_gpu_hours=overhead,
        gpu_hour_price=price,
        lost_money=None if price is None else (downtime + redone) * price,
        checkpoint_overhead_money=None if price is None or overhead is None else overhead * price,
    )
