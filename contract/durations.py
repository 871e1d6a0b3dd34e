"""Durations as people type them on a command line: `30s`, `5m`, `2h`, `1d`, `1h30m`, or a
bare number of seconds (agentctl's flags, `trainguard-agent inject --for`)."""

from __future__ import annotations

import argparse
import math
import re

__all__ = ["duration_arg", "parse_duration"]

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


def duration_arg(text: str) -> float:
    """An argparse type: a duration (`30s`, `5m`, `1h30m`) or a bare number of seconds, more
    than zero and finite; anything else is a usage error naming the flag."""
    try:
        seconds = float(text)
    except ValueError:
        try:
            return parse_duration(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r} (more than 0, e.g. 10, 30s, 5m)"
        )
    return seconds
