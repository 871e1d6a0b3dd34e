"""`SignalGuard`: the process signals a rank handles, SIGTERM and SIGUSR1.

SIGTERM (a preemption notice, or the launcher stopping the job) is only recorded: the loop
acts on it at the next agreed step (an emergency checkpoint, then a stop). Its grace bounds
the whole exit from the signal on (enforced by `trainer/grace.py`). SIGUSR1 dumps every
thread's stack (faulthandler), for the agent's `collect_stacks`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.trainer.grace import GraceWatchdog

__all__ = ["SignalGuard", "SignalSettings", "register_stack_dump"]

log = logging.getLogger("trainguard.trainer")


@dataclass(frozen=True)
class SignalSettings:
    """How a rank answers SIGTERM and SIGUSR1 (the `Trainguard` arguments of the same names)."""

    # Install a SIGTERM handler (only from the main thread; `restore()` puts the previous back).
    handle_sigterm: bool = True
    # Seconds from SIGTERM to exit, enforced until the process is gone (30: a typical
    # preemption notice leaves about that long).
    sigterm_grace_s: float = 30.0
    # When the grace runs out: os._exit(0) whatever the process is doing then.
    sigterm_hard_exit: bool = True
    # Register the SIGUSR1 stack dump (left alone if the program has its own handler).
    dump_stacks_on_sigusr1: bool = True

    def __post_init__(self) -> None:
        if self.sigterm_grace_s <= 0:
            raise ValueError(f"sigterm_grace_s must be positive, got {self.sigterm_grace_s}")


class SignalGuard:
    """Records the first SIGTERM (`sigterm_at`, monotonic), starts its grace watchdog and calls
    `on_sigterm` (from the signal handler: it must only set a flag). `install()` puts the
    handlers in place, `restore()` gives SIGTERM back to the previous handler."""

    def __init__(
        self,
        *,
        settings: SignalSettings,
        job: str,
        rank: int,
        latest_step: Callable[[], int | None] = lambda: None,
        on_sigterm: Callable[[], None] = lambda: None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        self.job = job
        self.rank = rank
        self.clock = clock
        self._latest_step = latest_step
        self._on_sigterm = on_sigterm
        self.sigterm_at: float | None = None
        self.watchdog: GraceWatchdog | None = None
        self._prev_handler: Any = None
        self._installed = False

    def install(self) -> None:
        if self.settings.handle_sigterm and threading.current_thread() is threading.main_thread():
            self._prev_handler = signal.signal(signal.SIGTERM, self.on_sigterm)
            self._installed = True
        if self.settings.dump_stacks_on_sigusr1:
            register_stack_dump()

    def restore(self) -> None:
        """Give SIGTERM back to the handler it had before `install()`. The grace watchdog of a
        SIGTERM already received keeps running: the grace bounds the whole exit."""
        if self._installed:
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGTERM, self._prev_handler)

    @property
    def received(self) -> bool:
        return self.sigterm_at is not None

    def deadline(self) -> float:
        """When the grace runs out (monotonic); from now if no SIGTERM came."""
        start = self.sigterm_at if self.sigterm_at is not None else self.clock.monotonic()
        return start + self.settings.sigterm_grace_s

    def left_s(self) -> float:
        """Seconds of grace left (0 when spent)."""
        return max(0.0, self.deadline() - self.clock.monotonic())

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """The SIGTERM handler (also callable directly, as a launcher's notice would)."""
        if self.sigterm_at is not None:
            return
        self.sigterm_at = self.clock.monotonic()
        log.warning(
            "event=sigterm job=%s rank=%d grace_s=%.1f",
            self.job,
            self.rank,
            self.settings.sigterm_grace_s,
        )
        self._on_sigterm()
        if self.settings.sigterm_hard_exit:
            # Runs past close(): the grace bounds the whole exit, interpreter shutdown included.
            self.watchdog = GraceWatchdog(
                grace_s=self.settings.sigterm_grace_s,
                describe=lambda: (
                    f"job={self.job} rank={self.rank} latest_step={self._latest_step()}"
                ),
            )
            self.watchdog.start()


_stack_dump_registered = False


def register_stack_dump() -> None:
    """SIGUSR1 -> every thread's Python stack on stderr (faulthandler, in C: it works while
    the loop is stuck in a collective). The agent's `collect_stacks` sends it. It stays
    registered for the life of the process: SIGUSR1's default action kills, and a dump
    request racing with close() must never do that. A handler the program installed itself
    is left alone."""
    global _stack_dump_registered
    if _stack_dump_registered:
        return
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        log.info("event=stack_dump_not_registered reason=sigusr1_handler_exists")
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError) as e:
        # stderr without a file descriptor (embedded interpreters, some test runners)
        log.info("event=stack_dump_not_registered reason=%r", str(e))
        return
    _stack_dump_registered = True


def stack_dump_registered() -> bool:
    return _stack_dump_registered
