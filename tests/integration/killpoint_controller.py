"""The real trainguard-controller with one kill point of the in-process recovery path armed:
`python -m tests.integration.killpoint_controller POINT MARKER --config ...`. When the
restart step's thread reaches POINT it writes MARKER and parks there for good; the test,
seeing MARKER, kills the process with SIGKILL. The rest of the process (the API taking
reports, the tick) runs on meanwhile, as it would up to a crash at that instant.

The points, in the order the path reaches them (controller/actions/inprocess.py):
- before-decide: the restart step begun (the replace step done), nothing decided yet
- decided: the decision stored, no command queued
- mid-send: the lost node's stop_job queued, the rejoin and assign_standby not
- queued: every command queued, the `sent` phase not stored
- acked: every agent acknowledged, the job's attempt not yet begun
- attempt-begun: the job's attempt raised to the planned epoch, the step's state not stored
- before-done: every rank trains under the epoch, the step not yet done
- fallback-begun: a fallback raised the attempt to the planned epoch, the full restart's
  stop not yet queued
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.controller.actions.inprocess import InProcessRecovery
from trainguard.controller.jobs import JobManager
from trainguard.controller.livestate import LiveState
from trainguard.controller.main import main

POINTS = (
    "before-decide",
    "decided",
    "mid-send",
    "queued",
    "acked",
    "attempt-begun",
    "before-done",
    "fallback-begun",
)


def _park(marker: Path, point: str) -> None:
    marker.write_text(point)
    threading.Event().wait()  # until the SIGKILL


def _arm(owner: type, name: str, *, before: bool, when: Callable[..., bool], park: Any) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before and when(*args, **kwargs):
            park()
        result = original(*args, **kwargs)
        if not before and when(*args, **kwargs):
            park()
        return result

    setattr(owner, name, wrapper)


def arm(point: str, marker: Path) -> None:
    park = functools.partial(_park, marker, point)

    def always(*args: Any, **kwargs: Any) -> bool:
        return True

    def in_process_attempt(*args: Any, key: str, **kwargs: Any) -> bool:
        return key.endswith("/in-process")

    if point == "before-decide":
        _arm(InProcessRecovery, "_decide", before=True, when=always, park=park)
    elif point == "decided":
        _arm(InProcessRecovery, "_send", before=True, when=always, park=park)
    elif point == "mid-send":
        _arm(
            LiveState,
            "queue_command",
            before=False,
            when=lambda *a, command_id, **kw: command_id.startswith("inproc-stop-"),
            park=park,
        )
    elif point == "queued":
        _arm(InProcessRecovery, "_send", before=False, when=always, park=park)
    elif point == "acked":
        _arm(JobManager, "begin_attempt", before=True, when=in_process_attempt, park=park)
    elif point == "attempt-begun":
        _arm(JobManager, "begin_attempt", before=False, when=in_process_attempt, park=park)
    elif point == "before-done":
        _arm(InProcessRecovery, "_done", before=True, when=always, park=park)
    elif point == "fallback-begun":
        _arm(InProcessRecovery, "_fall_back", before=False, when=always, park=park)
    else:
        raise SystemExit(f"unknown kill point {point!r}; one of {', '.join(POINTS)}")


if __name__ == "__main__":
    arm(sys.argv[1], Path(sys.argv[2]))
    sys.exit(main(sys.argv[3:]))
