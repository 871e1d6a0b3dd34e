"""The torchrun job backend: start and stop this node's share of a training job.

Owns the `start_job`/`stop_job` argument schemas, the torchrun argument list, the child
environment, and the lifecycle of each launched torchrun (its own session and process group,
output captured to a log file and a bounded tail, graceful stop with SIGKILL escalation,
reaping). torch is never imported here: torchrun runs as a subprocess.

torchrun starts each worker in a session of its own, so signalling torchrun's process group
does not reach the workers. Every process of a launch is therefore found by ancestry and by a
per-launch marker in its environment (`TRAINGUARD_LAUNCH_ID`, which survives re-parenting when
torchrun itself dies), and signalled one by one.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import os
import re
import signal
import subprocess
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from trainguard.agent.commands import CommandResult, Handler
from trainguard.agent.jobpolicy import JobPolicy, JobRefused
from trainguard.bounds import bad_name_reason
from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.protocol import Command, Event, JobProcess
from trainguard.strict import ConfigError, Invalid, build

__all__ = [
    "JOB_EXIT",
    "LAUNCH_ID_ENV",
    "RESERVED_ENV",
    "JobAlreadyRunning",
    "JobError",
    "JobEvent",
    "JobRunner",
    "StartJob",
    "StopJob",
    "build_env",
    "find_launch_processes",
    "job_handlers",
    "parse_start_job",
    "parse_stop_job",
    "torchrun_argv",
]

log = logging.getLogger("trainguard.agent.jobs")

JOB_EXIT = "job_exit"

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RDZV_CONF_KEY = re.compile(r"[a-z][a-z0-9_]*")
# The agent sets these; a job must not point its ranks at another agent or job name.
# (Other TRAINGUARD_* variables, such as TRAINGUARD_CHAOS, pass through from `env`.)
RESERVED_ENV = frozenset(
    {
        "TRAINGUARD_JOB",
        "TRAINGUARD_ATTEMPT",
        "TRAINGUARD_NODE",
        "TRAINGUARD_AGENT_SOCKET",
        "TRAINGUARD_CONTROL_DIR",
        "TRAINGUARD_CKPT_DIR",
        "TRAINGUARD_LAUNCH_ID",
    }
)
LAUNCH_ID_ENV = "TRAINGUARD_LAUNCH_ID"
# One output line longer than this is cut in the tail (the log file keeps it whole).
_TAIL_LINE_MAX_CHARS = 512
_READ_CHUNK_BYTES = 65536
# After torchrun exits, how long its output pipe may stay open (a stray holder) before the
# exit is reported anyway with the tail read so far.
_DRAIN_AFTER_EXIT_S = 5.0
# Exited jobs stay visible in `processes()` (for the report) until restarted; at most this many.
_MAX_EXITED_KEPT = 16


class JobError(ValueError):
    """A job request that cannot be carried out; the message says what and why."""


class JobAlreadyRunning(JobError):
    """`start` of the very attempt that is already running here (a repeated command)."""


# --- command arguments ---------------------------------------------------------------------


@dataclass(frozen=True)
class StartJob:
    """`start_job` arguments: this node's share of a job, run by torchrun with c10d rendezvous.

    `command` is the training program and its arguments, run as
    `python -m torch.distributed.run <launcher options> *command`.
    """

    job: str
    attempt: int
    command: list[str]
    nproc_per_node: int
    nnodes: int
    rdzv_endpoint: str  # "host:port" of the c10d store, e.g. "10.0.0.1:29500"
    rdzv_id: str
    env: dict[str, str] = field(default_factory=dict)
    ckpt_dir: str | None = None
    cwd: str | None = None
    max_restarts: int = 0
    python: str | None = None  # interpreter that runs torchrun; None = the agent's own
    node_rank: int | None = None  # this node's place in the job's node list (0 = first)
    # Whether this node's torchrun hosts the c10d store. None: the node with node_rank 0 hosts,
    # or the only node; otherwise torch guesses from the endpoint's address (see docs/jobs.md).
    rdzv_host: bool | None = None
    # Address the node advertises to the job (worker store, gloo). None: the endpoint's own
    # address when it is loopback (every node is on this host), else torch's default (FQDN).
    local_addr: str | None = None
    # Extra `--rdzv-conf` keys, e.g. {"join_timeout": "120"}; `is_host` is set by rdzv_host.
    rdzv_conf: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # names end up in file names (`<job>-<attempt>.log`) and metric labels: the one
        # name pattern of trainguard.bounds
        bad = bad_name_reason(self.job)
        if bad is not None:
            raise Invalid("job", bad)
        if self.attempt < 0:
            raise Invalid("attempt", f"must be >= 0, got {self.attempt}")
        if not self.command:
            raise Invalid("command", "must be a non-empty list of strings (the training program)")
        for i, arg in enumerate(self.command):
            if "\0" in arg:
                raise Invalid(f"command[{i}]", "contains a NUL byte")
        if not self.command[0] or self.command[0].startswith("-"):
            # torchrun would read a leading option as its own (e.g. "--standalone")
            raise Invalid(
                "command[0]",
                f"must be the training program's path, not an option: {self.command[0]!r}",
            )
        if self.nproc_per_node < 1:
            raise Invalid("nproc_per_node", f"must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise Invalid("nnodes", f"must be >= 1, got {self.nnodes}")
        if self.max_restarts < 0:
            raise Invalid("max_restarts", f"must be >= 0, got {self.max_restarts}")
        _parse_endpoint(self.rdzv_endpoint)
        if not self.rdzv_id or any(c.isspace() for c in self.rdzv_id):
            raise Invalid("rdzv_id", f"must be a non-empty string without spaces: {self.rdzv_id!r}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise Invalid(
                "node_rank", f"must be in [0, nnodes={self.nnodes}), got {self.node_rank}"
            )
        for name, value in self.env.items():
            if not _ENV_NAME.fullmatch(name):
                raise Invalid(f"env.{name}", "not a valid environment variable name")
            if name in RESERVED_ENV:
                hint = " (use ckpt_dir)" if name == "TRAINGUARD_CKPT_DIR" else ""
                raise Invalid(f"env.{name}", f"is set by the agent{hint}")
            if "\0" in value:
                raise Invalid(f"env.{name}", "contains a NUL byte")
        for key, value in self.rdzv_conf.items():
            if key == "is_host":
                raise Invalid("rdzv_conf.is_host", "set rdzv_host instead")
            if not _RDZV_CONF_KEY.fullmatch(key):
                raise Invalid(f"rdzv_conf.{key}", f"must match {_RDZV_CONF_KEY.pattern}")
            if not value or any(c in value for c in ",= \0"):
                raise Invalid(f"rdzv_conf.{key}", "value must be non-empty, no ',', '=' or spaces")
        for name in ("ckpt_dir", "cwd", "python", "local_addr"):
            value = getattr(self, name)
            if value is not None and (not value or "\0" in value):
                raise Invalid(name, "must be a non-empty string without NUL bytes")

    def is_host(self) -> bool | None:
        """Whether this node hosts the c10d store (None: leave it to torch's guess)."""
        if self.rdzv_host is not None:
            return self.rdzv_host
        if self.node_rank is not None:
            return self.node_rank == 0
        if self.nnodes == 1:
            return True
        return None

    def advertised_addr(self) -> str | None:
        """The `--local-addr` to pass, if any."""
        if self.local_addr is not None:
            return self.local_addr
        host, _ = _parse_endpoint(self.rdzv_endpoint)
        return host if _is_loopback(host) else None


@dataclass(frozen=True)
class StopJob:
    """`stop_job` arguments."""

    job: str
    grace_s: float = 30.0  # SIGTERM now, SIGKILL to the process group after this

    def __post_init__(self) -> None:
        if not self.job:
            raise Invalid("job", "must be a non-empty string")
        if not 0 <= self.grace_s <= 3600:
            raise Invalid("grace_s", f"must be in [0, 3600], got {self.grace_s}")


def parse_start_job(args: Mapping[str, Any]) -> StartJob:
    """Strictly build StartJob from `Command.args`; raises JobError naming the key."""
    return _parse(StartJob, args, "start_job")


def parse_stop_job(args: Mapping[str, Any]) -> StopJob:
    """Strictly build StopJob from `Command.args`; raises JobError naming the key."""
    return _parse(StopJob, args, "stop_job")


def _parse(cls: Any, args: Mapping[str, Any], kind: str) -> Any:
    if not isinstance(args, Mapping):
        raise JobError(f"{kind}: args: expected a mapping, got {type(args).__name__}")
    try:
        return build(cls, dict(args), prefix="args")
    except ConfigError as e:
        raise JobError(f"{kind}: {e}") from None


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port_text = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # "[::1]:29500"
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise Invalid("rdzv_endpoint", f"must be HOST:PORT with a port in 1..65535: {endpoint!r}")
    return host, int(port_text)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --- launch --------------------------------------------------------------------------------


def torchrun_argv(spec: StartJob, *, python: str) -> list[str]:
    """The argument list that launches this node's share of the job (never a shell string)."""
    argv = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(spec.nnodes),
        "--nproc-per-node",
        str(spec.nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        spec.rdzv_endpoint,
        "--rdzv-id",
        spec.rdzv_id,
        "--max-restarts",
        str(spec.max_restarts),
    ]
    conf = dict(spec.rdzv_conf)
    is_host = spec.is_host()
    if is_host is not None:
        # Explicit, so two nodes on one host never both try to serve the store, and a client
        # that starts first waits for the host instead of serving the store itself.
        conf["is_host"] = "true" if is_host else "false"
    if conf:
        argv += ["--rdzv-conf", ",".join(f"{k}={v}" for k, v in sorted(conf.items()))]
    addr = spec.advertised_addr()
    if addr is not None:
        argv += ["--local-addr", addr]
    argv += spec.command
    return argv


def build_env(
    spec: StartJob,
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

    kind: str  # JOB_EXIT
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


class _OutputReader:
    """Drains a child's merged stdout/stderr: appends to the log file, keeps the last lines."""

    def __init__(self, pipe: IO[bytes], log_file: IO[bytes], *, tail_lines: int, name: str):
        self._pipe = pipe
        self._log_file = log_file
        self._lock = threading.Lock()
        self._tail: collections.deque[str] = collections.deque(maxlen=max(tail_lines, 1))
        self._keep = tail_lines > 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                chunk = self._pipe.readline(_READ_CHUNK_BYTES)
                if not chunk:
                    break
                try:
                    self._log_file.write(chunk)
                    self._log_file.flush()
                except (OSError, ValueError) as e:  # a full disk must not stop the draining
                    log.warning("event=job_log_write_failed thread=%s reason=%r", self.name, e)
                if self._keep:
                    text = chunk.decode("utf-8", errors="replace").rstrip("\r\n")
                    with self._lock:
                        self._tail.append(text[:_TAIL_LINE_MAX_CHARS])
        except (OSError, ValueError) as e:
            log.warning("event=job_output_read_failed thread=%s reason=%r", self.name, e)
        finally:
            with contextlib.suppress(OSError):
                self._pipe.close()
            with contextlib.suppress(OSError):
                self._log_file.close()

    @property
    def name(self) -> str:
        return self._thread.name

    def tail(self) -> str:
        if not self._keep:
            return ""
        with self._lock:
            return "\n".join(self._tail)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


@dataclass
class _Job:
    spec: StartJob
    proc: subprocess.Popen[bytes]
    pgid: int
    reader: _OutputReader
    log_path: Path
    launch_id: str
    state: Literal["running", "stopping", "exited"] = "running"
    kill_at: float | None = None  # monotonic deadline for SIGKILL while stopping
    killed: bool = False  # we sent SIGKILL
    stop_requested: bool = False
    exited_at: float | None = None  # monotonic time the leader was reaped
    exit_code: int | None = None


class JobRunner:
    """Runs this node's torchrun processes; `poll()` once per agent loop drives everything.

    Every start passes `policy` first (agent.jobpolicy): who the job runs as and what it
    may run. Thread-safe: the agent loop calls start/stop/poll, the reporter may call
    processes().
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
    ) -> None:
        if output_tail_lines < 0:
            raise ValueError(f"output_tail_lines must be >= 0, got {output_tail_lines}")
        self._node = node_name
        self._work_dir = Path(work_dir)
        self._work_dir.mkdir(parents=True, exist_ok=True)
        self._heartbeat_socket = heartbeat_socket
        self._policy = policy
        self._control_dir = control_dir
        self._clock = clock
        self._tail_lines = output_tail_lines
        self._lock = threading.RLock()
        self._jobs: dict[str, _Job] = {}
        self._pending: list[JobEvent] = []

    @property
    def work_dir(self) -> Path:
        """Where job logs are written."""
        return self._work_dir

    # -- commands ---------------------------------------------------------------------------

    def start(self, spec: StartJob) -> None:
        """Launch torchrun for `spec`; raises JobError if that job already runs here, the
        node's policy refuses it, or the interpreter/working directory is missing."""
        with self._lock:
            current = self._jobs.get(spec.job)
            if (
                current is not None
                and current.state != "exited"
                and current.spec.attempt == spec.attempt
            ):
                raise JobAlreadyRunning(
                    f"job {spec.job!r} attempt {spec.attempt} is already {current.state} on "
                    f"node {self._node} (pid {current.proc.pid})"
                )
            if current is not None and current.state != "exited":
                raise JobError(
                    f"job {spec.job!r} attempt {current.spec.attempt} is already running on "
                    f"node {self._node} (pid {current.proc.pid}, {current.state}); stop it first"
                )
            try:
                user = self._policy.check(
                    env=spec.env,
                    nproc_per_node=spec.nproc_per_node,
                    python=spec.python,
                    program=spec.command[0],
                    cwd=spec.cwd,
                )
            except JobRefused as e:
                log.warning(
                    "event=job_refused node=%s job=%s attempt=%d reason=%r",
                    self._node,
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
            try:
                log_file = log_path.open("ab")
            except OSError as e:
                raise JobError(f"job {spec.job!r}: cannot open log {log_path}: {e}") from None
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    cwd=spec.cwd,
                    env=env,
                    # its own session and process group: stop signals the whole tree,
                    # and a terminal's ^C aimed at the agent never reaches the job
                    start_new_session=True,
                    **user.popen_kwargs(),
                )
            except OSError as e:
                log_file.close()
                raise JobError(
                    f"job {spec.job!r}: cannot launch {python!r} as user {user.name}: {e}"
                ) from None
            if proc.stdout is None:  # pragma: no cover - stdout=PIPE always sets it
                raise JobError("internal: no stdout pipe")
            reader = _OutputReader(
                proc.stdout,
                log_file,
                tail_lines=self._tail_lines,
                name=f"job-output-{spec.job}-{spec.attempt}",
            )
            self._jobs[spec.job] = _Job(
                spec=spec,
                proc=proc,
                pgid=proc.pid,
                reader=reader,
                log_path=log_path,
                launch_id=launch_id,
            )
            self._trim_exited()
        log.info(
            "event=job_started node=%s job=%s attempt=%d pid=%d user=%s uid=%d is_host=%s "
            "log=%s argv=%s",
            self._node,
            spec.job,
            spec.attempt,
            proc.pid,
            user.name,
            user.uid,
            spec.is_host(),
            log_path,
            " ".join(argv),
        )

    def stop(self, job: str, *, grace_s: float = 30.0) -> bool:
        """SIGTERM the job's process group now; `poll()` sends SIGKILL after `grace_s`.

        Non-blocking. Returns False (and does nothing) when the job is not running here, so a
        repeated stop is harmless.
        """
        if grace_s < 0:
            raise JobError(f"grace_s must be >= 0, got {grace_s}")
        with self._lock:
            j = self._jobs.get(job)
            if j is None or j.state == "exited":
                log.info(
                    "event=job_stop_ignored node=%s job=%s reason=not_running", self._node, job
                )
                return False
            now = self._clock.monotonic()
            deadline = now + grace_s
            j.stop_requested = True
            if j.state == "stopping" and j.kill_at is not None and j.kill_at <= deadline:
                return True  # already stopping with an earlier deadline
            j.state = "stopping"
            j.kill_at = deadline
            self._signal(j, signal.SIGTERM)
        log.info(
            "event=job_stopping node=%s job=%s attempt=%d pid=%d grace_s=%g",
            self._node,
            job,
            j.spec.attempt,
            j.proc.pid,
            grace_s,
        )
        return True

    def poll(self) -> list[JobEvent]:
        """Reap exits and escalate overdue stops; returns new `job_exit` events (each once)."""
        with self._lock:
            now = self._clock.monotonic()
            for j in self._jobs.values():
                if j.state == "exited":
                    continue
                if j.exit_code is None:
                    code = None
                    if _has_exited(j.proc):
                        # While the leader is an unreaped zombie its pid and group id cannot
                        # be reused, so end the launch's leftovers (workers orphaned by a
                        # dead launcher) before reaping it.
                        left = self._signal(j, signal.SIGKILL, quiet=True)
                        if left:
                            log.warning(
                                "event=job_leftovers_killed node=%s job=%s attempt=%d count=%d",
                                self._node,
                                j.spec.job,
                                j.spec.attempt,
                                left,
                            )
                        code = j.proc.poll()
                    if code is not None:
                        j.exit_code = code
                        j.exited_at = now
                    elif j.kill_at is not None and now >= j.kill_at and not j.killed:
                        j.killed = True
                        log.warning(
                            "event=job_stop_escalated node=%s job=%s attempt=%d pid=%d "
                            "signal=SIGKILL",
                            self._node,
                            j.spec.job,
                            j.spec.attempt,
                            j.proc.pid,
                        )
                        self._signal(j, signal.SIGKILL)
                if j.exit_code is not None and j.exited_at is not None:
                    drained = j.reader.done()
                    if drained or now - j.exited_at >= _DRAIN_AFTER_EXIT_S:
                        self._finish(j, drained=drained)
            events, self._pending = self._pending, []
        return events

    def processes(self) -> tuple[JobProcess, ...]:
        """The state of every job this node runs (and recently ran), for the report."""
        with self._lock:
            out = [
                JobProcess(
                    job=j.spec.job,
                    attempt=j.spec.attempt,
                    state=j.state,
                    pid=j.proc.pid,
                    exit_code=j.exit_code if j.state == "exited" else None,
                    output_tail=j.reader.tail(),
                )
                for j in self._jobs.values()
            ]
        return tuple(out)

    def launch_processes(self, job: str) -> set[int]:
        """Live pids of the job's current launch (torchrun and its workers); empty when the
        job is not running here. Read from /proc now, so a recycled pid is never in it."""
        with self._lock:
            j = self._jobs.get(job)
            if j is None or j.state == "exited":
                return set()
            leader, launch_id = j.proc.pid, j.launch_id
        return find_launch_processes(leader_pid=leader, launch_id=launch_id)

    def log_path(self, job: str) -> Path | None:
        """Where the job's latest attempt writes its output (None if never started here)."""
        with self._lock:
            j = self._jobs.get(job)
            return None if j is None else j.log_path

    def close(self, *, grace_s: float = 10.0) -> None:
        """Stop every job (SIGTERM, SIGKILL after `grace_s`) and wait until all are reaped.

        Exit events stay queued: a last `poll()` after close returns them.
        """
        with self._lock:
            running = [name for name, j in self._jobs.items() if j.state != "exited"]
        for name in running:
            self.stop(name, grace_s=grace_s)
        # the escalation deadline plus time for SIGKILL to land and the pipes to drain
        deadline = self._clock.monotonic() + grace_s + _DRAIN_AFTER_EXIT_S + 5.0
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
            log.error(
                "event=job_close_timeout node=%s job=%s pid=%d", self._node, j.spec.job, j.proc.pid
            )
            self._signal(j, signal.SIGKILL, quiet=True)
            with contextlib.suppress(subprocess.TimeoutExpired):
                j.proc.wait(timeout=5.0)
        if alive:
            with self._lock:
                events = self.poll()
                self._pending.extend(events)

    # -- internals --------------------------------------------------------------------------

    def _signal(self, j: _Job, sig: signal.Signals, *, quiet: bool = False) -> int:
        """Send `sig` to the launcher's process group and to every other process of the
        launch (torchrun's workers live in sessions of their own); returns how many processes
        besides the leader were signalled."""
        try:
            os.killpg(j.pgid, sig)
        except ProcessLookupError:
            pass  # the leader's group is already gone
        except PermissionError as e:
            if not quiet:
                log.error(
                    "event=job_signal_failed node=%s job=%s pgid=%d signal=%s reason=%s",
                    self._node,
                    j.spec.job,
                    j.pgid,
                    sig.name,
                    e,
                )
        others = find_launch_processes(leader_pid=j.proc.pid, launch_id=j.launch_id)
        others.discard(j.proc.pid)
        sent = 0
        for pid in sorted(others):
            try:
                os.kill(pid, sig)
                sent += 1
            except (ProcessLookupError, PermissionError):
                continue  # gone meanwhile, or not ours to signal
        return sent

    def _finish(self, j: _Job, *, drained: bool) -> None:
        code = j.exit_code
        if code is None:  # pragma: no cover - _finish is only called after the exit
            return
        j.state = "exited"
        j.kill_at = None
        if drained:
            j.reader.join(1.0)
        message = _describe_exit(code)
        if j.killed:
            message += " (SIGKILL after stop grace)"
        elif j.stop_requested:
            message += " (stopped)"
        event = JobEvent(
            kind=JOB_EXIT,
            job=j.spec.job,
            attempt=j.spec.attempt,
            ts=self._clock.now(),
            exit_code=code,
            message=message,
            data={
                "node": self._node,
                "pid": j.proc.pid,
                "stopped": j.stop_requested,
                "killed": j.killed,
                "output_tail": j.reader.tail(),
                "log_path": str(j.log_path),
            },
        )
        self._pending.append(event)
        log.info(
            "event=job_exited node=%s job=%s attempt=%d pid=%d exit_code=%d stopped=%s "
            "killed=%s output_drained=%s",
            self._node,
            j.spec.job,
            j.spec.attempt,
            j.proc.pid,
            code,
            j.stop_requested,
            j.killed,
            drained,
        )

    def _trim_exited(self) -> None:
        exited = [name for name, j in self._jobs.items() if j.state == "exited"]
        for name in exited[: max(0, len(exited) - _MAX_EXITED_KEPT)]:
            del self._jobs[name]


# --- command handlers ----------------------------------------------------------------------


def job_handlers(runner: JobRunner) -> dict[str, Handler]:
    """`start_job` / `stop_job` handlers for `CommandExecutor.register` (agent.commands)."""

    def start_job(cmd: Command) -> CommandResult:
        spec = parse_start_job(cmd.args)
        try:
            runner.start(spec)
        except JobAlreadyRunning as e:
            # the same (job, attempt) again, e.g. re-sent under a new command id: a no-op
            return CommandResult(
                ok=True,
                message=str(e),
                data={"job": spec.job, "attempt": spec.attempt, "already_running": True},
            )
        return CommandResult(
            ok=True,
            message=f"started job {spec.job} attempt {spec.attempt}",
            data={"job": spec.job, "attempt": spec.attempt},
        )

    def stop_job(cmd: Command) -> CommandResult:
        spec = parse_stop_job(cmd.args)
        signalled = runner.stop(spec.job, grace_s=spec.grace_s)
        message = f"stopping job {spec.job}" if signalled else f"job {spec.job} is not running"
        return CommandResult(
            ok=True, message=message, data={"job": spec.job, "signalled": signalled}
        )

    return {"start_job": start_job, "stop_job": stop_job}
