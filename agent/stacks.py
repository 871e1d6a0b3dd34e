"""`collect_stacks`: dump the Python stacks of a job's local ranks into the command result.

The trainer library registers `faulthandler` on SIGUSR1 (all threads, to stderr), and a job
launched by this agent writes its stderr into the job log. So: send SIGUSR1 to one rank at a
time, wait (bounded) until the log shows that rank's dump and stops growing, and return the
new log text. A pid only gets the signal when it belongs to the job's current launch (found
in /proc, so a stale heartbeat pid never signals a stranger) and has a SIGUSR1 handler
installed (SIGUSR1's default action would kill the rank).
"""

from __future__ import annotations

import logging
import os
import re
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainguard.agent.commands import CommandResult, Handler
from trainguard.clock import Clock
from trainguard.command_args import CollectStacksArgs, decode_args
from trainguard.protocol import Command, CommandKind, RankState

__all__ = [
    "DUMP_MARKERS",
    "StackSource",
    "collect_stacks",
    "dump_lines",
    "handles_signal",
    "stacks_handler",
]

log = logging.getLogger("trainguard.agent.stacks")

# What faulthandler writes: thread headers ("Current thread 0x... (most recent call first):",
# "Thread 0x...", "Stack (...)" without all_threads) and frame lines ('  File "x.py", line 3
# in f', "  <no Python frame>", "  ..." when cut). The job log also carries the ranks' own
# output, written meanwhile: only these lines are kept.
DUMP_MARKERS = (b"Current thread 0x", b"Thread 0x", b"Stack (most recent call first):")
_HEADER = re.compile(r"^(Current thread 0x[0-9a-fA-F]+|Thread 0x[0-9a-fA-F]+|Stack) \(most recent")
_FRAME = re.compile(r'^  (File ".*", line \d+ in \S.*|<no Python frame>|\.\.\.)$')
POLL_S = 0.05
# The dump is written by the signal handler in one go: once no dump line has been added for
# this long after the first appeared, the rank's dump is complete.
SETTLE_S = 0.15


class StackSource(Protocol):
    """What collect_stacks needs from the job backend (agent.jobs.JobRunner has it)."""

    def launch_processes(self, job: str) -> set[int]: ...

    def log_path(self, job: str) -> Path | None: ...


def handles_signal(pid: int, sig: int, *, proc_root: str = "/proc") -> bool:
    """Whether process `pid` has a handler installed for `sig` (SigCgt in its status)."""
    try:
        with open(os.path.join(proc_root, str(pid), "status"), encoding="ascii") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


@dataclass
class _RankOutcome:
    rank: int
    pid: int
    status: str  # "dumped", "no_dump", "not_in_launch", "no_handler", "gone"
    text: str = ""


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(limit)
    except OSError:
        return b""


def dump_lines(raw: bytes) -> str:
    """The faulthandler lines of `raw` (other output dropped), a blank line between threads."""
    out: list[str] = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        if _HEADER.match(line):
            if out:
                out.append("")
            out.append(line)
        elif _FRAME.match(line) and out:
            out.append(line)
    return "\n".join(out) + ("\n" if out else "")


def _wait_for_dump(
    path: Path, offset: int, *, deadline_mono: float, clock: Clock, read_limit: int
) -> str | None:
    """The dump written to the log after `offset`, once it stopped growing; None when no
    dump appeared before the deadline."""
    seen = ""
    stable_since = 0.0
    while True:
        now = clock.monotonic()
        new = _read_from(path, offset, read_limit) if _file_size(path) > offset else b""
        text = dump_lines(new) if any(m in new for m in DUMP_MARKERS) else ""
        if text:
            if text != seen:
                seen, stable_since = text, now
            elif now - stable_since >= SETTLE_S:
                return text
        if now >= deadline_mono:
            return seen or None  # a dump still growing at the deadline: what is there
        clock.sleep(POLL_S)


def _bounded(text: str, limit_chars: int) -> str:
    """Keep the end of a dump: faulthandler lists the main thread last."""
    if len(text) <= limit_chars:
        return text
    cut = len(text) - limit_chars
    return f"[... {cut} chars cut ...]\n" + text[cut:]


def collect_stacks(
    *,
    job: str,
    ranks: Sequence[RankState],
    source: StackSource,
    clock: Clock,
    timeout_s: float,
    max_bytes: int,
    send_signal: Callable[[int, int], None] = os.kill,
    proc_root: str = "/proc",
) -> CommandResult:
    """Dump every local rank of `job`, one after the other, within `timeout_s` in total."""
    mine = sorted((r for r in ranks if r.job == job and r.pid > 0), key=lambda r: r.rank)
    log_path = source.log_path(job)
    launch = source.launch_processes(job)
    if log_path is None or not launch:
        return CommandResult(
            ok=False,
            message=f"job {job!r} is not running under this agent; its rank pids cannot be "
            "verified and its output is not captured",
            data={"job": job},
        )
    if not mine:
        return CommandResult(
            ok=False, message=f"no rank of job {job!r} heartbeats on this node", data={"job": job}
        )
    deadline = clock.monotonic() + timeout_s
    outcomes: list[_RankOutcome] = []
    for r in mine:
        if r.pid not in launch:
            # a heartbeat pid outside the launch: stale (recycled) or another program's
            outcomes.append(_RankOutcome(r.rank, r.pid, "not_in_launch"))
            continue
        if not handles_signal(r.pid, signal.SIGUSR1, proc_root=proc_root):
            outcomes.append(_RankOutcome(r.rank, r.pid, "no_handler"))
            continue
        offset = _file_size(log_path)
        try:
            send_signal(r.pid, signal.SIGUSR1)
        except (ProcessLookupError, PermissionError):
            outcomes.append(_RankOutcome(r.rank, r.pid, "gone"))
            continue
        new = _wait_for_dump(
            log_path, offset, deadline_mono=deadline, clock=clock, read_limit=4 * max_bytes
        )
        if new is None:
            outcomes.append(_RankOutcome(r.rank, r.pid, "no_dump"))
        else:
            outcomes.append(_RankOutcome(r.rank, r.pid, "dumped", new))
    dumped = [o for o in outcomes if o.status == "dumped"]
    per_rank = max(256, max_bytes // max(1, len(dumped)) - 64)
    parts = [f"--- rank {o.rank} pid {o.pid} ---\n{_bounded(o.text, per_rank)}" for o in dumped]
    stacks = "\n".join(parts)
    if len(stacks.encode()) > max_bytes:  # multi-byte text: cut on bytes, last resort
        stacks = stacks.encode()[:max_bytes].decode("utf-8", errors="ignore")
    data: dict[str, Any] = {
        "job": job,
        "ranks": [{"rank": o.rank, "pid": o.pid, "status": o.status} for o in outcomes],
        "stacks": stacks,
        "log_path": str(log_path),
    }
    skipped = [f"rank {o.rank}: {o.status}" for o in outcomes if o.status != "dumped"]
    message = f"stacks of {len(dumped)} of {len(outcomes)} rank(s)"
    if skipped:
        message += " (" + ", ".join(skipped) + ")"
    log.info(
        "event=stacks_collected job=%s ranks=%d dumped=%d skipped=%s",
        job,
        len(outcomes),
        len(dumped),
        ",".join(s.replace(" ", "") for s in skipped) or "-",
    )
    return CommandResult(ok=len(dumped) == len(outcomes), message=message, data=data)


def stacks_handler(
    *,
    source: StackSource,
    ranks: Callable[[], Sequence[RankState]],
    clock: Clock,
    timeout_s: float,
    max_bytes: int,
) -> dict[str, Handler]:
    """The `collect_stacks` handler (args: job) for CommandExecutor.register."""

    def handle(cmd: Command) -> CommandResult:
        job = decode_args(CollectStacksArgs, cmd.args).job
        return collect_stacks(
            job=job,
            ranks=ranks(),
            source=source,
            clock=clock,
            timeout_s=timeout_s,
            max_bytes=max_bytes,
        )

    return {CommandKind.COLLECT_STACKS: handle}
