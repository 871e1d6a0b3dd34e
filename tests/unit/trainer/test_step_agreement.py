"""`StepAgreement` alone: which requests a rank brings, what it agrees on, and when.

Single process the local view is the agreement at every step; a recording coordinator (the
local one, `distributed` true) shows the pipelined schedule: posted at one step, collected
`interval` calls later.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from trainguard.clock import FakeClock
from trainguard.protocol import Control
from trainguard.trainer.agreement import AgreementSettings, StepAgreement
from trainguard.trainer.sync import Agreement, LocalCoordinator, LocalView


class RecordingCoordinator(LocalCoordinator):
    distributed = True  # type: ignore[assignment]

    def __init__(self, clock: FakeClock | None = None, cost_s: float = 0.0) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.clock = clock
        self.cost_s = cost_s  # fake time each finish() takes, as a slow all_reduce would

    def start(self, view: LocalView) -> None:
        self.calls.append("start")
        super().start(view)

    def finish(self) -> Agreement:
        self.calls.append("finish")
        if self.clock is not None:
            self.clock.advance(self.cost_s)
        return super().finish()


def agreement(
    coordinator: Any = None, clock: FakeClock | None = None, **settings: Any
) -> StepAgreement:
    return StepAgreement(
        coordinator=coordinator or LocalCoordinator(),
        settings=AgreementSettings(**settings),
        job="unit",
        clock=clock or FakeClock(),
    )


def ctl(action: str, request_id: str, job: str = "") -> Control:
    return Control(action=action, request_id=request_id, job=job)  # type: ignore[arg-type]


def test_requests_are_agreed_oldest_first_and_never_twice() -> None:
    a = agreement()
    a.receive([ctl("checkpoint", "r1"), ctl("stop", "r2"), ctl("checkpoint", "r1")])
    assert a.pending == [("checkpoint", "r1"), ("stop", "r2")]
    ag = a.at_step(1, step_time_s=None, periodic=False)
    assert ag is not None and (ag.action, ag.request_id) == ("checkpoint", "r1")
    a.done("r1")
    a.receive([ctl("checkpoint", "r1")])  # arrives late, already handled
    ag = a.at_step(2, step_time_s=None, periodic=False)
    assert ag is not None and (ag.action, ag.request_id) == ("stop", "r2")


def test_requests_for_another_job_or_with_a_bad_id_are_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = agreement()
    with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
        a.receive([ctl("stop", "r1", job="other"), ctl("stop", ""), ctl("stop", "x" * 300)])
    assert a.pending == []
    assert caplog.text.count("event=control_rejected") == 3


def test_a_retried_request_comes_back_first_in_line() -> None:
    a = agreement()
    a.receive([ctl("checkpoint", "r1"), ctl("stop", "r2")])
    a.done("r1")
    a.retry_first("checkpoint", "r1")
    assert a.pending == [("checkpoint", "r1"), ("stop", "r2")]


def test_sigterm_and_stale_stay_while_non_finite_lasts_until_the_next_agreement() -> None:
    a = agreement()
    a.note_nonfinite()
    a.note_sigterm()
    a.note_stale()
    ag = a.at_step(1, step_time_s=None, periodic=False)
    assert ag is not None and ag.nonfinite and ag.sigterm and ag.stale
    ag = a.at_step(2, step_time_s=None, periodic=False)
    assert ag is not None and not ag.nonfinite and ag.sigterm and ag.stale
    a.note_nonfinite()
    a.clear_nonfinite()
    ag = a.at_step(3, step_time_s=None, periodic=False)
    assert ag is not None and not ag.nonfinite


def test_distributed_agreements_are_posted_and_collected_interval_calls_later() -> None:
    coord = RecordingCoordinator()
    a = agreement(coord, sync_every=3)
    got = []
    for step in range(1, 8):
        ag = a.at_step(step, step_time_s=0.1, periodic=False)
        got.append(ag is not None)
        if ag is not None:
            assert ag.interval == 3
            a.post(ag.interval)
    # the first call agrees at once; then every third call collects the posted one
    assert got == [True, False, False, True, False, False, True]
    a.drain()
    assert not coord.in_flight
    assert coord.calls.count("start") == coord.calls.count("finish")


def test_a_periodic_checkpoint_step_collects_early_and_agrees_on_its_own_state() -> None:
    coord = RecordingCoordinator()
    a = agreement(coord, sync_every=10)
    first = a.at_step(1, step_time_s=0.1, periodic=False)
    assert first is not None
    a.post(first.interval)
    assert a.at_step(2, step_time_s=0.1, periodic=False) is None
    a.note_nonfinite()  # seen after the post: only a fresh agreement at this step sees it
    ag = a.at_step(3, step_time_s=0.1, periodic=True)
    assert ag is not None and ag.nonfinite


def test_a_costly_agreement_spreads_out_but_only_as_far_as_the_reaction_bound() -> None:
    # 20 ms per agreement at 50 ms steps: the 0.5 % budget asks for 80 steps between them,
    # the bound allows floor(0.8 * 0.5 s / 50 ms) = 8.
    clock = FakeClock()
    coord = RecordingCoordinator(clock, cost_s=0.02)
    a = agreement(coord, clock)
    intervals = []
    for step in range(1, 200):
        ag = a.at_step(step, step_time_s=0.05, periodic=False)
        if ag is not None:
            intervals.append(ag.interval)
            a.post(ag.interval)
    assert intervals[0] == 1 and max(intervals) == 8 and intervals[-1] == 8


def test_sync_every_below_one_fails_naming_it() -> None:
    with pytest.raises(ValueError, match="sync_every"):
        AgreementSettings(sync_every=0)
