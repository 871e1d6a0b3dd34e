"""The warm standby pool of a spare node: keeps one standby process ready for the job it may
join (trainer/standby_child.py, run in the job's interpreter), hands it an assignment,
replaces it after use. An `assign_standby` command takes it (agent.inprocess); from then the
process is the job's rank on this node (agent.standby_ranks tracks it).

Pure core (`decide`: what to do now, from the pool's state, whether the node is a spare and
the time) and a thin edge (`StandbyPool`: runs the decision with a `Launcher`, which starts
and watches the process). The node is a spare by its `node.role_hint`; its report says
whether its standby is ready, and for which module (docs/agent.md, "Warm standbys").
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Protocol

from trainguard.agent.config import StandbyConfig
from trainguard.clock import SYSTEM_CLOCK, Clock

__all__ = [
    "Child",
    "Decision",
    "Launcher",
    "PoolState",
    "ProcessLauncher",
    "StandbyPool",
    "decide",
    "keeps_standby",
    "standby_argv",
]

log = logging.getLogger("trainguard.agent.standby")

LOG_TAIL_BYTES = 500  # of a dead standby's output, in the agent's log line


class Decision(Enum):
    NOTHING = "nothing"
    START = "start"
    STOP = "stop"


@dataclass(frozen=True)
class PoolState:
    running: bool  # a standby process is alive (ready or still importing)
    failures: int  # consecutive deaths before an assignment (reset when one becomes ready)
    last_exit_mono: float | None  # when the last standby died or was taken


def backoff_s(*, failures: int, config: StandbyConfig) -> float:
    """Wait before the next start after `failures` consecutive deaths (0: start now)."""
    if failures <= 0:
        return 0.0
    return min(config.restart_backoff_s * 2 ** (failures - 1), config.max_backoff_s)


def keeps_standby(
    *, said: bool | None, role_hint: str | None, running_jobs: frozenset[str]
) -> bool:
    """Whether the node keeps a warm standby: it is a spare (as the controller last `said`;
    before it said, the agent's `role_hint`) and runs no job's rank (once one runs here, its
    launch or the standby it took, an idle standby would only hold memory)."""
    spare = said if said is not None else role_hint == "spare"
    return spare and not running_jobs


def decide(*, state: PoolState, spare: bool, now_mono: float, config: StandbyConfig) -> Decision:
    """What the pool does now: keep one standby while the node is a spare, none otherwise."""
    wanted = config.enabled and spare and config.max_standbys > 0
    if not wanted:
        return Decision.STOP if state.running else Decision.NOTHING
    if state.running:
        return Decision.NOTHING
    wait_s = backoff_s(failures=state.failures, config=config)
    if state.last_exit_mono is not None and now_mono - state.last_exit_mono < wait_s:
        return Decision.NOTHING
    return Decision.START


def standby_argv(config: StandbyConfig, *, ready_file: str) -> list[str]:
    python = config.python or sys.executable
    return [
        python, "-m", "trainguard.trainer.standby_child", "--ready-file", ready_file,
        config.module, *config.args,
    ]  # fmt: skip


class Child(Protocol):
    """A standby process handed its assignment (a `subprocess.Popen` in production)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...


class Launcher(Protocol):
    """Starts and watches one standby process (the fake in the tests records calls)."""

    def start(self, config: StandbyConfig) -> None: ...

    def alive(self) -> bool: ...

    def ready(self) -> bool: ...

    def assign(self, membership_json: str) -> Child: ...

    def stop(self) -> None: ...

    def output_tail(self) -> str: ...


class ProcessLauncher:
    """The real edge: a subprocess (argument list, no shell), CUDA hidden until assigned,
    its output in a file truncated at each start (bounded), readiness as a file it writes."""

    def __init__(self, *, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def ready_file(self) -> Path:
        return self.work_dir / "standby.ready"

    @property
    def log_file(self) -> Path:
        return self.work_dir / "standby.log"

    def start(self, config: StandbyConfig) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.ready_file.unlink(missing_ok=True)
        # no GPU before the assignment: the child cannot initialise CUDA on any device
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        with open(self.log_file, "wb") as out:
            self.proc = subprocess.Popen(
                standby_argv(config, ready_file=str(self.ready_file)),
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=config.cwd or None,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ready(self) -> bool:
        return self.alive() and self.ready_file.exists()

    def assign(self, membership_json: str) -> Child:
        """Hand the standby its assignment line (trainer.standby_child: a membership, with
        the job's environment); it leaves the pool (the job's process now)."""
        proc = self.proc
        if proc is None or proc.stdin is None:
            raise RuntimeError("no standby to assign")
        # CUDA_VISIBLE_DEVICES of the job is the job's to set from here (the child runs the
        # entry module in the same process, which sees the membership in its environment)
        proc.stdin.write(membership_json.encode() + b"\n")
        proc.stdin.flush()
        proc.stdin.close()
        self.proc = None
        self.ready_file.unlink(missing_ok=True)
        return proc

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()  # an idle standby exits on EOF
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)
        self.ready_file.unlink(missing_ok=True)

    def output_tail(self) -> str:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - LOG_TAIL_BYTES))
                return " ".join(f.read().decode(errors="replace").split())
        except OSError:
            return ""


class StandbyPool:
    """Runs `decide` each tick and keeps the figures /metrics shows."""

    def __init__(
        self, *, config: StandbyConfig, launcher: Launcher, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.config = config
        self.launcher = launcher
        self.clock = clock
        self.started_total = 0
        self.ready_s: float | None = None  # start -> ready of the newest ready standby
        self._running = False
        self._ready = False
        self._started_mono = 0.0
        self._failures = 0
        self._last_exit_mono: float | None = None

    @property
    def is_ready(self) -> bool:
        return self._running and self._ready

    def tick(self, *, spare: bool) -> Decision:
        now = self.clock.monotonic()  # read once per tick
        if self._running:
            self._watch(now)
        state = PoolState(self._running, self._failures, self._last_exit_mono)
        decision = decide(state=state, spare=spare, now_mono=now, config=self.config)
        if decision is Decision.START:
            try:
                self.launcher.start(self.config)
            except OSError as e:  # a missing interpreter or cwd: retried with the backoff
                self._failures += 1
                self._last_exit_mono = now
                log.warning("event=standby_start_failed error=%s", json.dumps(str(e)[:300]))
                return decision
            self._running, self._ready, self._started_mono = True, False, now
            self.started_total += 1
            log.info("event=standby_started module=%s", self.config.module)
        elif decision is Decision.STOP:
            self.close(reason="node is not a spare")
        return decision

    def _watch(self, now: float) -> None:
        if not self.launcher.alive():
            self._running = self._ready = False
            self._failures += 1
            self._last_exit_mono = now
            log.warning(
                "event=standby_died failures=%d next_start_in_s=%.1f output=%s",
                self._failures,
                backoff_s(failures=self._failures, config=self.config),
                json.dumps(self.launcher.output_tail()),
            )
            return
        if not self._ready and self.launcher.ready():
            self._ready = True
            self._failures = 0
            self.ready_s = now - self._started_mono
            log.info("event=standby_ready ready_s=%.2f", self.ready_s)
        elif not self._ready and now - self._started_mono > self.config.ready_timeout_s:
            log.warning("event=standby_not_ready timeout_s=%.0f", self.config.ready_timeout_s)
            self.launcher.stop()
            self._running = False
            self._failures += 1
            self._last_exit_mono = now

    def take(self, membership_json: str) -> Child | None:
        """Hand the ready standby its assignment; returns the process (None: none is ready).
        The next tick starts its replacement."""
        if not self.is_ready:
            return None
        child = self.launcher.assign(membership_json)
        self._running = self._ready = False
        self._last_exit_mono = None  # replaced at once, no backoff
        log.info("event=standby_taken pid=%d", child.pid)
        return child

    def close(self, *, reason: str = "agent stopping") -> None:
        if self._running:
            self.launcher.stop()
            log.info("event=standby_stopped reason=%s", json.dumps(reason))
        self._running = self._ready = False
