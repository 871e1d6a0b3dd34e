"""`ComputeTimer`: how long this rank's own work of a step took (its `compute_time_s`).

In a synchronous job every rank's step time equals the slowest rank's (they wait for it in
the gradient all-reduce), so only the time of the rank's own work tells the straggler apart.
The loop wraps that work (forward and backward, not the waits in collectives) in `measure()`
blocks; blocks of one step add up. On CPU they are timed on the clock; on CUDA with event
pairs read without synchronising, so a step whose kernels are still running is reported by
a later `take()`, once they are done.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.trainer.hooks import StepHook

__all__ = ["ComputeTimer"]

# A GPU far behind the host: never hold more steps' events than this.
_PENDING_STEPS_MAX = 8


class ComputeTimer:
    """Times `measure()` blocks of the model's work; `take()` once per step returns the sum.

    `hooks` run at the end of each block (`StepHook.after_compute`); the seconds they block
    the host count as compute time."""

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        hooks: tuple[StepHook, ...] = (),
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.model = model
        self.hooks = hooks
        self.clock = clock
        self.used = False  # whether the loop has used a measure() block
        self._cuda: bool | None = None  # decided at the first block, from the model
        # CPU: wall seconds of this step's blocks. CUDA: this step's event pairs not yet read
        # (the GPU may still be running them) plus the host time hooks blocked, per step.
        self._cpu_s: float | None = None
        self._events: list[tuple[Any, Any]] = []
        self._extra_s = 0.0
        self._pending: deque[tuple[list[tuple[Any, Any]], float]] = deque()
        self._last_s: float | None = None

    @contextlib.contextmanager
    def measure(self, *, step: int) -> Iterator[None]:
        """Time the block as part of step `step` (the one the next `take()` reports)."""
        cuda = self._cuda
        if cuda is None:
            cuda = self._cuda = any(p.is_cuda for p in self.model.parameters())
        self.used = True
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = self.clock.monotonic()
        yield
        slept_s = 0.0
        for hook in self.hooks:
            slept_s += hook.after_compute(step=step, work_s=self.clock.monotonic() - t0)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((start, end))
            self._extra_s += slept_s  # the GPU did not see the host's block
        else:
            self._cpu_s = (self._cpu_s or 0.0) + self.clock.monotonic() - t0

    def take(self) -> float | None:
        """This step's compute time (None if it used no block); on CUDA the newest step whose
        events have completed, without waiting for the GPU."""
        if not self._cuda:
            took, self._cpu_s = self._cpu_s, None
            return took
        if self._events:
            self._pending.append((self._events, self._extra_s))
            self._events, self._extra_s = [], 0.0
        while self._pending and all(e.query() for _, e in self._pending[0][0]):
            pairs, extra_s = self._pending.popleft()
            self._last_s = extra_s + sum(a.elapsed_time(b) for a, b in pairs) / 1000.0
        if len(self._pending) > _PENDING_STEPS_MAX:
            self._pending.popleft()
        took, self._last_s = self._last_s, None
        return took
