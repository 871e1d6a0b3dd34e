"""`StepAgreement`: which step every rank acts at, on what (trainer/sync.py runs the collective).

It holds what this rank brings to an agreement: the requests received on its control socket
(oldest first, a `set_interval` with its new interval; ids already handled are dropped when
they come again), a SIGTERM seen, a
non-finite state seen since the last agreement, a commit refused as stale. And it keeps the
schedule: in a distributed job an agreement is posted at one step and collected `interval`
calls later, the interval adapting so that its cost stays under `_SYNC_BUDGET` of a step
within the reaction bound (docs/trainer.md, "Agreement"). Which calls collect depends only
on the step number, the call count and agreed values, so every rank collects at the same
step. Single process: the local view is the agreement, at every step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.protocol import Control
from trainguard.trainer.sync import REQUEST_ID_MAX_BYTES, Agreement, Coordinator, LocalView

__all__ = ["AgreementSettings", "StepAgreement"]

log = logging.getLogger("trainguard.trainer")

_HANDLED_IDS_MAX = 1024
# Adaptive agreement: its cost stays under 0.5 % of a step, unless that would break the
# reaction bound: stop, checkpoint requests, SIGTERM and NaN are acted on within
# max(2 steps, _REACTION_BOUND_S). An event waits at most 2 intervals (one for the next
# post, one for its collection), hence an interval of at most _REACTION_BOUND_S / 2 of
# steps, of which _REACTION_MARGIN is used: the step time is an average, and the steps of
# the next two intervals may be slower than it.
_SYNC_BUDGET = 0.005
_REACTION_BOUND_S = 1.0
_REACTION_MARGIN = 0.8
_CHECKPOINT_ACTIONS = ("checkpoint", "checkpoint_stop")


@dataclass(frozen=True)
class AgreementSettings:
    """How often ranks agree (the `Trainguard` argument of the same name)."""

    # Steps between agreements; None: adaptive within the reaction bound. A fixed N gives up
    # the time bound (an event waits up to 2N steps).
    sync_every: int | None = None

    def __post_init__(self) -> None:
        if self.sync_every is not None and self.sync_every < 1:
            raise ValueError(f"sync_every must be >= 1 or None (adaptive), got {self.sync_every}")


class StepAgreement:
    """Call `at_step()` at every step (the same steps on every rank); act on the agreement it
    returns, then `post()` the next one. `done()` retires a request acted upon; `drain()`
    collects a posted agreement nobody will act on (resume, close)."""

    def __init__(
        self,
        *,
        coordinator: Coordinator,
        settings: AgreementSettings,
        job: str,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.coord = coordinator
        self.settings = settings
        self.job = job
        self.clock = clock
        self.pending: list[tuple[str, str]] = []  # (action, request_id), oldest first
        self._values: dict[str, int] = {}  # request_id -> its value (set_interval's steps)
        self._handled: deque[str] = deque(maxlen=_HANDLED_IDS_MAX)
        self._sigterm = False
        self._nonfinite = False  # since the last view
        self._stale = False
        self._calls_to_sync = 0  # at_step() calls until the posted agreement is collected
        self._step_time_ema_s: float | None = None
        self._agree_cost_s = 0.0
        self._post_cost_s = 0.0

    # --- what this rank brings ------------------------------------------------------------

    def receive(self, controls: Iterable[Control]) -> None:
        """Take requests from the control socket: one for another job, or with an empty or
        over-long id, is logged and dropped; one already pending or handled is ignored."""
        for c in controls:
            if c.action == "rejoin":  # a rank's own place in a re-formed world: never agreed
                log.warning("event=control_rejected job=%s reason=rejoin_not_waited", self.job)
                continue
            if c.job and c.job != self.job:
                log.warning("event=control_rejected job=%s other_job=%s", self.job, c.job)
                continue
            if not c.request_id or len(c.request_id.encode()) > REQUEST_ID_MAX_BYTES:
                log.warning("event=control_rejected job=%s reason=bad_request_id", self.job)
                continue
            if c.request_id in self._handled or any(r[1] == c.request_id for r in self.pending):
                continue
            log.info(
                "event=control_received job=%s rank=%d action=%s request_id=%s",
                self.job,
                self.coord.rank,
                c.action,
                c.request_id,
            )
            self.pending.append((c.action, c.request_id))
            if c.every_steps is not None:
                self._values[c.request_id] = c.every_steps

    def note_sigterm(self) -> None:
        """This rank received SIGTERM (safe to call from a signal handler)."""
        self._sigterm = True

    def note_nonfinite(self) -> None:
        """This rank saw a non-finite state since the last agreement."""
        self._nonfinite = True

    def clear_nonfinite(self) -> None:
        """The state was replaced (rollback): what was seen came from the old one."""
        self._nonfinite = False

    def note_stale(self) -> None:
        """A commit of this rank was refused: a newer attempt owns the directory."""
        self._stale = True

    def done(self, request_id: str) -> None:
        """The request was acted upon (by every rank): it is never taken again."""
        self.pending = [r for r in self.pending if r[1] != request_id]
        self._values.pop(request_id, None)
        self._handled.append(request_id)

    def retry_first(self, action: str, request_id: str, *, value: int = 0) -> None:
        """Bring an agreed request (and its value) back, first in line, for the next
        agreement."""
        self.pending.insert(0, (action, request_id))
        if value:
            self._values[request_id] = value
        self._handled.remove(request_id)

    # --- the schedule ---------------------------------------------------------------------

    def at_step(self, step: int, *, step_time_s: float | None, periodic: bool) -> Agreement | None:
        """The agreement to act on at this step, or None between agreements.

        `periodic`: the step takes a periodic checkpoint (always collects). Distributed: the
        agreement posted `interval` calls ago is collected now (its all_reduce ran during the
        steps in between). A step that checkpoints (periodic, requested, SIGTERM) also agrees
        on the state at this very step, so no rank saves a non-finite state another rank saw
        a moment ago."""
        if step_time_s is not None:
            ema = self._step_time_ema_s
            self._step_time_ema_s = step_time_s if ema is None else 0.9 * ema + 0.1 * step_time_s
        if not self.coord.distributed:
            return self.coord.agree(self._view())
        self._calls_to_sync -= 1
        if not self.coord.in_flight:  # the first step, or after drain()
            return self.coord.agree(self._view())
        if self._calls_to_sync > 0 and not periodic:
            return None
        t0 = self.clock.monotonic()
        ag = self.coord.finish()
        self._agree_cost_s = self.clock.monotonic() - t0 + self._post_cost_s
        if periodic or ag.sigterm or ag.action in _CHECKPOINT_ACTIONS:
            now = self.coord.agree(self._view())
            ag = dataclasses.replace(
                ag, sigterm=ag.sigterm or now.sigterm, nonfinite=ag.nonfinite or now.nonfinite
            )
        return ag

    def post(self, interval: int) -> None:
        """Distributed: start the next agreement; it is collected `interval` calls later."""
        if not self.coord.distributed:
            return
        t0 = self.clock.monotonic()
        self.coord.start(self._view())
        self._post_cost_s = self.clock.monotonic() - t0
        self._calls_to_sync = interval

    def rebind(self, coordinator: Coordinator) -> None:
        """The world was re-formed (trainer/rejoin.py): agree on `coordinator` from now on. A
        posted agreement of the old world is forgotten; pending requests are kept."""
        self.coord = coordinator
        self._calls_to_sync = 0
        self._agree_cost_s = 0.0
        self._post_cost_s = 0.0

    def drain(self) -> None:
        """Collect a posted agreement nobody will act on (resume, close): every rank posted
        it at the same step, so every rank drains it."""
        if self.coord.in_flight:
            self.coord.finish()

    def _view(self) -> LocalView:
        """This rank's view for the next agreement; the non-finite flag restarts with it."""
        request = self.pending[0] if self.pending else None
        view = LocalView(
            request=request,
            value=self._values.get(request[1], 0) if request is not None else 0,
            sigterm=self._sigterm,
            nonfinite=self._nonfinite,
            interval=self._propose_interval(),
            max_interval=self._max_interval(),
            stale=self._stale,
        )
        self._nonfinite = False
        return view

    def _propose_interval(self) -> int:
        """Steps until the next agreement: fixed `sync_every`, or adaptive so that the
        agreement's measured cost stays under `_SYNC_BUDGET` of a step."""
        if self.settings.sync_every is not None:
            return self.settings.sync_every
        step_s = self._step_time_ema_s
        if not step_s or not self.coord.distributed:
            return 1
        return max(1, math.ceil(self._agree_cost_s / (_SYNC_BUDGET * step_s)))

    def _max_interval(self) -> int | None:
        """The reaction bound: an event waits at most two intervals, so an interval may span
        at most half of `_REACTION_BOUND_S` (with a margin; always one step). None with a
        fixed `sync_every`."""
        if self.settings.sync_every is not None:
            return None
        step_s = self._step_time_ema_s
        if not step_s:
            return 1
        return max(1, int(_REACTION_MARGIN * _REACTION_BOUND_S / 2 / step_s))
