"""The SIGTERM grace, enforced: once `sigterm_grace_s` is spent the process exits, whatever it
is doing then (a collective that never returns, a slow disk, or an interpreter shutdown that
waits on threads, child processes or exit hooks after `close()`).

Two watchdogs start at the signal. A daemon thread, a little before the deadline, logs
`event=sigterm_grace_expired`, flushes the logs (bounded: a handler stuck on a full pipe must
not hold the exit) and calls `os._exit(GRACE_EXIT_CODE)`. A Python thread cannot run once the
interpreter is finalizing (it may not take the interpreter lock then), so faulthandler's
watchdog, a C thread, is armed for the deadline itself: it writes every thread's stack to
stderr and exits with code 1 (faulthandler's) if the process is still there.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
from collections.abc import Callable

__all__ = ["GRACE_EXIT_CODE", "GraceWatchdog"]

log = logging.getLogger("trainguard.trainer")

# The documented exit code after the grace: a stop by signal is a clean end for the job's
# launcher (the previous checkpoint stays the latest one).
GRACE_EXIT_CODE = 0
_FLUSH_TIMEOUT_S = 0.2


def _margin_s(grace_s: float) -> float:
    """How long before the deadline the thread acts, so it wins over the C backstop."""
    return min(1.0, grace_s / 4)


class GraceWatchdog:
    """Started once, at the first SIGTERM; `exit_now` is swapped out only by tests."""

    def __init__(
        self,
        *,
        grace_s: float,
        describe: Callable[[], str],
        exit_now: Callable[[int], object] = os._exit,
    ) -> None:
        if grace_s <= 0:
            raise ValueError(f"grace_s must be positive, got {grace_s}")
        self.grace_s = grace_s
        self._describe = describe
        self._exit_now = exit_now
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-grace", daemon=True)
        self._backstop = False

    def start(self) -> None:
        self._thread.start()
        try:
            faulthandler.dump_traceback_later(self.grace_s, exit=True)
            self._backstop = True
        except (ValueError, OSError, RuntimeError) as e:
            # stderr without a file descriptor (embedded interpreters, some test runners)
            log.warning("event=grace_backstop_unavailable reason=%r", str(e))

    def cancel(self) -> None:
        """Only for a process that outlives its `Trainguard` on purpose (tests)."""
        self._cancelled.set()
        if self._backstop:
            faulthandler.cancel_dump_traceback_later()

    def _run(self) -> None:
        if self._cancelled.wait(self.grace_s - _margin_s(self.grace_s)):
            return
        log.error("event=sigterm_grace_expired %s exit_code=%d", self._describe(), GRACE_EXIT_CODE)
        _flush_logs()
        self._exit_now(GRACE_EXIT_CODE)


def _flush_logs() -> None:
    """Flush every logging handler and the standard streams, giving up after a moment."""

    def flush() -> None:
        loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
        for lg in loggers:
            for h in getattr(lg, "handlers", ()):
                with contextlib.suppress(Exception):
                    h.flush()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()

    t = threading.Thread(target=flush, name="trainguard-grace-flush", daemon=True)
    t.start()
    t.join(_FLUSH_TIMEOUT_S)
