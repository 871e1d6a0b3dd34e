"""Per-source collection: each hardware source runs in its own worker on its own interval,
with a deadline past which that source, never the agent, is marked stale.

`SourceState` is the schedule and deadline state machine (pure; tested on a fake clock).
`Source` runs one body, a plain function such as `collector.collect`, on it: in its worker
thread, or inline in the caller (tests). The collect loop only takes what finished
(`Source.take`); it never waits on a source. A call stuck past its deadline is abandoned: the
worker stays inside it and no second call of that source starts until it returns, so a
permanently hung NVML costs one thread, never more.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from trainguard.clock import Clock

__all__ = [
    "MAX_PENDING_OUTCOMES",
    "TakeResult",
    "CallOutcome",
    "Source",
    "SourceState",
    "Transition",
]

log = logging.getLogger("trainguard.agent.sources")

# Finished calls kept until the collect loop takes them. The loop takes them every tick; 64
# is a minute of a 1 s source while the loop itself is stuck (systemd's watchdog acts first).
MAX_PENDING_OUTCOMES = 64
ERROR_MAX_CHARS = 200


@dataclass(frozen=True)
class CallOutcome:
    """One finished call: its value, or the error it raised (bounded text)."""

    value: Any
    error: str | None
    duration_s: float
    late: bool  # it took longer than the deadline


@dataclass(frozen=True)
class Transition:
    """A source went stale (a call overran its deadline) or recovered (a call was on time)."""

    source: str
    kind: Literal["stale", "recovered"]
    deadline_s: float
    running_s: float = 0.0  # stale: how long the overrunning call had run when seen
    stale_for_s: float = 0.0  # recovered: how long the source was stale


@dataclass(frozen=True)
class TakeResult:
    """What one `Source.take` hands the collect loop."""

    outcomes: tuple[CallOutcome, ...]
    transitions: tuple[Transition, ...]
    stale: bool
    last_success_unix: float | None


class SourceState:
    """When a source runs next, whether a call is in flight, and whether it is stale.

    The first call is due at once; later calls keep the cadence from each call's start, and a
    call that overran is followed at once by the next (no burst of catch-up calls). A call in
    flight longer than `deadline_s`, seen by `check` or when it returns, marks the source
    stale (one `stale` transition per episode); the next call that returns within its deadline
    marks it recovered. Not thread-safe: `Source` guards it with its lock.
    """

    def __init__(self, *, name: str, interval_s: float, deadline_s: float, now_mono: float) -> None:
        if not interval_s > 0 or not deadline_s > 0:
            raise ValueError(f"{name}: interval_s and deadline_s must be > 0")
        self.name = name
        self.interval_s = interval_s
        self.deadline_s = deadline_s
        self.next_run_mono = now_mono
        self.started_mono: float | None = None
        self.stale = False
        self.stale_since_mono: float | None = None
        self.last_success_unix: float | None = None
        self.calls_total = 0
        self.late_total = 0

    def due(self, now_mono: float) -> bool:
        return self.started_mono is None and now_mono >= self.next_run_mono

    def wait_s(self, now_mono: float) -> float:
        """Seconds until the next call is due (0 when due now)."""
        return max(0.0, self.next_run_mono - now_mono)

    def begin(self, now_mono: float) -> None:
        if self.started_mono is not None:
            raise RuntimeError(f"{self.name}: a call is already in flight")
        self.started_mono = now_mono
        self.calls_total += 1

    def check(self, now_mono: float) -> Transition | None:
        """The `stale` transition when the call in flight has just overrun its deadline."""
        if self.started_mono is None or self.stale:
            return None
        running_s = now_mono - self.started_mono
        if running_s <= self.deadline_s:
            return None
        return self._go_stale(now_mono, running_s)

    def finish(
        self, now_mono: float, *, ok: bool, now_unix: float
    ) -> tuple[float, bool, Transition | None]:
        """The call in flight returned: (its duration, whether it was late, a transition)."""
        if self.started_mono is None:
            raise RuntimeError(f"{self.name}: no call in flight")
        started, self.started_mono = self.started_mono, None
        duration_s = now_mono - started
        self.next_run_mono = max(started + self.interval_s, now_mono)
        if ok:
            self.last_success_unix = now_unix
        late = duration_s > self.deadline_s
        if late:
            self.late_total += 1
            # an overrun the loop did not see while it lasted still makes an episode
            return duration_s, True, None if self.stale else self._go_stale(now_mono, duration_s)
        if not self.stale:
            return duration_s, False, None
        since = self.stale_since_mono if self.stale_since_mono is not None else now_mono
        self.stale = False
        self.stale_since_mono = None
        return (
            duration_s,
            False,
            Transition(
                source=self.name,
                kind="recovered",
                deadline_s=self.deadline_s,
                stale_for_s=now_mono - since,
            ),
        )

    def _go_stale(self, now_mono: float, running_s: float) -> Transition:
        self.stale = True
        self.stale_since_mono = now_mono
        return Transition(
            source=self.name, kind="stale", deadline_s=self.deadline_s, running_s=running_s
        )


class Source:
    """One body run on its own schedule: by `start()`'s worker thread, or by `run_if_due()`
    in the caller's thread (tests on a fake clock). `take()` never blocks on the body."""

    def __init__(
        self,
        name: str,
        body: Callable[[], Any],
        *,
        interval_s: float,
        deadline_s: float,
        clock: Clock,
        on_outcome: Callable[[str, CallOutcome], None] | None = None,
    ) -> None:
        self.name = name
        self._body = body
        self._clock = clock
        self._on_outcome = on_outcome
        self._lock = threading.Lock()
        self._state = SourceState(
            name=name, interval_s=interval_s, deadline_s=deadline_s, now_mono=clock.monotonic()
        )
        self._outcomes: deque[CallOutcome] = deque()
        self._transitions: list[Transition] = []
        self.outcomes_dropped_total = 0
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def interval_s(self) -> float:
        return self._state.interval_s

    @property
    def deadline_s(self) -> float:
        return self._state.deadline_s

    # -- running ---------------------------------------------------------------------------

    def run_once(self) -> None:
        """Call the body now (in this thread) and keep its outcome for `take`."""
        with self._lock:
            self._state.begin(self._clock.monotonic())
        value: Any = None
        error: str | None = None
        try:
            value = self._body()
        except Exception as e:  # a failing body is an outcome, never the worker's end
            text = " ".join(f"{type(e).__name__}: {e}".split())
            error = text[:ERROR_MAX_CHARS]
        with self._lock:
            duration_s, late, transition = self._state.finish(
                self._clock.monotonic(), ok=error is None, now_unix=self._clock.now()
            )
            outcome = CallOutcome(value=value, error=error, duration_s=duration_s, late=late)
            if len(self._outcomes) >= MAX_PENDING_OUTCOMES:
                self._outcomes.popleft()
                self.outcomes_dropped_total += 1
            self._outcomes.append(outcome)
            if transition is not None:
                self._transitions.append(transition)
        self._first.set()
        if self._on_outcome is not None:
            self._on_outcome(self.name, outcome)

    def run_if_due(self) -> bool:
        """Inline mode: one call if one is due now; True when it ran."""
        with self._lock:
            due = self._state.due(self._clock.monotonic())
        if due:
            self.run_once()
        return due

    def start(self) -> None:
        """Start the worker thread (daemon: a call hung in a driver cannot hold up exit)."""
        self._thread = threading.Thread(target=self._work, name=f"source-{self.name}", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                wait_s = self._state.wait_s(self._clock.monotonic())
            if wait_s > 0:
                self._stop.wait(wait_s)
                continue
            try:
                self.run_once()
            except Exception:  # a bug in the bookkeeping must not end the source silently
                log.exception("event=source_worker_error source=%s", self.name)
                self._stop.wait(self._state.interval_s)

    def wait_first(self, timeout_s: float) -> bool:
        """Block until the first call returned (True) or `timeout_s` passed (False)."""
        return self._first.wait(timeout_s)

    def stop(self, *, timeout_s: float) -> bool:
        """Ask the worker to end; False when it is still inside a call after `timeout_s`
        (abandoned: the daemon thread stays in the call and no further call starts)."""
        self._stop.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- the collect loop's view -----------------------------------------------------------

    def take(self) -> TakeResult:
        """Outcomes and transitions since the last take, after checking the deadline."""
        with self._lock:
            transition = self._state.check(self._clock.monotonic())
            if transition is not None:
                self._transitions.append(transition)
            outcomes = tuple(self._outcomes)
            self._outcomes.clear()
            transitions = tuple(self._transitions)
            self._transitions.clear()
            return TakeResult(
                outcomes=outcomes,
                transitions=transitions,
                stale=self._state.stale,
                last_success_unix=self._state.last_success_unix,
            )
