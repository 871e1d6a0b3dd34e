"""`NanGuard` alone: what counts as bad, its events and log lines, and the policy's answer."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from trainguard.clock import FakeClock
from trainguard.trainer.nan_guard import NanGuard, NanSettings


def guard(**settings: Any) -> tuple[NanGuard, list[tuple[str, dict[str, Any]]], FakeClock]:
    events: list[tuple[str, dict[str, Any]]] = []
    clock = FakeClock()
    g = NanGuard(
        settings=NanSettings(**settings),
        job="unit",
        rank=0,
        emit=lambda name, data: events.append((name, data)),
        clock=clock,
    )
    return g, events, clock


@pytest.mark.parametrize(
    ("loss", "grad_norm"),
    [(float("nan"), None), (float("inf"), 1.0), (1.0, float("-inf"))],
    ids=["nan-loss", "inf-loss", "inf-grad-norm"],
)
def test_a_non_finite_loss_or_grad_norm_is_bad_and_reported(
    loss: float, grad_norm: float | None
) -> None:
    g, events, _ = guard()
    assert g.check(4, loss=loss, grad_norm=grad_norm)
    assert [name for name, _ in events] == ["nan_loss"]
    assert events[0][1]["step"] == 4


def test_finite_values_are_fine_and_report_nothing() -> None:
    g, events, _ = guard(grad_spike_factor=None)
    assert not g.check(1, loss=1.0, grad_norm=100.0)
    assert not g.check(2, loss=None, grad_norm=None)
    assert events == []


def test_a_grad_norm_spike_past_the_factor_counts_once_five_norms_are_known() -> None:
    g, events, _ = guard(grad_spike_factor=3.0, grad_spike_window=10)
    assert not g.check(1, loss=1.0, grad_norm=100.0)  # fewer than 5 norms: no median yet
    for step in range(2, 7):
        assert not g.check(step, loss=1.0, grad_norm=1.0)
    assert g.check(7, loss=1.0, grad_norm=3.5)
    assert events == [("grad_norm_spike", {"step": 7, "grad_norm": 3.5, "median": 1.0})]
    g.rolled_back(step=7, to_step=5)  # the window is forgotten with the state
    assert not g.check(8, loss=1.0, grad_norm=3.5)


def test_nan_log_lines_are_rate_limited_but_every_event_goes_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g, events, clock = guard()
    with caplog.at_level(logging.ERROR, logger="trainguard.trainer"):
        for step in range(1, 4):
            g.check(step, loss=float("nan"), grad_norm=None)
            clock.advance(1.0)
        clock.advance(60.0)
        g.check(4, loss=float("nan"), grad_norm=None)
    lines = [r.getMessage() for r in caplog.records if "event=nan_loss" in r.getMessage()]
    assert len(lines) == 2 and "not_logged_since_last=2" in lines[1]
    assert len(events) == 4


@pytest.mark.parametrize("policy", ["continue", "stop", "rollback"])
def test_the_policy_applies_only_when_some_rank_saw_a_bad_state(policy: str) -> None:
    g, _, _ = guard(nan_policy=policy)
    assert g.action(nonfinite=False) == "continue"
    assert g.action(nonfinite=True) == policy


def test_a_rollback_is_reported_with_its_batch_skip() -> None:
    g, events, _ = guard(nan_policy="rollback", skip_batches=2)
    g.rolled_back(step=9, to_step=5)
    assert events == [("nan_rollback", {"step": 9, "to_step": 5, "skip_batches": 2})]


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"nan_policy": "ignore"}, "nan_policy"),
        ({"skip_batches": -1, "nan_policy": "rollback"}, "skip_batches must be >= 0"),
        ({"skip_batches": 3}, "skip_batches only applies"),
        ({"grad_spike_factor": 1.0}, "grad_spike_factor"),
    ],
    ids=["unknown-policy", "negative-skip", "skip-without-rollback", "spike-factor"],
)
def test_bad_settings_fail_naming_the_argument(settings: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        NanSettings(**settings)
