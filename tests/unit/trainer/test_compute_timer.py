"""`ComputeTimer` alone, on a fake clock and a CPU model: blocks of a step add up, each step's
sum is taken once, and time a hook blocks the host counts as compute."""

from __future__ import annotations

import pytest
import torch

from trainguard.clock import FakeClock
from trainguard.trainer.compute_timer import ComputeTimer
from trainguard.trainer.hooks import StepHook


class Sleeper(StepHook):
    def __init__(self, clock: FakeClock, sleep_s: float) -> None:
        self.clock = clock
        self.sleep_s = sleep_s
        self.seen: list[tuple[int, float]] = []

    def after_compute(self, *, step: int, work_s: float) -> float:
        self.seen.append((step, work_s))
        self.clock.advance(self.sleep_s)
        return self.sleep_s


def test_blocks_of_one_step_add_up_and_are_taken_once() -> None:
    clock = FakeClock()
    timer = ComputeTimer(model=torch.nn.Linear(2, 2), clock=clock)
    assert timer.take() is None and not timer.used
    for work_s in (0.25, 0.125):
        with timer.measure(step=1):
            clock.advance(work_s)
    clock.advance(1.0)  # outside the blocks: a collective's wait
    assert timer.used
    assert timer.take() == pytest.approx(0.375)
    assert timer.take() is None


def test_the_time_a_hook_blocks_the_host_counts_and_the_hook_learns_the_step() -> None:
    clock = FakeClock()
    hook = Sleeper(clock, 0.5)
    timer = ComputeTimer(model=torch.nn.Linear(2, 2), hooks=(hook,), clock=clock)
    with timer.measure(step=7):
        clock.advance(0.25)
    assert timer.take() == pytest.approx(0.75)
    assert hook.seen == [(7, pytest.approx(0.25))]


def test_a_block_that_raises_counts_nothing() -> None:
    clock = FakeClock()
    timer = ComputeTimer(model=torch.nn.Linear(2, 2), clock=clock)
    with pytest.raises(ZeroDivisionError), timer.measure(step=1):
        clock.advance(1.0)
        _ = 1 / 0
    assert timer.take() is None
