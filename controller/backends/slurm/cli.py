"""Slurm's client commands as the controller calls them: every call an argument list with a
timeout (never a shell string), a failure raised with Slurm's own message; and the pure
parsers of what they print (`sinfo --json`, `squeue --json`, `scontrol show reservation`,
host lists such as `n[1,3-4]`).

Slurm 22.05: `sinfo --json` and `squeue --json` exist, `scontrol --json` does not, and there
is no `sacct` without slurmdbd, so nothing here needs either.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trainguard.controller.hostlist import expand_hostlist

log = logging.getLogger("trainguard.controller.slurm")

# Messages that mean slurmctld could not be reached or answered too late: worth a retry.
_TRANSIENT = (
    "unable to contact slurm controller",
    "socket timed out",
    "connection refused",
    "zero bytes were transmitted",
    "slurm_receive_msg",
    "no answer within",
)


class SlurmError(Exception):
    """A Slurm command failed; `str(e)` is the command and Slurm's own message."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class SlurmRunner(Protocol):
    """Runs one Slurm client command (argv[0] is its name: scontrol, squeue, ...)."""

    def run(self, argv: Sequence[str]) -> str:
        """Its stdout; raises SlurmError."""


class SlurmCli:
    """The real runner: subprocess, an argument list, a timeout, SLURM_CONF when given."""

    def __init__(self, *, bin_dir: str = "", slurm_conf: str = "", timeout_s: float = 20.0):
        self._bin_dir = bin_dir
        self._timeout_s = timeout_s
        self._env = dict(os.environ)
        if slurm_conf:
            self._env["SLURM_CONF"] = slurm_conf

    def _exe(self, name: str) -> str:
        if self._bin_dir:
            return os.path.join(self._bin_dir, name)
        return shutil.which(name) or name

    def run(self, argv: Sequence[str]) -> str:
        args = [self._exe(argv[0]), *argv[1:]]
        what = " ".join(argv[:3])
        try:
            done = subprocess.run(
                args,
                capture_output=True,
                text=True,
                env=self._env,
                timeout=self._timeout_s,
                check=False,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise SlurmError(
                f"{what}: no answer within {self._timeout_s:g} s", transient=True
            ) from None
        except OSError as e:
            raise SlurmError(
                f"{what}: cannot run {args[0]}: {e.strerror or e}", transient=False
            ) from None
        if done.returncode != 0:
            text = (done.stderr.strip() or done.stdout.strip() or f"exit {done.returncode}")[:500]
            low = text.lower()
            raise SlurmError(f"{what}: {text}", transient=any(t in low for t in _TRANSIENT))
        return done.stdout


class RecordingRunner:
    """Test double: records every argv; answers from `answers` (first matching argv prefix:
    a string is the stdout, a SlurmError is raised)."""

    def __init__(self, answers: dict[tuple[str, ...], str | SlurmError] | None = None) -> None:
        self.answers = dict(answers or {})
        self.calls: list[tuple[str, ...]] = []
        self._lock = threading.Lock()

    def run(self, argv: Sequence[str]) -> str:
        call = tuple(argv)
        with self._lock:
            self.calls.append(call)
        for prefix in sorted(self.answers, key=len, reverse=True):
            if call[: len(prefix)] == prefix:
                answer = self.answers[prefix]
                if isinstance(answer, SlurmError):
                    raise answer
                return answer
        return ""


# --- what the commands print ----------------------------------------------------------------


@dataclass(frozen=True)
class SlurmNode:
    """One node as `sinfo --json` shows it."""

    name: str
    state: str  # base state, lower case: idle, allocated, mixed, down, completing, ...
    flags: frozenset[str]  # DRAIN, COMPLETING, NOT_RESPONDING, RESERVED, ...
    reason: str = ""
    reason_user: str = ""

    @property
    def drain(self) -> bool:
        return "DRAIN" in self.flags

    @property
    def down(self) -> bool:
        return self.state == "down"

    @property
    def busy(self) -> bool:
        """Slurm still runs (or is cleaning up) job processes on it."""
        return self.state in ("allocated", "mixed", "completing") or "COMPLETING" in self.flags

    @property
    def usable(self) -> bool:
        return not (self.drain or self.down or "NOT_RESPONDING" in self.flags)


@dataclass(frozen=True)
class SlurmJob:
    """One job as `squeue --json` shows it."""

    id: str
    name: str
    state: str  # RUNNING, PENDING, COMPLETING, FAILED, ...
    nodes: tuple[str, ...]  # the allocation (empty while pending)
    restart_cnt: int = 0
    requeue: bool = False
    state_reason: str = ""
    required_nodes: tuple[str, ...] = ()
    node_count: int = 0
    start_time: float = 0.0
    user: str = ""
    comment: str = ""  # trainguard writes why it held the job here (the restart-loop breaker)

    @property
    def held(self) -> bool:
        """Pending and held (by an admin, trainguard, or its user)."""
        return self.state == "PENDING" and self.state_reason.startswith("JobHeld")

    @property
    def active(self) -> bool:
        return self.state in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED")

    @property
    def finished(self) -> bool:
        return self.state in (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "OUT_OF_MEMORY",
            "BOOT_FAIL",
            "DEADLINE",
            "PREEMPTED",
        )


def _doc(text: str, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SlurmError(f"{what}: not JSON ({e})", transient=False) from None
    if not isinstance(doc, dict):
        raise SlurmError(f"{what}: not a JSON object", transient=False)
    errors = [e for e in doc.get("errors") or [] if e]
    if errors:
        raise SlurmError(f"{what}: {errors[0]}", transient=False)
    return doc


def parse_sinfo(text: str) -> dict[str, SlurmNode]:
    """`sinfo --json` -> nodes by name."""
    out: dict[str, SlurmNode] = {}
    for n in _doc(text, "sinfo --json").get("nodes") or []:
        state = n.get("state")
        base = str(state[0] if isinstance(state, list) and state else state or "").lower()
        flags = {str(f).upper() for f in n.get("state_flags") or []}
        if isinstance(state, list):
            flags |= {str(f).upper() for f in state[1:]}
        out[str(n["name"])] = SlurmNode(
            name=str(n["name"]),
            state=base,
            flags=frozenset(flags),
            reason=str(n.get("reason") or ""),
            reason_user=str(n.get("reason_set_by_user") or ""),
        )
    return out


def parse_squeue(text: str) -> dict[str, SlurmJob]:
    """`squeue --json` -> jobs by id."""
    out: dict[str, SlurmJob] = {}
    for j in _doc(text, "squeue --json").get("jobs") or []:
        job_id = str(j["job_id"])
        out[job_id] = SlurmJob(
            id=job_id,
            name=str(j.get("name") or ""),
            state=str(j.get("job_state") or "").upper(),
            nodes=tuple(expand_hostlist(str(j.get("nodes") or ""))),
            restart_cnt=int(j.get("restart_cnt") or 0),
            requeue=bool(j.get("requeue")),
            state_reason=str(j.get("state_reason") or ""),
            required_nodes=tuple(expand_hostlist(str(j.get("required_nodes") or ""))),
            node_count=int(j.get("node_count") or 0),
            start_time=float(j.get("start_time") or 0),
            user=str(j.get("user_name") or ""),
            comment=str(j.get("comment") or ""),
        )
    return out


def parse_reservation(text: str) -> tuple[str, ...]:
    """The nodes of `scontrol show reservation NAME -o` (one line of key=value)."""
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep and key == "Nodes":
            return tuple(expand_hostlist(value)) if value != "(null)" else ()
    return ()


class SlurmCommands:
    """The Slurm operations the backend uses, each one command."""

    def __init__(self, runner: SlurmRunner) -> None:
        self.runner = runner

    def run(self, *argv: str) -> str:
        out = self.runner.run(argv)
        log.debug("event=slurm_command argv=%s", " ".join(argv))
        return out

    def nodes(self) -> dict[str, SlurmNode]:
        return parse_sinfo(self.run("sinfo", "--json"))

    def jobs(self) -> dict[str, SlurmJob]:
        return parse_squeue(self.run("squeue", "--json"))

    def reservation_nodes(self, name: str) -> tuple[str, ...] | None:
        """The reservation's nodes; None when it does not exist."""
        try:
            text = self.run("scontrol", "show", "reservation", name, "-o")
        except SlurmError as e:
            if "not found" in str(e):
                return None
            raise
        return parse_reservation(text) if "ReservationName=" in text else None

    def set_reservation_nodes(self, name: str, nodes: Sequence[str]) -> None:
        """Shrink (or grow) the reservation to `nodes`; delete it when none is left (a
        reservation cannot be empty)."""
        if nodes:
            self.run("scontrol", "update", f"reservationname={name}", f"nodes={','.join(nodes)}")
        else:
            self.run("scontrol", "delete", f"reservationname={name}")

    def create_reservation(self, name: str, nodes: Sequence[str], *, users: str) -> None:
        """The spare reservation, as docs/slurm.md's set-up creates it: from now on, for ever,
        for `users` only, its nodes' running jobs ignored."""
        self.run(
            "scontrol", "create", "reservation", f"reservationname={name}",
            f"nodes={','.join(nodes)}", "starttime=now", "duration=infinite",
            f"users={users}", "flags=ignore_jobs",
        )  # fmt: skip

    def drain(self, node: str, *, reason: str, down: bool = False) -> None:
        state = "down" if down else "drain"
        self.run("scontrol", "update", f"nodename={node}", f"state={state}", f"reason={reason}")

    def resume(self, node: str) -> None:
        self.run("scontrol", "update", f"nodename={node}", "state=resume")

    def requeue_hold(self, job_id: str) -> None:
        self.run("scontrol", "requeuehold", job_id)

    def hold(self, job_id: str) -> None:
        self.run("scontrol", "hold", job_id)

    def set_job_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        self.run("scontrol", "update", f"jobid={job_id}", f"nodelist={','.join(nodes)}")

    def release(self, job_id: str) -> None:
        self.run("scontrol", "release", job_id)

    def start_now(self, job_id: str) -> None:
        # a requeued job waits cred_expire (120 s by default) before it may start again
        self.run("scontrol", "update", f"jobid={job_id}", "starttime=now")

    def cancel(self, job_id: str) -> None:
        self.run("scancel", job_id)

    def set_comment(self, job_id: str, text: str) -> None:
        """The job's comment (squeue and `scontrol show job` show it): one argument, so any
        text is safe."""
        self.run("scontrol", "update", f"jobid={job_id}", f"comment={text}")


__all__ = [
    "RecordingRunner",
    "SlurmCli",
    "SlurmCommands",
    "SlurmError",
    "SlurmJob",
    "SlurmNode",
    "SlurmRunner",
    "parse_reservation",
    "parse_sinfo",
    "parse_squeue",
]
