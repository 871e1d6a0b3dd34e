"""`NanGuard`: what counts as a non-finite training state, and what the job does about it.

A step is bad when its loss or grad norm is NaN/Inf, or (optionally) its grad norm spikes
past a factor of the median of the recent finite ones. The guard reports each (`nan_loss`,
`grad_norm_spike` events; log lines rate-limited), and once every rank agreed that some rank
saw one, its policy says what follows: `continue` (report only), `stop`, or `rollback` to
the newest good checkpoint (which the caller carries out; `rolled_back()` records it).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.kinds import TrainerEdge

__all__ = ["NAN_POLICIES", "NanGuard", "NanPolicy", "NanSettings"]

log = logging.getLogger("trainguard.trainer")

NanPolicy = Literal["continue", "stop", "rollback"]
NAN_POLICIES: tuple[NanPolicy, ...] = ("continue", "stop", "rollback")
# nan_policy="continue" can see a non-finite loss at every step: one log line per rank at the
# first, then at most one per this many seconds, with the count of those not logged.
_NAN_LOG_EVERY_S = 60.0
# A spike is judged against the median of at least this many finite grad norms.
_SPIKE_MIN_NORMS = 5


@dataclass(frozen=True)
class NanSettings:
    """The NaN policy (the `Trainguard` arguments of the same names)."""

    nan_policy: NanPolicy = "continue"
    # With "rollback": batches the data position moves past the restored checkpoint's.
    skip_batches: int = 0
    # A grad norm above factor x the median of the last `grad_spike_window` finite norms
    # counts as non-finite; None: off.
    grad_spike_factor: float | None = None
    grad_spike_window: int = 50

    def __post_init__(self) -> None:
        if self.nan_policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {NAN_POLICIES}, got {self.nan_policy!r}")
        if self.skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {self.skip_batches}")
        if self.skip_batches and self.nan_policy != "rollback":
            raise ValueError("skip_batches only applies to nan_policy='rollback'")
        if self.grad_spike_factor is not None and self.grad_spike_factor <= 1.0:
            raise ValueError(f"grad_spike_factor must exceed 1.0, got {self.grad_spike_factor}")


class NanGuard:
    """`check()` once per step on this rank's values; `action()` on what every rank agreed.
    Events go to `emit(name, data)` (a heartbeat's edge events)."""

    def __init__(
        self,
        *,
        settings: NanSettings,
        job: str,
        rank: int,
        emit: Callable[[str, dict[str, Any]], None] = lambda name, data: None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        self.job = job
        self.rank = rank
        self.clock = clock
        self._emit = emit
        self._grad_norms: deque[float] = deque(maxlen=max(5, settings.grad_spike_window))
        self._logged_at: float | None = None
        self._not_logged = 0

    @property
    def policy(self) -> NanPolicy:
        return self.settings.nan_policy

    def check(self, step: int, *, loss: float | None, grad_norm: float | None) -> bool:
        """True when this step's state is bad (non-finite, or a grad-norm spike)."""
        if (loss is not None and not math.isfinite(loss)) or (
            grad_norm is not None and not math.isfinite(grad_norm)
        ):
            self._emit(TrainerEdge.NAN_LOSS, {"step": step, "loss": loss, "grad_norm": grad_norm})
            self._log_nonfinite(step, loss, grad_norm)
            return True
        factor = self.settings.grad_spike_factor
        if grad_norm is None or factor is None:
            return False
        if len(self._grad_norms) >= _SPIKE_MIN_NORMS:
            median = statistics.median(self._grad_norms)
            if median > 0 and grad_norm > factor * median:
                self._emit(
                    TrainerEdge.GRAD_NORM_SPIKE,
                    {"step": step, "grad_norm": grad_norm, "median": median},
                )
                log.error(
                    "event=grad_norm_spike job=%s rank=%d step=%d grad_norm=%r median=%r",
                    self.job,
                    self.rank,
                    step,
                    grad_norm,
                    median,
                )
                return True
        self._grad_norms.append(grad_norm)
        return False

    def action(self, *, nonfinite: bool) -> NanPolicy:
        """What to do at an agreement: "continue" when no rank saw a bad state, else the
        policy."""
        return self.settings.nan_policy if nonfinite else "continue"

    def rolled_back(self, *, step: int, to_step: int) -> None:
        """The state was restored to `to_step`'s at `step`: the norms seen since are forgotten."""
        self._grad_norms.clear()
        log.warning(
            "event=nan_rollback job=%s rank=%d step=%d to_step=%d skip_batches=%d",
            self.job,
            self.rank,
            step,
            to_step,
            self.settings.skip_batches,
        )
        self._emit(
            TrainerEdge.NAN_ROLLBACK,
            {"step": step, "to_step": to_step, "skip_batches": self.settings.skip_batches},
        )

    def _log_nonfinite(self, step: int, loss: float | None, grad_norm: float | None) -> None:
        now = self.clock.monotonic()
        if self._logged_at is not None and now - self._logged_at < _NAN_LOG_EVERY_S:
            self._not_logged += 1
            return
        log.error(
            "event=nan_loss job=%s rank=%d step=%d loss=%r grad_norm=%r policy=%s "
            "not_logged_since_last=%d",
            self.job,
            self.rank,
            step,
            loss,
            grad_norm,
            self.settings.nan_policy,
            self._not_logged,
        )
        self._logged_at = now
        self._not_logged = 0
