"""Flag values agentctl parses itself (argparse types: a bad value is a usage error naming the
flag, exit 2): counts and label selectors. Durations: trainguard.faultflags.duration_arg."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Requirement",
    "positive_int",
    "selected",
    "selector",
]


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r} (a whole number)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


@dataclass(frozen=True)
class Requirement:
    """One term of a label selector: `key=value` (or `==`), `key!=value`."""

    key: str
    value: str
    equal: bool = True

    def matches(self, labels: Mapping[str, Any]) -> bool:
        return (labels.get(self.key) == self.value) == self.equal


_SELECTOR_TERM = re.compile(r"([A-Za-z0-9][A-Za-z0-9._/-]*)\s*(==|!=|=)\s*([A-Za-z0-9._-]*)")


def selector(text: str) -> tuple[Requirement, ...]:
    """An argparse type: a label selector, `key=value[,key2!=value2]`."""
    terms = []
    for part in text.split(","):
        m = _SELECTOR_TERM.fullmatch(part.strip())
        if m is None:
            raise argparse.ArgumentTypeError(
                f"invalid selector term {part.strip()!r} (use key=value or key!=value, "
                "comma-separated)"
            )
        terms.append(Requirement(m.group(1), m.group(3), equal=m.group(2) != "!="))
    return tuple(terms)


def selected(labels: Mapping[str, Any], requirements: Sequence[Requirement]) -> bool:
    """Whether `labels` match every requirement of a selector."""
    return all(r.matches(labels) for r in requirements)
