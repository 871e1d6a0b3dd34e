"""Injected time: one Clock protocol, the system clock, and a fake clock for tests.

Shared by agent and controller (the controller may import agent's wire-level helpers).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Wall-clock seconds since the epoch (for timestamps people read)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes backwards (for durations and ages)."""

    def sleep(self, seconds: float) -> None:
        """Block for `seconds` (a fake clock advances instead)."""


class SystemClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class FakeClock:
    """A clock that moves only when told; `sleep` advances it, so code under test never waits."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._now = start
        self._mono = 1000.0

    def now(self) -> float:
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock never goes backwards")
        with self._lock:
            self._now += seconds
            self._mono += seconds


SYSTEM_CLOCK = SystemClock()
