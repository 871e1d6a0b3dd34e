"""`--wait`: follow what a command started until it is over, one progress line per step.

Each tracker reads one object (a node, a job) and says, from the answers so far, what
happened since (`lines`), whether it is over (`done`) or failed (`failure`); `wait_for` polls
the trackers in turn on the session's clock, within one timeout for all of them. A failure
or the timeout exits 1.

    drain NODE --wait       node/N draining, node/N drained
    restart JOB --wait      job/J restarting, spare in (a drained node swapped) or shrank,
                            restarted: attempt K, first step
    job submit FILE --wait  job/J started: attempt 1, first step
    checkpoint JOB --wait   job/J checkpoint committed at step S
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Protocol

from trainguard.controller.cli.client import quote_name
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.format import format_age
from trainguard.controller.cli.session import Session

__all__ = [
    "WAIT_DEFAULT_S",
    "add_wait_argument",
    "progress_stream",
    "wait_timeout_s",
    "WAIT_INTERVAL_S",
    "CheckpointTracker",
    "DrainTracker",
    "JobTracker",
    "Progress",
    "Tracker",
    "wait_for",
]

# how long `--wait` waits in all without `--timeout`
WAIT_DEFAULT_S = 600.0
# how often it reads the object again (less when the timeout is nearer)
WAIT_INTERVAL_S = 1.0


def add_wait_argument(parser: argparse.ArgumentParser, until: str) -> None:
    parser.add_argument(
        "--wait",
        action="store_true",
        help=f"wait {until}, a line per step; exit 1 if it fails or --timeout passes "
        f"(default {format_age(WAIT_DEFAULT_S)})",
    )


def wait_timeout_s(args: argparse.Namespace) -> float:
    """How long `--wait` waits in all: `--timeout`, else WAIT_DEFAULT_S."""
    return float(args.timeout) if args.timeout is not None else WAIT_DEFAULT_S


def progress_stream(s: Session, args: argparse.Namespace) -> IO[str]:
    """Where progress lines go: stdout under a table, stderr when stdout is for a program
    (json, yaml, name, jsonpath)."""
    return s.out if args.output in ("table", "wide") else s.err


@dataclass(frozen=True)
class Progress:
    lines: tuple[str, ...] = ()
    done: bool = False
    failure: str | None = None


class Tracker(Protocol):
    @property
    def path(self) -> str:
        """The API path of the object it reads."""

    @property
    def waiting_for(self) -> str:
        """What it waits for, for the timeout's message."""

    def observe(self, view: dict[str, Any]) -> Progress: ...


@dataclass
class DrainTracker:
    """A node until it is drained."""

    node: str
    _said: set[str] = field(default_factory=set)

    @property
    def path(self) -> str:
        return f"/v1/nodes/{quote_name(self.node)}"

    @property
    def waiting_for(self) -> str:
        return f"node/{self.node} to be drained"

    def observe(self, view: dict[str, Any]) -> Progress:
        state = view.get("state")
        if state == "drained":
            return Progress((f"node/{self.node} drained",), done=True)
        if state == "draining":
            if "draining" in self._said:
                return Progress()
            self._said.add("draining")
            job = view.get("job")
            why = f" (stopping job {job})" if job else ""
            return Progress((f"node/{self.node} draining{why}",))
        return Progress(failure=f"node/{self.node} is {state} again: the drain was undone")


@dataclass
class JobTracker:
    """A job until an attempt from `min_attempt` on trains (its first step), naming the
    steps on the way: a state it passes, nodes swapped in or out, the attempt starting."""

    job: str
    min_attempt: int
    verb: str = "restarted"  # "started" for a submit
    nodes: tuple[str, ...] | None = None  # the nodes before, to tell a spare in
    _state: str | None = None
    _started: bool = False

    @property
    def path(self) -> str:
        return f"/v1/jobs/{quote_name(self.job)}"

    @property
    def waiting_for(self) -> str:
        return f"job/{self.job} to train on attempt {self.min_attempt} or later"

    def observe(self, view: dict[str, Any]) -> Progress:
        lines: list[str] = []
        name = f"job/{self.job}"
        state = str(view.get("state"))
        attempt = int(view.get("attempt") or 0)
        reason = view.get("state_reason") or ""
        nodes = tuple(view.get("nodes") or ())
        if self.nodes is not None and nodes != self.nodes:
            lines.append(_swap_line(name, before=self.nodes, after=nodes))
        self.nodes = nodes
        new = attempt >= self.min_attempt
        if state == "failed":
            return Progress(tuple(lines), failure=f"{name} failed: {reason or 'no reason given'}")
        if state == "stopped":
            return Progress(tuple(lines), failure=f"{name} was stopped: {reason or 'on request'}")
        if state == "completed":
            return Progress((*lines, f"{name} completed"), done=True)
        if state != self._state and not (new and state in ("starting", "running")):
            lines.append(f"{name} {state}" + (f": {reason}" if reason else ""))
        self._state = state
        if new and state in ("starting", "running") and not self._started:
            self._started = True
            lines.append(f"{name} {self.verb}: attempt {attempt} on {','.join(nodes) or '-'}")
        if new and state == "running":
            step = view.get("last_step")
            where = f"step {step}" if step is not None else "its first step"
            lines.append(f"{name} first step: attempt {attempt} at {where}")
            return Progress(tuple(lines), done=True)
        return Progress(tuple(lines))


def _swap_line(name: str, *, before: Sequence[str], after: Sequence[str]) -> str:
    gone = [n for n in before if n not in after]
    came = [n for n in after if n not in before]
    if came:
        left = f" for {','.join(gone)}" if gone else ""
        return f"{name} spare in: {','.join(came)}{left}"
    return f"{name} shrank to {len(after)} node(s): without {','.join(gone)}"


@dataclass
class CheckpointTracker:
    """A job until a checkpoint newer than `before` commits; a save the trainer reports
    failed, or the job leaving running, is a failure."""

    job: str
    before: int | None
    failures_before: int

    @property
    def path(self) -> str:
        return f"/v1/jobs/{quote_name(self.job)}"

    @property
    def waiting_for(self) -> str:
        return f"a checkpoint of job/{self.job} newer than step {self.before}"

    def observe(self, view: dict[str, Any]) -> Progress:
        name = f"job/{self.job}"
        ckpt = view.get("ckpt_step")
        if isinstance(ckpt, int) and (self.before is None or ckpt > self.before):
            return Progress((f"{name} checkpoint committed at step {ckpt}",), done=True)
        failures = int(view.get("ckpt_failures") or 0)
        if failures > self.failures_before:
            return Progress(
                failure=f"{name}: the trainer reported the checkpoint failed "
                f"({failures} failed save(s) in a row)"
            )
        state = view.get("state")
        if state not in ("running", "starting"):
            return Progress(failure=f"{name} is {state}; no checkpoint will come")
        return Progress()


def wait_for(s: Session, trackers: Sequence[Tracker], *, timeout_s: float, out: IO[str]) -> None:
    """Poll each tracker until it is done, in order, writing its lines to `out`; raise
    CliError (exit 1) on a failure or when `timeout_s` passes."""
    deadline = s.clock.monotonic() + timeout_s
    for tracker in trackers:
        while True:
            progress = tracker.observe(s.api.request("GET", tracker.path))
            for line in progress.lines:
                out.write(line + "\n")
            out.flush()
            if progress.failure is not None:
                raise CliError(f"error: {progress.failure}", EXIT["error"])
            if progress.done:
                break
            left_s = deadline - s.clock.monotonic()
            if left_s <= 0:
                raise CliError(
                    f"error: timed out after {format_age(timeout_s)} waiting for "
                    f"{tracker.waiting_for}",
                    EXIT["error"],
                )
            s.clock.sleep(min(WAIT_INTERVAL_S, left_s))
