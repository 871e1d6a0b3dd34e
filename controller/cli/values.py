"""Flag values agentctl parses itself: durations like `30s`, `5m`."""

from __future__ import annotations

import re

__all__ = ["parse_duration"]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """ "90s", "30m", "2h", "1d", "1h30m" -> seconds; raises ValueError."""
    t = text.strip()
    if not t:
        raise ValueError("empty duration")
    pos = 0
    total = 0.0
    for m in _DURATION.finditer(t):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if pos != len(t) or total <= 0:
        raise ValueError(f"invalid duration {text!r} (use e.g. 90s, 30m, 2h, 1d, 1h30m)")
    return total
