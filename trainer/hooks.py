"""`StepHook`: code that `Trainguard` runs at fixed points of a step, and its do-nothing default.

The library's own hook is chaos injection (`trainguard.trainer.chaos`). `Trainguard` keeps a
tuple of hooks, empty unless one is configured, so a run without hooks makes no hook calls.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO, Protocol

__all__ = ["StepHook"]


class StepHook(Protocol):
    """The points at which a hook runs. Subclass it to inherit the do-nothing default of
    every point the hook does not need."""

    def before_step(
        self, *, step: int, step_time_s: float | None, compute_used: bool
    ) -> float | None:
        """At the start of `Trainguard.step(step)`, before anything of the step is looked at.
        `step_time_s`: wall time since the previous `step()` returned (None on the first);
        `compute_used`: whether the loop has used `compute()` blocks. May raise, block or
        sleep. Returns a loss to report and check instead of the loop's, or None."""
        return None

    def after_compute(self, *, step: int, work_s: float) -> float:
        """At the end of a `compute()` block of step `step` (the one `step()` reports next),
        whose work took `work_s` wall seconds. Returns the seconds it then blocked the host;
        they count as compute time."""
        return 0.0

    def before_rank_file(self, *, step: int, rank: int, tmp: Path, file: BinaryIO) -> None:
        """In the checkpoint writer thread, with this rank's rank file of the step-`step`
        checkpoint just opened (empty) in the temporary directory `tmp`."""
        return None
