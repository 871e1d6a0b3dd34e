"""`Series`: the bounded change history of one numeric signal, which windowed functions (`rate`,
`increase`, `changes`, `*_over_time`) and `age()` read.

History is stored on change only: a series is created the first time a tracked value changes,
and a new point is appended at most every `min_spacing_s` (changes in between are merged into
the last point, which keeps cumulative increase and change counts exact). A series therefore
holds at most `history_s / min_spacing_s + 2` points, and a value that never changes costs
nothing beyond the latest sample.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["Series"]


class Series:
    """Bounded change history of one numeric signal.

    Each point is [t_first, t_last, value, acc, changes, hi, lo]: the value at t_last, `acc` the
    cumulative increase since the series began (a decrease counts as a counter reset, as in
    Prometheus), `changes` the cumulative number of value changes, hi/lo the extremes merged
    into the point.
    """

    __slots__ = ("points",)

    def __init__(self, t: float, value: float) -> None:
        self.points: deque[list[float]] = deque([[t, t, value, 0.0, 0.0, value, value]])

    @property
    def value(self) -> float:
        return self.points[-1][2]

    @property
    def last_change_t(self) -> float:
        return self.points[-1][1]

    def update(self, t: float, value: float, *, min_spacing_s: float, horizon_s: float) -> None:
        pts = self.points
        last = pts[-1]
        prev = last[2]
        if value == prev or (math.isnan(value) and math.isnan(prev)):  # NaN: unchanged
            return
        acc = last[3]
        if math.isfinite(value) and math.isfinite(prev):
            acc += value - prev if value >= prev else value
        changes = last[4] + 1
        # Never merge into the first point: it is the baseline older windows are measured from.
        if len(pts) > 1 and t - last[0] < min_spacing_s:
            last[1] = t
            last[2] = value
            last[3] = acc
            last[4] = changes
            last[5] = max(last[5], value)
            last[6] = min(last[6], value)
            return
        pts.append([t, t, value, acc, changes, value, value])
        cutoff = t - horizon_s
        while len(pts) > 2 and pts[1][1] <= cutoff:
            pts.popleft()

    def forget_history(self) -> None:
        """Keep only the current value, as of its last change: every window from now on
        measures from it (no increase, no change, the value as its only extreme)."""
        last = self.points[-1]
        value = last[2]
        self.points = deque([[last[0], last[1], value, 0.0, 0.0, value, value]])

    def _base(self, start: float) -> list[float]:
        """The point in effect at time `start` (or the first point if the series began later)."""
        pts = self.points
        for i in range(len(pts) - 1, -1, -1):
            if pts[i][1] <= start:
                return pts[i]
        return pts[0]

    def increase(self, now: float, window_s: float) -> float:
        return self.points[-1][3] - self._base(now - window_s)[3]

    def changes(self, now: float, window_s: float) -> float:
        return self.points[-1][4] - self._base(now - window_s)[4]

    def extreme(self, now: float, window_s: float, *, highest: bool) -> float:
        start = now - window_s
        base = self._base(start)
        best = base[2]
        for p in self.points:
            if p[1] > start and p is not base:
                v = p[5] if highest else p[6]
                best = max(best, v) if highest else min(best, v)
        return best

    def __len__(self) -> int:
        return len(self.points)
