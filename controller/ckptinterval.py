"""The optimal checkpoint interval, as pure functions: Young's and Daly's rules, the expected
waste of an interval, and the MTBF a job can expect from the cluster's failure history.

The model (docs/controller.md "Checkpoint interval"): a job computes for T seconds between
checkpoints, each checkpoint costs it C seconds of training (the time a save blocks the
loop), a failure comes every M seconds on average (the job's MTBF) and costs the restart time
R plus, on average, half an interval of work redone since the last checkpoint. The fraction
of wall time wasted is then, to first order,

    waste(T) = C / T + (T / 2 + R) / M

minimised by Young's T = sqrt(2 C M); Daly's higher-order refinement
T = sqrt(2 C M) [1 + (1/3) sqrt(C / 2M) + (1/9) (C / 2M)] - C (for C < 2M, else M) stays
right when C is not small against M. Worked example: M = 12 h, C = 5 min gives Young's
sqrt(2 * 300 * 43200) = 5091 s (1.4 h) and Daly's 4893 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "IntervalAdvice",
    "advise",
    "daly_interval_s",
    "expected_waste",
    "job_mtbf_s",
    "node_mtbf_s",
    "young_interval_s",
]


def _check(name: str, value: float, *, positive: bool = True) -> None:
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}")


def young_interval_s(*, checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints: sqrt(2 C M), seconds."""
    _check("checkpoint_s", checkpoint_s)
    _check("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval_s(*, checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum, seconds: sqrt(2 C M) [1 + (1/3) sqrt(C/2M) + (1/9) C/2M]
    - C while C < 2M; M when a checkpoint costs two MTBFs or more (checkpoint once per
    failure, there is nothing better)."""
    _check("checkpoint_s", checkpoint_s)
    _check("mtbf_s", mtbf_s)
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2.0 * mtbf_s)
    young = math.sqrt(2.0 * checkpoint_s * mtbf_s)
    return young * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - checkpoint_s


def expected_waste(
    *, interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float
) -> float:
    """The fraction of wall time lost with checkpoints every `interval_s` of compute:
    C/T (checkpoint overhead) + (T/2 + R)/M (half an interval redone plus the restart, once
    per failure), capped at 1 (beyond it the job makes no progress at all)."""
    _check("interval_s", interval_s)
    _check("checkpoint_s", checkpoint_s, positive=False)
    _check("restart_s", restart_s, positive=False)
    _check("mtbf_s", mtbf_s)
    return min(1.0, checkpoint_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s)


def node_mtbf_s(
    *,
    incidents: int,
    exposure_s: float,
    prior_mtbf_s: float,
    prior_incidents: float,
) -> float:
    """A node's MTBF from the cluster's history: `incidents` hardware incidents over
    `exposure_s` node-seconds, with a prior worth `prior_incidents` incidents at
    `prior_mtbf_s` (a gamma prior on the failure rate): (exposure + k * prior) / (n + k).
    With no history it is the prior; as incidents accumulate the cluster's own rate wins."""
    if incidents < 0:
        raise ValueError("incidents must be >= 0")
    _check("exposure_s", exposure_s, positive=False)
    _check("prior_mtbf_s", prior_mtbf_s)
    _check("prior_incidents", prior_incidents)
    return (exposure_s + prior_incidents * prior_mtbf_s) / (incidents + prior_incidents)


def job_mtbf_s(*, node_mtbf_s: float, nodes: int) -> float:
    """A job on `nodes` nodes fails when any of them does: node MTBF / nodes."""
    _check("node_mtbf_s", node_mtbf_s)
    if nodes < 1:
        raise ValueError("nodes must be >= 1")
    return node_mtbf_s / nodes


@dataclass(frozen=True)
class IntervalAdvice:
    """One job's checkpoint interval, measured and optimal, with the inputs that gave it.

    Intervals are seconds of training between checkpoints; `*_every_steps` the same in steps
    at the job's step time (None without one); wastes are fractions of wall time."""

    checkpoint_s: float  # C: measured cost of one checkpoint to the training loop
    restart_s: float  # R: time from a failure to training again
    mtbf_s: float  # M: the job's expected time between failures
    node_mtbf_s: float
    young_s: float
    optimal_s: float  # Daly's
    optimal_waste: float
    current_s: float | None = None  # the interval the job runs with (None: no periodic ones)
    current_waste: float | None = None
    step_time_s: float | None = None
    optimal_every_steps: int | None = None
    current_every_steps: int | None = None


def advise(
    *,
    checkpoint_s: float,
    restart_s: float,
    node_mtbf_s: float,
    nodes: int,
    current_s: float | None = None,
    step_time_s: float | None = None,
) -> IntervalAdvice:
    """The advice for a job on `nodes` nodes (see the module docstring for the model)."""
    mtbf = job_mtbf_s(node_mtbf_s=node_mtbf_s, nodes=nodes)
    # a checkpoint too cheap to measure still costs something: 1 ms keeps T finite and > 0
    cost = max(checkpoint_s, 1e-3)
    optimal = daly_interval_s(checkpoint_s=cost, mtbf_s=mtbf)
    current_waste = None
    if current_s is not None and current_s > 0:
        current_waste = expected_waste(
            interval_s=current_s, checkpoint_s=cost, restart_s=restart_s, mtbf_s=mtbf
        )
    step_s = step_time_s if step_time_s is not None and math.isfinite(step_time_s) else None
    step_s = step_s if step_s is not None and step_s > 0 else None
    return IntervalAdvice(
        checkpoint_s=checkpoint_s,
        restart_s=restart_s,
        mtbf_s=mtbf,
        node_mtbf_s=node_mtbf_s,
        young_s=young_interval_s(checkpoint_s=cost, mtbf_s=mtbf),
        optimal_s=optimal,
        optimal_waste=expected_waste(
            interval_s=optimal, checkpoint_s=cost, restart_s=restart_s, mtbf_s=mtbf
        ),
        current_s=current_s,
        current_waste=current_waste,
        step_time_s=step_s,
        optimal_every_steps=None if step_s is None else max(1, round(optimal / step_s)),
        current_every_steps=(
            max(1, round(current_s / step_s))
            if step_s is not None and current_s is not None and current_s > 0
            else None
        ),
    )
