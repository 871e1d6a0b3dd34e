"""The restart step's phases (controller.actions.jobsteps.RestartHandler) and the moves
between them.

    stop -> start -> confirm -> done

stop: stop_job sent to the old attempt; waiting until it stopped or its nodes' lease ran out.
start: attempt+1 may begin (never stored: a step whose key already began the attempt, after a
controller restart, starts here). confirm: start_job sent; waiting for a step past the
checkpoint. done: the new attempt trains. The step's progress keeps the member's value under
"phase" (absent: stop), the strings every earlier version stored, so a step written before an
upgrade resumes where it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Any


class RestartPhase(str, Enum):
    STOP = "stop"
    START = "start"
    CONFIRM = "confirm"
    DONE = "done"

    @classmethod
    def stored(cls, progress: Mapping[str, Any]) -> RestartPhase:
        """The phase a step's saved progress is in (a new step's empty progress: stop)."""
        raw = progress.get("phase", cls.STOP.value)
        try:
            return cls(raw)
        except ValueError:
            raise ValueError(f"restart progress has an unknown phase {raw!r}") from None


NEXT: dict[RestartPhase, RestartPhase | None] = {
    RestartPhase.STOP: RestartPhase.START,
    RestartPhase.START: RestartPhase.CONFIRM,
    RestartPhase.CONFIRM: RestartPhase.DONE,
    RestartPhase.DONE: None,
}


def advance(current: RestartPhase, wanted: RestartPhase) -> RestartPhase:
    """`wanted` when it follows `current` in NEXT; ValueError otherwise."""
    if NEXT[current] is not wanted:
        raise ValueError(f"restart phase cannot go from {current.value} to {wanted.value}")
    return wanted


__all__ = ["NEXT", "RestartPhase", "advance"]
