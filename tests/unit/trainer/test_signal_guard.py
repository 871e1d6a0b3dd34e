"""`SignalGuard` alone: SIGTERM is recorded once, its grace counted from it, and the previous
handler comes back. (The grace watchdog itself: test_grace.py.)"""

from __future__ import annotations

import os
import signal

import pytest

from trainguard.clock import FakeClock
from trainguard.trainer.signals import SignalGuard, SignalSettings


def guard(clock: FakeClock, calls: list[str], **settings: object) -> SignalGuard:
    return SignalGuard(
        settings=SignalSettings(sigterm_hard_exit=False, **settings),  # type: ignore[arg-type]
        job="unit",
        rank=0,
        on_sigterm=lambda: calls.append("sigterm"),
        clock=clock,
    )


def test_the_first_sigterm_is_recorded_and_starts_the_grace() -> None:
    clock = FakeClock()
    calls: list[str] = []
    g = guard(clock, calls, sigterm_grace_s=10.0)
    assert not g.received and g.left_s() == 10.0
    g.on_sigterm(signal.SIGTERM, None)
    clock.advance(4.0)
    g.on_sigterm(signal.SIGTERM, None)  # a second one changes nothing
    assert g.received and calls == ["sigterm"]
    assert g.left_s() == pytest.approx(6.0)
    clock.advance(7.0)
    assert g.left_s() == 0.0


def test_install_takes_sigterm_and_restore_gives_it_back() -> None:
    clock = FakeClock()
    calls: list[str] = []
    before = signal.getsignal(signal.SIGTERM)
    g = guard(clock, calls, dump_stacks_on_sigusr1=False)
    g.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert calls == ["sigterm"] and g.received
    finally:
        g.restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_without_handle_sigterm_nothing_is_installed() -> None:
    before = signal.getsignal(signal.SIGTERM)
    g = guard(FakeClock(), [], handle_sigterm=False, dump_stacks_on_sigusr1=False)
    g.install()
    assert signal.getsignal(signal.SIGTERM) == before
    g.restore()


def test_a_grace_that_is_not_positive_fails_naming_it() -> None:
    with pytest.raises(ValueError, match="sigterm_grace_s"):
        SignalSettings(sigterm_grace_s=0)
