"""The controller's own liveness, as its tick loop sees it: silence means the node, not the
controller (docs/controller.md, "The stall guard").

When the controller itself stalls (SIGSTOP, a VM migration, a long GC or a stuck disk), the
nodes go on reporting into a socket nobody reads, and at resumption every node looks silent
for as long as the controller was away. `StallGuard.beat` notes the start of each tick on the
monotonic clock; a gap since the previous tick's start past `threshold_s` (2 x tick_interval_s
+ STALL_MARGIN_S) is a stall. The tick then measures the ages of the nodes that were reporting
when it stalled (and of their ranks: heartbeat and step ages) from the resumption
(`LiveState.resume_ages`), so each has node_silent_after_s after it to report again before
any silence rule or step may call it silent. A node already silent before the stall keeps its
age: that evidence was gathered while the controller was alive.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STALL_MARGIN_S", "Stall", "StallGuard"]

# Beyond two tick intervals, the slack a busy but live tick loop may take (a slow evaluation,
# a store write) before its gap counts as a stall.
STALL_MARGIN_S = 1.0


@dataclass(frozen=True)
class Stall:
    """The controller did not tick for `gap_s` seconds; it last ticked at `last_tick_at`
    (wall clock)."""

    gap_s: float
    last_tick_at: float


class StallGuard:
    """Tells a stall from the tick loop's own clock. Pure: the caller passes both clocks."""

    def __init__(self, *, tick_interval_s: float, margin_s: float = STALL_MARGIN_S) -> None:
        self.threshold_s = 2.0 * tick_interval_s + margin_s
        self._last_mono: float | None = None
        self._last_at = 0.0

    def beat(self, *, monotonic: float, now: float) -> Stall | None:
        """A tick starts at `monotonic` (its wall time `now`): the stall it ends, if the gap
        since the previous tick's start is past the threshold. The first tick of a process
        ends none: a restart is the job of the restore holds and jobs.resume_grace_s."""
        last_mono, last_at = self._last_mono, self._last_at
        self._last_mono, self._last_at = monotonic, now
        if last_mono is None:
            return None
        gap_s = monotonic - last_mono
        if gap_s <= self.threshold_s:
            return None
        return Stall(gap_s=gap_s, last_tick_at=last_at)
