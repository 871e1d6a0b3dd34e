"""The torchrun job backend: start and stop this node's share of a training job.

Owns, for the contract's `start_job`/`stop_job` args (trainguard.command_args), the torchrun
argument list, the child environment, and the lifecycle of each launch: started through the
launch wrapper (agent.jobwrap) outside the agent's cgroup (a transient systemd unit where
systemd is PID 1, else a session and process group of its own), output written by the job
straight to its log file (the agent follows it for the reported tail), recorded
(agent.launchrec) so a restarted agent re-adopts it, stopped gracefully with SIGKILL
escalation, its exit reported once.
torch is never imported here: torchrun runs as a subprocess.

torchrun starts each worker in a session of its own, so signalling torchrun's process group
does not reach the workers. Every process of a launch is therefore found by ancestry and by a
per-launch marker in its environment (`TRAINGUARD_LAUNCH_ID`, which survives re-parenting when
torchrun itself dies), and signalled one by one.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from trainguard.agent.commands import CommandResult, Handler
from trainguard.agent.jobpolicy import JobPolicy, JobRefused, JobUser
from trainguard.agent.jobwrap import LAUNCH_FAILED_CODE, wrapper_argv
from trainguard.agent.launchrec import (
    LaunchRecord,
    load_records,
    proc_start_ticks,
    remove_record,
    write_record,
)
from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.command_args import LAUNCH_ID_ENV, StartJobArgs, StopJobArgs, decode_args
from trainguard.protocol import Command, CommandKind, Event, EventKind, JobProcess, ProtocolError

__all__ = [
    "JobAlreadyRunning",
    "JobError",
    "JobEvent",
    "JobRunner",
    "build_env",
    "find_launch_processes",
    "job_handlers",
    "job_unit_name",
    "job_unit_properties",
    "parse_start_job",
    "parse_stop_job",
    "read_exit_status",
    "systemd_is_pid1",
    "systemd_run_argv",
    "torchrun_argv",
]

log = logging.getLogger("trainguard.agent.jobs")

A = TypeVar("A")


# One output line longer than this is cut in the tail (the log file keeps it whole).
_TAIL_LINE_MAX_CHARS = 512
_READ_CHUNK_BYTES = 65536
# A restarted agent reads at most this much of a log's end for the tail (and a reader that
# fell this far behind skips ahead: only the last lines are kept).
_RESUME_READ_BYTES = 256 * 1024
# systemd-run / systemctl calls: they talk to PID 1, which answers in milliseconds when well.
_SYSTEMCTL_TIMEOUT_S = 30.0
# Exited jobs stay visible in `processes()` (for the report) until restarted; at most this many.
_MAX_EXITED_KEPT = 16


class JobError(ValueError):
    """A job request that cannot be carried out; the message says what and why."""


class JobAlreadyRunning(JobError):
    """`start` of the very attempt that is already running here (a repeated command)."""


# --- command arguments ---------------------------------------------------------------------


def parse_start_job(args: Mapping[str, Any]) -> StartJobArgs:
    """Strictly decode `start_job`'s `Command.args`; raises JobError naming the key."""
    return _parse(StartJobArgs, args, CommandKind.START_JOB)


def parse_stop_job(args: Mapping[str, Any]) -> StopJobArgs:
    """Strictly decode `stop_job`'s `Command.args`; raises JobError naming the key."""
    return _parse(StopJobArgs, args, CommandKind.STOP_JOB)


def _parse(cls: type[A], args: Mapping[str, Any], kind: str) -> A:
    if not isinstance(args, Mapping):
        raise JobError(f"{kind}: args: expected a mapping, got {type(args).__name__}")
    try:
        return decode_args(cls, dict(args))
    except ProtocolError as e:
        raise JobError(f"{kind}: {e}") from None


# --- launch --------------------------------------------------------------------------------


def torchrun_argv(spec: StartJobArgs, *, python: str) -> list[str]:
    """The argument list that launches this node's share of the job (never a shell string)."""
    # a job recovered in process: torchrun with a short exit barrier (trainer/torchrun.py)
    launcher = "trainguard.trainer.torchrun" if spec.rdzv_backend == "static" else None
    argv = [
        python,
        "-m",
        launcher or "torch.distributed.run",
        "--nnodes",
        str(spec.nnodes),
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--rdzv-backend",
        spec.rdzv_backend,
        "--rdzv-endpoint",
        spec.rdzv_endpoint,
        "--rdzv-id",
        spec.rdzv_id,
        "--max-restarts",
        str(spec.max_restarts),
    ]
    conf = dict(spec.rdzv_conf)
    is_host = spec.is_host()
    if spec.rdzv_backend == "static":
        # the node with node rank 0 serves the store; every rank is fixed by the node rank
        argv += ["--node-rank", str(spec.node_rank)]
    elif is_host is not None:
        # Explicit, so two nodes on one host never both try to serve the store, and a client
        # that starts first waits for the host instead of serving the store itself.
        conf["is_host"] = "true" if is_host else "false"
    if conf:
        argv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in sorted(conf.items()))]
    addr = spec.advertised_addr()
    if addr is not None:
        argv += ["--local-addr", addr]
    if spec.command[0] == "-m":
        # torchrun's own form of `python -m`: the module, then its arguments
        argv += ["--module", *spec.command[1:]]
    else:
        argv += spec.command
    return argv


def build_env(
    spec: StartJobArgs,
    *,
    base: Mapping[str, str],
    node_name: str,
    heartbeat_socket: str,
    control_dir: str | None,
    launch_id: str,
    user_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The child environment: agent env, the job user's login variables (`user_env`: HOME,
    USER, LOGNAME), then the job's env, then the agent's own variables."""
    env = dict(base)
    env.update(user_env or {})
    # Unbuffered output keeps the reported tail current; a job may still override it.
    env["PYTHONUNBUFFERED"] = "1"
    env.update(spec.env)
    env["TRAINGUARD_JOB"] = spec.job
    env["TRAINGUARD_ATTEMPT"] = str(spec.attempt)
    env["TRAINGUARD_NODE"] = node_name
    env["TRAINGUARD_AGENT_SOCKET"] = heartbeat_socket
    env[LAUNCH_ID_ENV] = launch_id
    if control_dir is not None:
        env["TRAINGUARD_CONTROL_DIR"] = control_dir
    else:
        env.pop("TRAINGUARD_CONTROL_DIR", None)
    if spec.ckpt_dir is not None:
        env["TRAINGUARD_CKPT_DIR"] = spec.ckpt_dir
    else:
        env.pop("TRAINGUARD_CKPT_DIR", None)
    return env


def find_launch_processes(*, leader_pid: int, launch_id: str, proc_root: str = "/proc") -> set[int]:
    """Live processes of one launch: descendants of `leader_pid` (the leader included) and
    every process whose environment carries `TRAINGUARD_LAUNCH_ID=<launch_id>`.

    Reads `<proc_root>/<pid>/stat` and `/environ`; processes that vanish or that this user may
    not read are skipped. Zombies are left out: they are dead already.
    """
    needle = f"{LAUNCH_ID_ENV}={launch_id}".encode() + b"\0"
    parent: dict[int, int] = {}
    marked: set[int] = set()
    try:
        entries = [e.name for e in os.scandir(proc_root) if e.name.isdigit()]
    except OSError:
        return set()
    for name in entries:
        pid = int(name)
        try:
            with open(os.path.join(proc_root, name, "stat"), "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) S ppid ...": comm may hold spaces and parentheses
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) < 2 or fields[0] == b"Z":
            continue
        parent[pid] = int(fields[1])
        try:
            with open(os.path.join(proc_root, name, "environ"), "rb") as f:
                environ = f.read()
        except OSError:
            continue
        if environ.startswith(needle) or b"\0" + needle in environ:
            marked.add(pid)
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    found = {leader_pid} if leader_pid in parent else set()
    stack = [leader_pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return (found | marked) - {os.getpid()}


# --- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobEvent:
    """An edge event from the job backend; the daemon turns it into a protocol Event."""

    kind: EventKind  # JOB_EXIT
    job: str
    attempt: int
    ts: float  # wall clock when the agent saw it
    exit_code: int | None = None  # negative: killed by that signal
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_event(self, *, event_id: int) -> Event:
        return Event(
            id=event_id,
            kind=self.kind,
            ts=self.ts,
            job=self.job,
            code=self.exit_code,
            message=self.message,
            data={"attempt": self.attempt, **self.data},
        )


def _has_exited(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the child has exited, without reaping it."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True  # reaped elsewhere; Popen.poll() reports it


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


# --- runner --------------------------------------------------------------------------------


class _LogTail:
    """Follows a launch's log file (the job writes to it directly, so its output never
    depends on the agent being alive) and keeps its last lines for reports."""

    def __init__(self, path: Path, *, offset: int, tail_lines: int, resume: bool = False):
        self._path = path
        self._keep = tail_lines > 0
        self._tail: collections.deque[str] = collections.deque(maxlen=max(tail_lines, 1))
        self._partial = b""
        self._pos = offset
        if resume:
            # a restarted agent: only the end of the log matters for the tail
            with contextlib.suppress(OSError):
                size = path.stat().st_size
                if size - offset > _RESUME_READ_BYTES:
                    self._pos = size - _RESUME_READ_BYTES
                    self._skip_first = True
                    return
        self._skip_first = False

    def read(self) -> None:
        """Take in what was appended since the last read (bounded per call)."""
        if not self._keep:
            return
        try:
            with self._path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self._pos:  # truncated by someone: start over from its start
                    self._pos, self._partial = 0, b""
                if size - self._pos > _RESUME_READ_BYTES:
                    # far behind (a burst of output): only the last lines are kept anyway
                    self._pos, self._partial, self._skip_first = (
                        size - _RESUME_READ_BYTES,
                        b"",
                        True,
                    )
                f.seek(self._pos)
                chunk = f.read(size - self._pos)
        except OSError:
            return
        self._pos += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()[-_READ_CHUNK_BYTES:]
        if self._skip_first and lines:
            lines.pop(0)  # started mid-line
            self._skip_first = False
        for raw in lines:
            text = raw.decode("utf-8", errors="replace").rstrip("\r")
            self._tail.append(text[:_TAIL_LINE_MAX_CHARS])

    def tail(self) -> str:
        if not self._keep:
            return ""
        lines = list(self._tail)
        if self._partial:
            lines.append(self._partial.decode("utf-8", errors="replace")[:_TAIL_LINE_MAX_CHARS])
        return "\n".join(lines[-(self._tail.maxlen or 1) :])


@dataclass
class _Job:
    spec: StartJobArgs
    pid: int  # the launch leader: the jobwrap process
    start_ticks: int | None  # the leader's start time: a reused pid is not the leader
    pgid: int
    log: _LogTail
    log_path: Path
    launch_id: str
    status_path: Path
    record: LaunchRecord
    # Our child (no systemd): reaped here, its pid and group cannot be reused before that.
    # None: started by systemd, or adopted from an earlier agent instance.
    proc: subprocess.Popen[bytes] | None = None
    adopted: bool = False
    state: Literal["running", "stopping", "exited"] = "running"
    kill_at: float | None = None  # monotonic deadline for SIGKILL while stopping
    killed: bool = False  # we sent SIGKILL
    stop_requested: bool = False
    stop_reason: str = ""
    exit_code: int | None = None


@dataclass(frozen=True)
class _PendingStart:
    """A start of a newer attempt, launched as soon as the running older one has exited."""

    spec: StartJobArgs
    user: JobUser
    python: str
    replaces: int  # the attempt being stopped first


def systemd_is_pid1(*, run_dir: str = "/run/systemd/system") -> bool:
    """Whether systemd manages this machine (sd_booted()'s test)."""
    return os.path.isdir(run_dir)


def job_unit_name(spec: StartJobArgs, *, launch_id: str) -> str:
    """`trainguard-job-<job>-<attempt>-<id>.service`: job names are unit-name safe."""
    return f"trainguard-job-{spec.job}-{spec.attempt}-{launch_id[:8]}.service"


def job_unit_properties(*, log_path: str, stop_timeout_s: float) -> list[str]:
    """The transient job unit's properties (`systemd-run -p`), as unit file lines.

    KillMode=control-group: a stop of the unit reaches every worker (torchrun's workers run
    in sessions of their own), and when the wrapper (the main process) exits, anything left
    in the unit is killed. LimitMEMLOCK: NCCL over RDMA pins its buffers. No DevicePolicy:
    the job sees every device (GPUs, /dev/infiniband/*), as on a node without systemd.
    """
    return [
        "KillMode=control-group",
        f"TimeoutStopSec={max(1, math.ceil(stop_timeout_s))}",
        "SendSIGKILL=yes",
        "LimitMEMLOCK=infinity",
        "LimitNOFILE=1048576",
        "TasksMax=infinity",
        f"StandardOutput=append:{log_path}",
        f"StandardError=append:{log_path}",
    ]


def systemd_run_argv(
    *, unit: str, description: str, properties: list[str], command: list[str]
) -> list[str]:
    """The `systemd-run` argument list that starts `command` as a transient service."""
    argv = [
        "systemd-run",
        "--quiet",
        "--no-ask-password",
        "--collect",
        "--service-type=exec",
        f"--unit={unit}",
        f"--description={description}",
    ]
    for prop in properties:
        argv += ["-p", prop]
    return [*argv, "--", *command]


def _unit_main_pid(unit: str) -> int:
    out = subprocess.run(
        ["systemctl", "show", "--property=MainPID", "--value", unit],
        capture_output=True,
        text=True,
        timeout=_SYSTEMCTL_TIMEOUT_S,
        check=False,
    )
    text = out.stdout.strip()
    return int(text) if out.returncode == 0 and text.isdigit() else 0


def read_exit_status(path: Path) -> dict[str, Any] | None:
    """The wrapper's status record, or None when absent or unreadable (the wrapper was
    killed before it could write one)."""
    try:
        data = json.loads(path.read_bytes()[:65536])
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("exit_code"), int):
        return None
    return data


class JobRunner:
    """Runs this node's torchrun processes; `poll()` once per agent loop drives everything.

    Every start passes `policy` first (agent.jobpolicy): who the job runs as and what it
    may run. Every launch runs under the launch wrapper (agent.jobwrap) outside the agent's
    cgroup (a transient systemd unit) or, without systemd, in a session of its own; it is
    recorded in `<work_dir>/launches/` so `adopt()` in a restarted agent takes it over.
    Thread-safe: the agent loop calls start/stop/poll, the reporter may call processes()
    and stop_stale().
    """

    def __init__(
        self,
        *,
        node_name: str,
        work_dir: str,
        heartbeat_socket: str,
        policy: JobPolicy,
        control_dir: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
        output_tail_lines: int = 40,
        systemd: bool | None = None,
        replace_grace_s: float = 10.0,
        wrapper_python: str = sys.executable,
    ) -> None:
        """`systemd`: launch in transient units (None: where systemd is PID 1 and the agent
        is root).
        `replace_grace_s`: SIGTERM-to-SIGKILL grace when a newer attempt replaces one."""
        if output_tail_lines < 0:
            raise ValueError(f"output_tail_lines must be >= 0, got {output_tail_lines}")
        self._node = node_name
        self._work_dir = Path(work_dir)
        self._work_dir.mkdir(parents=True, exist_ok=True)
        self._state_dir = self._work_dir / "launches"
        self._state_dir.mkdir(mode=0o700, exist_ok=True)
        self._heartbeat_socket = heartbeat_socket
        self._policy = policy
        self._control_dir = control_dir
        self._clock = clock
        self._tail_lines = output_tail_lines
        # systemd-run asks the system manager for a unit: root only (a non-root agent would
        # get "access denied" or a polkit prompt on every start)
        self._systemd = (systemd_is_pid1() and os.geteuid() == 0) if systemd is None else systemd
        self._replace_grace_s = replace_grace_s
        self._wrapper_python = wrapper_python
        self._lock = threading.RLock()
        self._jobs: dict[str, _Job] = {}
        self._pending_starts: dict[str, _PendingStart] = {}
        self._pending: list[JobEvent] = []

    @property
    def work_dir(self) -> Path:
        """Where job logs are written."""
        return self._work_dir

    @property
    def control_dir(self) -> str | None:
        """Where its ranks bind their control sockets (TRAINGUARD_CONTROL_DIR)."""
        return self._control_dir

    @property
    def policy(self) -> JobPolicy:
        return self._policy

    @property
    def state_dir(self) -> Path:
        """Where launch records and exit statuses are kept."""
        return self._state_dir

    @property
    def uses_systemd(self) -> bool:
        return self._systemd

    # -- commands ---------------------------------------------------------------------------

    def start(self, spec: StartJobArgs) -> int | None:
        """Launch torchrun for `spec`; returns None, or the older attempt of the job that is
        being stopped first (the launch follows once it has exited, see poll()).

        Raises JobAlreadyRunning for the attempt already running or starting here, JobError
        for an attempt older than the one here, a refusal of the node's policy, a missing
        interpreter or working directory, or a failed launch.
        """
        with self._lock:
            current = self._jobs.get(spec.job)
            pending = self._pending_starts.get(spec.job)
            if pending is not None and pending.spec.attempt == spec.attempt:
                raise JobAlreadyRunning(
                    f"job {spec.job!r} attempt {spec.attempt} is already starting on node "
                    f"{self._node} (once attempt {pending.replaces} has stopped)"
                )
            running = current is not None and current.state != "exited"
            if current is not None and running and current.spec.attempt == spec.attempt:
                raise JobAlreadyRunning(
                    f"job {spec.job!r} attempt {spec.attempt} is already {current.state} on "
                    f"node {self._node} (pid {current.pid})"
                )
            if current is not None and running and current.spec.attempt > spec.attempt:
                raise JobError(
                    f"job {spec.job!r} attempt {spec.attempt} is older than attempt "
                    f"{current.spec.attempt}, which is {current.state} on node {self._node} "
                    f"(pid {current.pid})"
                )
            user, python = self._check(spec)
            if current is not None and running:
                self._pending_starts[spec.job] = _PendingStart(
                    spec=spec, user=user, python=python, replaces=current.spec.attempt
                )
                self._stop_locked(
                    current, grace_s=self._replace_grace_s, reason=f"replaced_by_{spec.attempt}"
                )
                log.warning(
                    "event=job_start_after_stop job=%s attempt=%d replaces=%d grace_s=%g",
                    spec.job,
                    spec.attempt,
                    current.spec.attempt,
                    self._replace_grace_s,
                )
                return current.spec.attempt
            self._pending_starts.pop(spec.job, None)
            self._launch(spec, user=user, python=python)
            self._trim_exited()
            return None

    def _check(self, spec: StartJobArgs) -> tuple[JobUser, str]:
        try:
            user = self._policy.check(
                env=spec.env,
                nproc_per_node=spec.nproc_per_node,
                python=spec.python,
                program=spec.command[0],
                cwd=spec.cwd,
                module=spec.command[1] if spec.command[0] == "-m" else None,
            )
        except JobRefused as e:
            log.warning(
                "event=job_refused job=%s attempt=%d reason=%r",
                spec.job,
                spec.attempt,
                str(e),
            )
            raise JobError(f"job {spec.job!r} refused on node {self._node}: {e}") from None
        python = spec.python or self._policy.agent_python
        if not python or not os.path.isfile(python) or not os.access(python, os.X_OK):
            raise JobError(f"job {spec.job!r}: python interpreter not found: {python!r}")
        if spec.cwd is not None and not os.path.isdir(spec.cwd):
            raise JobError(f"job {spec.job!r}: working directory not found: {spec.cwd!r}")
        return user, python

    def _launch(self, spec: StartJobArgs, *, user: JobUser, python: str) -> None:
        """Start the wrapper (and torchrun under it), record the launch; raises JobError."""
        argv = torchrun_argv(spec, python=python)
        launch_id = uuid.uuid4().hex
        env = build_env(
            spec,
            base=os.environ,
            node_name=self._node,
            heartbeat_socket=self._heartbeat_socket,
            control_dir=self._control_dir,
            launch_id=launch_id,
            user_env=user.env(),
        )
        log_path = self._work_dir / f"{spec.job}-{spec.attempt}.log"
        status_path = self._state_dir / f"{spec.job}-{spec.attempt}-{launch_id}.status"
        switch: dict[str, Any] = {}
        if user.switch:
            switch = {"uid": user.uid, "gid": user.gid, "groups": user.groups}
        try:
            log_file = log_path.open("ab")
        except OSError as e:
            raise JobError(f"job {spec.job!r}: cannot open log {log_path}: {e}") from None
        unit: str | None = None
        proc: subprocess.Popen[bytes] | None = None
        with log_file:
            offset = log_file.tell()
            if self._systemd:
                unit = job_unit_name(spec, launch_id=launch_id)
                pid = self._launch_unit(
                    spec, unit=unit, env=env, argv=argv, status_path=status_path,
                    log_path=log_path, switch=switch,
                )  # fmt: skip
            else:
                wrapped = wrapper_argv(
                    python=self._wrapper_python,
                    status_path=str(status_path),
                    argv=argv,
                    cwd=spec.cwd,
                    **switch,
                )
                try:
                    proc = subprocess.Popen(
                        wrapped,
                        stdin=subprocess.DEVNULL,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        env=env,
                        # its own session and process group: neither the agent's signals
                        # (a terminal's ^C, systemd's stop) nor its exit reach the job
                        start_new_session=True,
                    )
                except OSError as e:
                    raise JobError(
                        f"job {spec.job!r}: cannot launch {self._wrapper_python!r}: {e}"
                    ) from None
                pid = proc.pid
        record = LaunchRecord(
            job=spec.job,
            attempt=spec.attempt,
            launch_id=launch_id,
            pid=pid,
            start_ticks=proc_start_ticks(pid) or 0,
            pgid=pid,  # the wrapper leads its session (setsid, or systemd's exec)
            log_path=str(log_path),
            log_offset=offset,
            status_path=str(status_path),
            started_at=self._clock.now(),
            unit=unit,
            spec=dataclasses.asdict(spec),
        )
        job = _Job(
            spec=spec,
            pid=pid,
            start_ticks=record.start_ticks or None,
            pgid=pid,
            log=_LogTail(log_path, offset=offset, tail_lines=self._tail_lines),
            log_path=log_path,
            launch_id=launch_id,
            status_path=status_path,
            record=record,
            proc=proc,
        )
        try:
            write_record(self._state_dir, record)
        except OSError as e:
            # an unrecorded launch would be lost to the next agent: never acknowledge one
            self._jobs[spec.job] = job
            self._stop_locked(job, grace_s=0.0, reason="launch_record_failed")
            raise JobError(f"job {spec.job!r}: cannot write the launch record: {e}") from None
        self._jobs[spec.job] = job
        log.info(
            "event=job_started job=%s attempt=%d pid=%d user=%s uid=%d is_host=%s "
            "unit=%s log=%s argv=%s",
            spec.job,
            spec.attempt,
            pid,
            user.name,
            user.uid,
            spec.is_host(),
            unit or "-",
            log_path,
            " ".join(argv),
        )

    def _launch_unit(
        self,
        spec: StartJobArgs,
        *,
        unit: str,
        env: dict[str, str],
        argv: list[str],
        status_path: Path,
        log_path: Path,
        switch: dict[str, Any],
    ) -> int:
        """Start the wrapper as a transient systemd service; returns its pid."""
        env_file = self._state_dir / f".{unit}.env.json"
        fd = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(env, f)
        wrapped = wrapper_argv(
            python=self._wrapper_python,
            status_path=str(status_path),
            argv=argv,
            env_file=str(env_file),
            cwd=spec.cwd,
            **switch,
        )
        command = systemd_run_argv(
            unit=unit,
            description=f"trainguard job {spec.job} attempt {spec.attempt}",
            properties=job_unit_properties(
                log_path=str(log_path), stop_timeout_s=self._replace_grace_s
            ),
            command=wrapped,
        )
        try:
            out = subprocess.run(
                command, capture_output=True, text=True, timeout=_SYSTEMCTL_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            with contextlib.suppress(OSError):
                env_file.unlink()
            raise JobError(f"job {spec.job!r}: systemd-run failed: {e}") from None
        if out.returncode != 0:
            with contextlib.suppress(OSError):
                env_file.unlink()
            raise JobError(
                f"job {spec.job!r}: systemd-run exited {out.returncode}: "
                f"{out.stderr.strip()[-500:]}"
            )
        pid = _unit_main_pid(unit)
        if pid <= 1:
            raise JobError(f"job {spec.job!r}: unit {unit} started but has no main process")
        return pid

    def adopt(self) -> list[str]:
        """Take over the launches an earlier agent instance recorded (call once, at start).

        A launch whose leader is alive with the recorded start time keeps running and is
        reported as before (same pid and attempt); one that ended meanwhile is reported by
        the next `poll()` (its exit code from the wrapper's status file), once. A pid now
        held by another process is never adopted. Returns the jobs taken over."""
        adopted = []
        with self._lock:
            for rec in load_records(self._state_dir):
                try:
                    spec = parse_start_job(rec.spec)
                except JobError as e:
                    log.warning(
                        "event=launch_record_bad job=%s attempt=%d reason=%r",
                        rec.job,
                        rec.attempt,
                        str(e),
                    )
                    continue
                ticks = proc_start_ticks(rec.pid)
                alive = ticks is not None and ticks == rec.start_ticks
                if ticks is not None and not alive:
                    log.warning(
                        "event=launch_pid_reused job=%s attempt=%d pid=%d "
                        "hint=the_launch_ended_and_its_pid_went_to_another_process",
                        rec.job,
                        rec.attempt,
                        rec.pid,
                    )
                job = _Job(
                    spec=spec,
                    pid=rec.pid,
                    start_ticks=rec.start_ticks,
                    pgid=rec.pgid,
                    log=_LogTail(
                        Path(rec.log_path),
                        offset=rec.log_offset,
                        tail_lines=self._tail_lines,
                        resume=True,
                    ),
                    log_path=Path(rec.log_path),
                    launch_id=rec.launch_id,
                    status_path=Path(rec.status_path),
                    record=rec,
                    adopted=True,
                )
                job.log.read()
                older = self._jobs.get(rec.job)
                if older is not None and older.state != "exited":
                    # two live launches of one job: the older attempt is stale
                    self._signal(older, signal.SIGKILL, quiet=True)
                    older.stop_requested = older.killed = True
                    older.stop_reason = "stale_launch_record"
                    self._finish(older)
                self._jobs[rec.job] = job
                if alive:
                    adopted.append(rec.job)
                log.info(
                    "event=%s job=%s attempt=%d pid=%d unit=%s log=%s",
                    "job_adopted" if alive else "job_ended_while_agent_away",
                    rec.job,
                    rec.attempt,
                    rec.pid,
                    rec.unit or "-",
                    rec.log_path,
                )
        return adopted

    def stop(self, job: str, *, grace_s: float = 30.0, reason: str = "") -> bool:
        """SIGTERM every process of the job's launch now; `poll()` sends SIGKILL after
        `grace_s`. A start waiting for the job's older attempt to stop is cancelled.

        Non-blocking. Returns False (and does nothing) when the job is not running here, so a
        repeated stop is harmless.
        """
        if grace_s < 0:
            raise JobError(f"grace_s must be >= 0, got {grace_s}")
        with self._lock:
            cancelled = self._pending_starts.pop(job, None)
            if cancelled is not None:
                log.info(
                    "event=job_start_cancelled job=%s attempt=%d reason=stop_job",
                    job,
                    cancelled.spec.attempt,
                )
            j = self._jobs.get(job)
            if j is None or j.state == "exited":
                log.info("event=job_stop_ignored job=%s reason=not_running", job)
                return False
            self._stop_locked(j, grace_s=grace_s, reason=reason)
            return True

    def stop_stale(self, job: str, *, current_attempt: int, grace_s: float | None = None) -> bool:
        """The controller says `current_attempt` is the job's attempt: stop any local launch
        of an older one at once (and drop a waiting start of an older one). Returns whether
        a launch was signalled."""
        with self._lock:
            pending = self._pending_starts.get(job)
            if pending is not None and pending.spec.attempt < current_attempt:
                del self._pending_starts[job]
                log.warning(
                    "event=job_start_cancelled job=%s attempt=%d reason=stale_attempt "
                    "current_attempt=%d",
                    job,
                    pending.spec.attempt,
                    current_attempt,
                )
            j = self._jobs.get(job)
            if j is None or j.state == "exited" or j.spec.attempt >= current_attempt:
                return False
            if j.state == "stopping" and j.stop_reason.startswith("stale_attempt"):
                return False  # already on it
            log.warning(
                "event=job_stale_attempt job=%s attempt=%d current_attempt=%d pid=%d",
                job,
                j.spec.attempt,
                current_attempt,
                j.pid,
            )
            self._stop_locked(
                j,
                grace_s=self._replace_grace_s if grace_s is None else grace_s,
                reason=f"stale_attempt_current_{current_attempt}",
            )
            return True

    def retag(self, job: str, *, attempt: int) -> bool:
        """The job's ranks here joined attempt `attempt` in process (a `rejoin`): its running
        launch is that attempt's from now on (reported, fenced and re-adopted so). False when
        no launch of the job runs here or it is already that attempt or newer."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None or j.state == "exited" or j.spec.attempt >= attempt:
                return False
            before = j.spec.attempt
            j.spec = dataclasses.replace(j.spec, attempt=attempt)
            old = j.record
            j.record = dataclasses.replace(
                old, attempt=attempt, spec={**old.spec, "attempt": attempt}
            )
            try:
                write_record(self._state_dir, j.record)
                remove_record(self._state_dir, old)
            except OSError as e:  # the launch still runs: only a re-adoption would miss it
                log.warning("event=launch_record_failed job=%s error=%s", job, e)
        log.info("event=job_rejoined job=%s attempt_from=%d attempt_to=%d", job, before, attempt)
        return True

    def _stop_locked(self, j: _Job, *, grace_s: float, reason: str) -> None:
        now = self._clock.monotonic()
        deadline = now + grace_s
        j.stop_requested = True
        if j.state == "stopping" and j.kill_at is not None and j.kill_at <= deadline:
            return  # already stopping with an earlier deadline
        j.state = "stopping"
        j.kill_at = deadline
        j.stop_reason = reason or j.stop_reason
        self._signal(j, signal.SIGTERM)
        log.info(
            "event=job_stopping job=%s attempt=%d pid=%d grace_s=%g reason=%s",
            j.spec.job,
            j.spec.attempt,
            j.pid,
            grace_s,
            reason or "stop_job",
        )

    def poll(self) -> list[JobEvent]:
        """Reap exits, escalate overdue stops, launch starts that waited for an older attempt
        to stop; returns new `job_exit` events (each once)."""
        with self._lock:
            now = self._clock.monotonic()
            for j in self._jobs.values():
                if j.state == "exited":
                    continue
                j.log.read()
                if self._leader_exited(j):
                    # An own child is still an unreaped zombie here, so its pid and group
                    # cannot be reused: end the launch's leftovers before reaping it.
                    left = self._signal(j, signal.SIGKILL, quiet=True)
                    if left:
                        log.warning(
                            "event=job_leftovers_killed job=%s attempt=%d count=%d",
                            j.spec.job,
                            j.spec.attempt,
                            left,
                        )
                    self._finish(j)
                elif j.kill_at is not None and now >= j.kill_at and not j.killed:
                    j.killed = True
                    log.warning(
                        "event=job_stop_escalated job=%s attempt=%d pid=%d signal=SIGKILL",
                        j.spec.job,
                        j.spec.attempt,
                        j.pid,
                    )
                    self._signal(j, signal.SIGKILL)
            for name, pending in list(self._pending_starts.items()):
                current = self._jobs.get(name)
                if current is not None and current.state != "exited":
                    continue
                del self._pending_starts[name]
                try:
                    self._launch(pending.spec, user=pending.user, python=pending.python)
                except JobError as e:
                    log.error(
                        "event=job_start_failed job=%s attempt=%d reason=%r",
                        name,
                        pending.spec.attempt,
                        str(e),
                    )
                    self._pending.append(
                        JobEvent(
                            kind=EventKind.JOB_EXIT,
                            job=name,
                            attempt=pending.spec.attempt,
                            ts=self._clock.now(),
                            exit_code=LAUNCH_FAILED_CODE,
                            message=f"launch failed: {e}",
                            data={"node": self._node, "launch_failed": True},
                        )
                    )
            self._trim_exited()
            events, self._pending = self._pending, []
        return events

    def processes(self) -> tuple[JobProcess, ...]:
        """The state of every job this node runs (and recently ran), for the report."""
        with self._lock:
            out = []
            for j in self._jobs.values():
                if j.state != "exited":
                    j.log.read()
                out.append(
                    JobProcess(
                        job=j.spec.job,
                        attempt=j.spec.attempt,
                        state=j.state,
                        pid=j.pid,
                        exit_code=j.exit_code if j.state == "exited" else None,
                        output_tail=j.log.tail(),
                    )
                )
        return tuple(out)

    def launch_processes(self, job: str) -> set[int]:
        """Live pids of the job's current launch (the wrapper, torchrun and its workers);
        empty when the job is not running here. Read from /proc now, so a recycled pid is
        never in it."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None or j.state == "exited":
                return set()
            leader = j.pid if self._leader_is_ours(j) else -1
            launch_id = j.launch_id
        return find_launch_processes(leader_pid=leader, launch_id=launch_id)

    def launch_leaders(self) -> dict[tuple[int, int], str]:
        """(leader pid, leader start ticks) -> job, for every launch still running here: what
        a heartbeat's sender must descend from to speak for that job (agent.senders)."""
        with self._lock:
            return {
                (j.pid, j.start_ticks): j.spec.job
                for j in self._jobs.values()
                if j.state != "exited" and j.start_ticks is not None
            }

    def running_jobs(self) -> frozenset[str]:
        """Names of the jobs whose launch still runs here."""
        with self._lock:
            return frozenset(j.spec.job for j in self._jobs.values() if j.state != "exited")

    def log_path(self, job: str) -> Path | None:
        """Where the job's latest attempt writes its output (None if never started here)."""
        with self._lock:
            j = self._jobs.get(job)
            return None if j is None else j.log_path

    def detach(self) -> list[str]:
        """The agent is going away: leave every job running for the next agent instance
        (its launch records stay), and drop starts still waiting for an older attempt to
        stop. Returns the jobs left running."""
        with self._lock:
            running = [j for j in self._jobs.values() if j.state != "exited"]
            for j in running:
                log.info(
                    "event=job_left_running job=%s attempt=%d pid=%d state=%s "
                    "hint=the_next_agent_adopts_it",
                    j.spec.job,
                    j.spec.attempt,
                    j.pid,
                    j.state,
                )
            for name, pending in self._pending_starts.items():
                log.warning(
                    "event=job_start_dropped job=%s attempt=%d reason=agent_stopping",
                    name,
                    pending.spec.attempt,
                )
            self._pending_starts.clear()
            return [j.spec.job for j in running]

    def close(self, *, grace_s: float = 10.0) -> None:
        """Stop every job (SIGTERM, SIGKILL after `grace_s`) and wait until all have ended:
        for tools and tests that embed the runner (the agent itself detaches instead).

        Exit events stay queued: a last `poll()` after close returns them.
        """
        with self._lock:
            self._pending_starts.clear()
            running = [name for name, j in self._jobs.items() if j.state != "exited"]
        for name in running:
            self.stop(name, grace_s=grace_s)
        # the escalation deadline plus time for SIGKILL to land
        deadline = self._clock.monotonic() + grace_s + 10.0
        while True:
            with self._lock:
                # poll() swaps self._pending out: take its result first, then keep it queued
                events = self.poll()
                self._pending.extend(events)
                alive = [j for j in self._jobs.values() if j.state != "exited"]
            if not alive or self._clock.monotonic() >= deadline:
                break
            self._clock.sleep(0.05)
        for j in alive:
            # cannot happen short of an unkillable (D-state) process; never leave it unreaped
            log.error("event=job_close_timeout job=%s pid=%d", j.spec.job, j.pid)
            self._signal(j, signal.SIGKILL, quiet=True)
            if j.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    j.proc.wait(timeout=5.0)
        if alive:
            with self._lock:
                events = self.poll()
                self._pending.extend(events)

    # -- internals --------------------------------------------------------------------------

    def _leader_is_ours(self, j: _Job) -> bool:
        """Whether the leader's pid still names the launch's leader: our unreaped child, or a
        live process with the recorded start time."""
        if j.proc is not None:
            return j.proc.returncode is None
        return j.start_ticks is not None and proc_start_ticks(j.pid) == j.start_ticks

    def _leader_exited(self, j: _Job) -> bool:
        if j.proc is not None:
            return _has_exited(j.proc)
        return not self._leader_is_ours(j)

    def _signal(self, j: _Job, sig: signal.Signals, *, quiet: bool = False) -> int:
        """Send `sig` to the leader's process group (the wrapper and torchrun) and to every
        other process of the launch (torchrun's workers live in sessions of their own);
        returns how many processes outside the group were signalled. The group and the
        ancestry are used only while the leader's pid is known to be the leader's."""
        ours = self._leader_is_ours(j)
        if ours:
            try:
                os.killpg(j.pgid, sig)
            except ProcessLookupError:
                pass  # the leader's group is already gone
            except PermissionError as e:
                if not quiet:
                    log.error(
                        "event=job_signal_failed job=%s pgid=%d signal=%s reason=%s",
                        j.spec.job,
                        j.pgid,
                        sig.name,
                        e,
                    )
        others = find_launch_processes(leader_pid=j.pid if ours else -1, launch_id=j.launch_id)
        others.discard(j.pid)
        sent = 0
        for pid in sorted(others):
            if ours and _pgid_of(pid) == j.pgid:
                continue  # signalled with the group already
            try:
                os.kill(pid, sig)
                sent += 1
            except (ProcessLookupError, PermissionError):
                continue  # gone meanwhile, or not ours to signal
        return sent

    def _finish(self, j: _Job) -> None:
        """The launch has ended: its exit code (the wrapper's status, else what waitpid
        says of our child, else unknown), one `job_exit` event, the record removed."""
        j.log.read()
        status = read_exit_status(j.status_path)
        code: int | None = None
        known = True
        if status is not None:
            code = int(status["exit_code"])
        if j.proc is not None:
            own = j.proc.poll()
            if own is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    own = j.proc.wait(timeout=1.0)
            if code is None:
                code = own
        if code is None:
            # the wrapper itself was killed (SIGKILL: it ignores the others) before writing
            # a status: report it as killed, never as a clean exit
            code, known = -int(signal.SIGKILL), False
        j.exit_code = code
        j.state = "exited"
        j.kill_at = None
        message = _describe_exit(code)
        if not known:
            message = "exit status unknown (the launch wrapper was killed)"
        if j.killed:
            message += " (SIGKILL after stop grace)"
        elif j.stop_requested:
            message += " (stopped)"
        data: dict[str, Any] = {
            "node": self._node,
            "pid": j.pid,
            "stopped": j.stop_requested,
            "killed": j.killed,
            "output_tail": j.log.tail(),
            "log_path": str(j.log_path),
        }
        if j.stop_reason:
            data["stop_reason"] = j.stop_reason
        if j.adopted:
            data["adopted"] = True
        if not known:
            data["exit_status_known"] = False
        if status is not None and status.get("leftovers_killed"):
            data["leftovers_killed"] = status["leftovers_killed"]
        self._pending.append(
            JobEvent(
                kind=EventKind.JOB_EXIT,
                job=j.spec.job,
                attempt=j.spec.attempt,
                ts=self._clock.now(),
                exit_code=code,
                message=message,
                data=data,
            )
        )
        remove_record(self._state_dir, j.record)
        for path in (j.status_path, self._state_dir / f".{j.record.unit}.env.json"):
            with contextlib.suppress(OSError):
                path.unlink()
        log.info(
            "event=job_exited job=%s attempt=%d pid=%d exit_code=%d known=%s "
            "stopped=%s killed=%s adopted=%s",
            j.spec.job,
            j.spec.attempt,
            j.pid,
            code,
            known,
            j.stop_requested,
            j.killed,
            j.adopted,
        )

    def _trim_exited(self) -> None:
        exited = [name for name, j in self._jobs.items() if j.state == "exited"]
        for name in exited[: max(0, len(exited) - _MAX_EXITED_KEPT)]:
            del self._jobs[name]


def _pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


# --- command handlers ----------------------------------------------------------------------


def job_handlers(
    runner: JobRunner, *, also_stop: Callable[[str, float], bool] | None = None
) -> dict[str, Handler]:
    """`start_job` / `stop_job` handlers for `CommandExecutor.register` (agent.commands).
    `also_stop(job, grace_s)`: the job's other processes here (a rank a warm standby became,
    agent.standby_ranks) stop with its launch."""

    def start_job(cmd: Command) -> CommandResult:
        spec = parse_start_job(cmd.args)
        try:
            replaces = runner.start(spec)
        except JobAlreadyRunning as e:
            # the same (job, attempt) again, e.g. re-sent under a new command id: a no-op
            return CommandResult(
                ok=True,
                message=str(e),
                data={"job": spec.job, "attempt": spec.attempt, "already_running": True},
            )
        if replaces is not None:
            # the older attempt is stopping; the launch follows its exit (JobRunner.poll)
            return CommandResult(
                ok=True,
                message=f"stopping job {spec.job} attempt {replaces} first; attempt "
                f"{spec.attempt} starts once it has exited",
                data={"job": spec.job, "attempt": spec.attempt, "replaces_attempt": replaces},
            )
        return CommandResult(
            ok=True,
            message=f"started job {spec.job} attempt {spec.attempt}",
            data={"job": spec.job, "attempt": spec.attempt},
        )

    def stop_job(cmd: Command) -> CommandResult:
        spec = parse_stop_job(cmd.args)
        signalled = runner.stop(spec.job, grace_s=spec.grace_s)
        if also_stop is not None:
            signalled = also_stop(spec.job, spec.grace_s) or signalled
        message = f"stopping job {spec.job}" if signalled else f"job {spec.job} is not running"
        return CommandResult(
            ok=True, message=message, data={"job": spec.job, "signalled": signalled}
        )

    return {CommandKind.START_JOB: start_job, CommandKind.STOP_JOB: stop_job}
