"""`ChaosHook`: the faults it injects at each `StepHook` point, and that a run without chaos
rules installs no hook, so its step path never calls into the chaos code."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.unit.trainer.trainer_helpers import TinyJob
from trainguard.clock import FakeClock
from trainguard.trainer import ChaosError
from trainguard.trainer.chaos import ChaosHook, chaos_hooks, parse_chaos
from trainguard.trainer.manifest import list_committed


def make_hook(spec: str, *, rank: int = 0) -> tuple[ChaosHook, FakeClock, nn.Module]:
    clock = FakeClock()
    model = nn.Linear(2, 2)
    hooks = chaos_hooks(rules=parse_chaos(spec), rank=rank, job="unit", model=model, clock=clock)
    assert len(hooks) == 1 and isinstance(hooks[0], ChaosHook)
    return hooks[0], clock, model


def test_no_rules_install_no_hook() -> None:
    assert chaos_hooks(rules=(), rank=0, job="unit", model=nn.Linear(2, 2), clock=FakeClock()) == ()


@pytest.mark.parametrize(
    ("chaos", "calls_expected"),
    [
        pytest.param("", False, id="no-chaos"),
        # A rule for another rank still installs the hook: the recording below does see calls.
        pytest.param("slow=0.5@rank1", True, id="chaos-for-another-rank"),
    ],
)
def test_a_run_without_chaos_never_calls_into_the_chaos_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chaos: str, calls_expected: bool
) -> None:
    calls: list[str] = []

    def record(name: str) -> Callable[..., object]:
        original = getattr(ChaosHook, name)

        def wrapper(self: ChaosHook, **kw: object) -> object:
            calls.append(name)
            return original(self, **kw)

        return wrapper

    for name in ("before_step", "after_compute", "before_rank_file"):
        monkeypatch.setattr(ChaosHook, name, record(name))
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=2, chaos=chaos)
    batches = job.sampler.batches(job.loader)
    for step in (1, 2):
        with tg.compute():
            loss = job.train_step(batches)
        tg.step(step, loss=loss)
    tg.close()
    assert [s for s, _ in list_committed(tmp_path)] == [2]
    if calls_expected:
        assert set(calls) == {"before_step", "after_compute", "before_rank_file"}
    else:
        assert calls == []


def test_nan_fires_once_returning_nan_and_poisoning_the_first_float_parameter() -> None:
    hook, _, model = make_hook("nan@step3")
    assert hook.before_step(step=2, step_time_s=1.0, compute_used=False) is None
    assert torch.isfinite(model.weight).all()
    forced = hook.before_step(step=3, step_time_s=1.0, compute_used=False)
    assert forced is not None and math.isnan(forced)
    assert torch.isnan(model.weight).all()
    assert torch.isfinite(model.bias).all()
    # a rollback runs step 3 again: the fault was injected once, it is not injected again
    assert hook.before_step(step=3, step_time_s=1.0, compute_used=False) is None


def test_raise_fires_at_its_step_only_once() -> None:
    hook, _, _ = make_hook("raise@step2")
    hook.before_step(step=1, step_time_s=None, compute_used=False)
    with pytest.raises(ChaosError, match="step 2 on rank 0"):
        hook.before_step(step=2, step_time_s=1.0, compute_used=False)
    assert hook.before_step(step=2, step_time_s=1.0, compute_used=False) is None


@pytest.mark.parametrize(
    ("step_time_s", "compute_used", "rank", "slept_s"),
    [
        pytest.param(2.0, False, 0, 1.0, id="slows-this-rank"),
        pytest.param(None, False, 0, 0.0, id="first-step-has-no-step-time"),
        pytest.param(2.0, True, 0, 0.0, id="left-to-compute-blocks"),
        pytest.param(2.0, False, 1, 0.0, id="other-rank"),
    ],
)
def test_slow_without_compute_blocks_sleeps_a_fraction_of_the_step(
    step_time_s: float | None, compute_used: bool, rank: int, slept_s: float
) -> None:
    hook, clock, _ = make_hook("slow=0.5@rank0", rank=rank)
    t0 = clock.monotonic()
    hook.before_step(step=5, step_time_s=step_time_s, compute_used=compute_used)
    assert clock.monotonic() - t0 == pytest.approx(slept_s)


def test_slow_rules_add_up_inside_compute_blocks_from_their_step_on() -> None:
    hook, clock, _ = make_hook("slow=0.5@step3:rank0,slow=0.25")
    t0 = clock.monotonic()
    assert hook.after_compute(step=2, work_s=2.0) == pytest.approx(0.5)
    assert hook.after_compute(step=3, work_s=2.0) == pytest.approx(1.5)
    assert clock.monotonic() - t0 == pytest.approx(2.0)


def test_after_compute_without_a_slow_rule_returns_at_once() -> None:
    hook, clock, _ = make_hook("nan@step3")
    t0 = clock.monotonic()
    assert hook.after_compute(step=3, work_s=2.0) == 0.0
    assert clock.monotonic() == t0


def test_pause_write_leaves_other_steps_and_ranks_rank_files_alone(tmp_path: Path) -> None:
    hook, _, _ = make_hook("pause_write@step4:rank1", rank=0)
    f = io.BytesIO()
    hook.before_rank_file(step=4, rank=0, tmp=tmp_path, file=f)
    hook.before_rank_file(step=2, rank=0, tmp=tmp_path, file=f)
    assert f.getvalue() == b""
