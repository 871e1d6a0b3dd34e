"""`Trainguard.compute()`: per-rank compute time in heartbeats, and the chaos slowdown applied
to it (the signal the straggler rule needs: in a synchronous job step times are all equal)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.trainer.trainer_helpers import FakeAgent, TinyJob
from trainguard.clock import FakeClock
from trainguard.protocol import Heartbeat


def run_steps(
    tmp_path: Path,
    *,
    steps: int,
    work_s: list[float],
    chaos: str = "",
    wrap: bool = True,
) -> None:
    """Run `steps` steps on a fake clock; each step's work (in compute() blocks of the given
    lengths when `wrap`) plus a 0.5 s wait outside them, as a collective would add."""
    clock = FakeClock()
    job = TinyJob()
    tg = job.guard(tmp_path / "ckpt", clock=clock, chaos=chaos)
    for step in range(1, steps + 1):
        for w in work_s:
            if wrap:
                with tg.compute():
                    clock.advance(w)
            else:
                clock.advance(w)
        clock.advance(0.5)
        tg.step(step)
    tg.close()


def train_heartbeats(agent: FakeAgent) -> list[Heartbeat]:
    return [h for h in agent.drain() if h.phase == "train" and h.event is None]


def test_compute_blocks_of_a_step_add_up_and_leave_collective_waits_out(
    tmp_path: Path, agent: FakeAgent
) -> None:
    run_steps(tmp_path, steps=3, work_s=[0.25, 0.125])
    hbs = train_heartbeats(agent)
    assert [h.step for h in hbs] == [1, 2, 3]
    assert [h.compute_time_s for h in hbs] == [pytest.approx(0.375)] * 3
    # the step time holds the wait too
    assert [h.step_time_s for h in hbs[1:]] == [pytest.approx(0.875)] * 2


def test_a_loop_without_compute_blocks_sends_no_compute_time(
    tmp_path: Path, agent: FakeAgent
) -> None:
    run_steps(tmp_path, steps=2, work_s=[0.25], wrap=False)
    assert [h.compute_time_s for h in train_heartbeats(agent)] == [None, None]


def test_chaos_slowdown_from_step_k_lengthens_only_that_ranks_compute_time(
    tmp_path: Path, agent: FakeAgent
) -> None:
    run_steps(tmp_path, steps=5, work_s=[0.25], chaos="slow=0.5@step3:rank0")
    times = [h.compute_time_s for h in train_heartbeats(agent)]
    assert times == [pytest.approx(t) for t in (0.25, 0.25, 0.375, 0.375, 0.375)]


def test_chaos_slowdown_for_another_rank_leaves_this_one_alone(
    tmp_path: Path, agent: FakeAgent
) -> None:
    run_steps(tmp_path, steps=2, work_s=[0.25], chaos="slow=0.5@rank1")
    assert [h.compute_time_s for h in train_heartbeats(agent)] == [pytest.approx(0.25)] * 2


def test_an_exception_inside_compute_propagates_and_is_not_counted(
    tmp_path: Path, agent: FakeAgent
) -> None:
    clock = FakeClock()
    job = TinyJob()
    tg = job.guard(tmp_path / "ckpt", clock=clock)
    with pytest.raises(ZeroDivisionError), tg.compute():
        clock.advance(1.0)
        _ = 1 / 0
    with tg.compute():
        clock.advance(0.25)
    tg.step(1)
    tg.close()
    assert [h.compute_time_s for h in train_heartbeats(agent)] == [pytest.approx(0.25)]
