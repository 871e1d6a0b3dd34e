"""A local trainguard cluster on loopback, as real processes: one controller, N sim agents
(active and spare nodes), and the torchrun jobs the controller starts on them.

Used by the demo (`examples/demo.py`), the chaos tests (`tests/e2e/`) and the recovery
benchmarks (`bench/recovery.py`, `bench/soak.py`). It writes configs and tokens into a run
directory (one agent token per node, bound to it; spares are made spares by an operator
call once they report, as a real cluster's operator would), starts every process from an
argument list in a session of its own, waits on conditions with deadlines, talks to the
API over HTTP, injects faults, kills and stops things, and on `close()` ends every process
it started or that descends from one: each carries the environment marker
`TRAINGUARD_DEVCLUSTER=<run id>` (agents pass their environment on to torchrun and its
workers), so processes re-parented after a `kill -9` are found in `/proc` too. It never
imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx

MARKER_ENV = "TRAINGUARD_DEVCLUSTER"
REPO_ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = REPO_ROOT / "examples" / "train.py"
# rank 0 of examples/train.py prints one JSON object per step: {"step": 12, "loss": ...}
_STEP_LINE = re.compile(r'^\{"step": ')

T = TypeVar("T")


class ClusterError(RuntimeError):
    """A cluster process failed to start, or a condition was not met by its deadline."""


def wait_until(
    cond: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
    on_timeout: Callable[[], str] | None = None,
) -> T:
    """Poll `cond` until it returns a truthy value (returned) or `timeout_s` passes
    (ClusterError naming `what`, plus `on_timeout()`'s diagnosis when given)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{on_timeout()}" if on_timeout is not None else ""
            raise ClusterError(f"timed out after {timeout_s:g} s waiting for {what}{extra}")
        time.sleep(interval_s)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_block(span: int, *, host: str = "127.0.0.1", tries: int = 50) -> int:
    """A base port whose `span` consecutive ports are all free now, below the usual
    ephemeral range (so outgoing connections do not take them meanwhile)."""
    rng = secrets.SystemRandom()
    for _ in range(tries):
        base = rng.randrange(20000, 32000 - span)
        ok = True
        for port in range(base, base + span):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise ClusterError(f"no block of {span} free ports found in {tries} tries")


def _sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def marked_pids(run_id: str, *, proc_root: str = "/proc") -> set[int]:
    """Every live process whose environment carries MARKER_ENV=run_id."""
    needle = f"{MARKER_ENV}={run_id}".encode()
    me = os.getpid()
    out: set[int] = set()
    for entry in os.listdir(proc_root):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"{proc_root}/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.add(int(entry))
    return out


def proc_env(pid: int) -> dict[str, str]:
    """The environment of process `pid` ({} when it is gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def _proc_state(pid: int) -> str | None:
    """The one-letter state from /proc/PID/stat (None when gone); Z = zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rfind(b")") + 2 :][:1].decode() or None


@dataclass(frozen=True)
class RankProc:
    """A training worker process of a job, found in /proc."""

    pid: int
    node: str
    rank: int
    attempt: int


@dataclass
class _Proc:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class AgentNode:
    """One agent: its name, role and where its files are."""

    name: str
    role: str
    dir: Path
    socket_dir: Path
    proc: _Proc
    metrics_port: int = 0
    log_offset: int = 0  # where the running agent's lines start in its (appended) log

    @property
    def jobs_dir(self) -> Path:
        return self.dir / "jobs"


@dataclass
class ClusterConfig:
    """What to run. Durations in seconds; every field has a default fit for a laptop demo."""

    active: Sequence[str] = ("node-1", "node-2", "node-3")
    spares: Sequence[str] = ("node-4",)
    gpus: int = 2  # sim GPUs per node
    ib_ports: int = 1
    report_interval_s: float = 0.5
    collect_interval_s: float = 0.5
    tick_interval_s: float = 0.5
    node_silent_after_s: float = 5.0
    stale_after_s: float = 10.0
    rules: Sequence[str] = ()  # rule files; empty = the shipped rules/
    # controller `jobs:` section overrides (checkpoint_timeout_s, stop_grace_s, ...)
    jobs: Mapping[str, Any] = field(default_factory=dict)
    actions: Mapping[str, Any] = field(default_factory=dict)
    safety: Mapping[str, Any] = field(default_factory=dict)
    # controller `lifecycle:` section overrides (auto_repair, preflight_burn_s, ...)
    lifecycle: Mapping[str, Any] = field(default_factory=dict)
    # controller `backend:` section (kind: slurm + its settings); empty = torchrun
    backend: Mapping[str, Any] = field(default_factory=dict)
    agent_stop_grace_s: float = 5.0
    # agents' `standby:` section (a spare keeps a warm standby of the job's module); empty = off
    standby: Mapping[str, Any] = field(default_factory=dict)
    log_level: str = "info"


class DevCluster:
    """A controller and agents on loopback. Use as a context manager (or call close())."""

    def __init__(self, run_dir: Path | str, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.run_dir = Path(run_dir).resolve()
        self.run_id = secrets.token_hex(6)
        self.operator_token = secrets.token_urlsafe(24)
        # one token per node, bound to it: a node's agent speaks for that node only
        self.agent_tokens = {
            name: secrets.token_urlsafe(24) for name in (*self.config.active, *self.config.spares)
        }
        # unix socket paths must stay short: sockets live under /tmp whatever run_dir is
        self.socket_root = Path(tempfile.mkdtemp(prefix="tgdc", dir="/tmp"))
        self.controller_port = 0
        self.rdzv_port_base = 0
        self.controller: _Proc | None = None
        self.agents: dict[str, AgentNode] = {}
        self._extra: list[_Proc] = []
        self._client: httpx.Client | None = None
        self._closed = False

    # --- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> DevCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for a process of this cluster: ours, marked, no systemd socket."""
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET",)}
        env.pop("TRAINGUARD_CHAOS", None)
        env[MARKER_ENV] = self.run_id
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra or {})
        return env

    def start(self, *, timeout_s: float = 60.0) -> None:
        """Write configs, start the controller and every agent, wait until all report.

        The run dir starts empty: one left by an earlier cluster (it holds the marker file
        `.devcluster`) is removed first; any other non-empty directory is refused."""
        if self.run_dir.exists() and any(self.run_dir.iterdir()):
            if not (self.run_dir / ".devcluster").exists():
                raise ClusterError(f"{self.run_dir} is not empty and not a devcluster run dir")
            shutil.rmtree(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / ".devcluster").write_text(self.run_id + "\n")
        self._write_controller_config()
        self.start_controller(timeout_s=timeout_s)
        for name in self.config.active:
            self._add_agent(name, "active")
        for name in self.config.spares:
            self._add_agent(name, "spare")
        for node in self.agents.values():
            self.start_agent(node.name, wait=False)
        for node in self.agents.values():
            self._wait_metrics_port(node, timeout_s=timeout_s)
        names = set(self.agents)
        self.wait(
            lambda: names <= {n["name"] for n in self.nodes() if n.get("reporting")},
            timeout_s=timeout_s,
            what=f"nodes {', '.join(sorted(names))} to report",
        )
        # a spare is one because an operator says so (an agent's role_hint is only a hint)
        for name in self.config.spares:
            self.api("PUT", f"/v1/nodes/{name}/role", json={"role": "spare"})

    def close(self, *, grace_s: float = 5.0) -> None:
        """Stop everything: SIGTERM to the controller and agents, then SIGKILL to every
        marked process still there (torchrun workers included); remove the socket dir."""
        if self._closed:
            return
        self._closed = True
        if self._client is not None:
            self._client.close()
        procs = [p for p in (self.controller, *[a.proc for a in self.agents.values()]) if p]
        procs += self._extra
        for p in procs:
            if p.alive():
                assert p.popen is not None
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGCONT)
                    p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(p.alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.kill_all()
        for p in procs:
            if p.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.popen.wait(timeout=5)
        shutil.rmtree(self.socket_root, ignore_errors=True)

    def kill_all(self, *, timeout_s: float = 10.0) -> None:
        """SIGKILL every process of this cluster until none is left (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = {p for p in marked_pids(self.run_id) if _proc_state(p) not in (None, "Z")}
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            self._reap()
            if time.monotonic() > deadline:
                raise ClusterError(f"processes {sorted(pids)} survived SIGKILL")
            time.sleep(0.05)

    def _reap(self) -> None:
        for p in (self.controller, *[a.proc for a in self.agents.values()], *self._extra):
            if p is not None and p.popen is not None:
                p.popen.poll()

    def leftover_pids(self) -> set[int]:
        """Live (non-zombie) processes of this cluster."""
        return {p for p in marked_pids(self.run_id) if _proc_state(p) not in (None, "Z")}

    # --- the controller -----------------------------------------------------------------------

    def _write_controller_config(self) -> None:
        c = self.config
        (self.run_dir / "tokens.yaml").write_text(
            "tokens:\n"
            f'  - {{name: operator, role: operator, sha256: "{_sha256(self.operator_token)}"}}\n'
            + "".join(
                f"  - {{name: agent-{node}, role: agent, node: {node},"
                f' sha256: "{_sha256(token)}"}}\n'
                for node, token in self.agent_tokens.items()
            )
        )
        os.chmod(self.run_dir / "tokens.yaml", 0o600)
        self.controller_port = free_port()
        span = 16
        self.rdzv_port_base = free_port_block(span)
        # in-process recovery's stores (a re-formed world's rank 0 runs one) get a block too
        jobs = {
            "rdzv_port_base": self.rdzv_port_base,
            "rdzv_port_span": span,
            "in_process_store_port_base": free_port_block(span),
            "in_process_store_port_span": span,
            **c.jobs,
        }
        cfg: dict[str, Any] = {
            "store": {"path": str(self.run_dir / "controller.db")},
            "api": {
                "host": "127.0.0.1",
                "port": self.controller_port,
                "tokens_file": str(self.run_dir / "tokens.yaml"),
            },
            "tick_interval_s": c.tick_interval_s,
            "stale_after_s": c.stale_after_s,
            "node_silent_after_s": c.node_silent_after_s,
            "jobs": jobs,
            "log": {"level": c.log_level},
        }
        if c.rules:
            cfg["rules"] = [str(Path(r).resolve()) for r in c.rules]
        if c.actions:
            cfg["actions"] = dict(c.actions)
        if c.safety:
            cfg["safety"] = dict(c.safety)
        if c.lifecycle:
            cfg["lifecycle"] = dict(c.lifecycle)
        if c.backend:
            cfg["backend"] = dict(c.backend)
        # JSON is YAML: no need to format YAML by hand
        (self.run_dir / "controller.yaml").write_text(json.dumps(cfg, indent=2) + "\n")

    def start_controller(self, *, timeout_s: float = 60.0) -> None:
        """Start (or restart, on the same port and store) the controller; wait for /healthz."""
        if self.controller is not None and self.controller.alive():
            raise ClusterError("the controller is already running")
        script = Path(sys.executable).with_name("trainguard-controller")
        cmd = (
            [str(script)]
            if script.exists()
            else [sys.executable, "-m", "trainguard.controller.main"]
        )
        n = 1 + sum(1 for p in self.run_dir.glob("controller*.log"))
        proc = _Proc(
            "controller",
            [*cmd, "--config", str(self.run_dir / "controller.yaml")],
            self.run_dir / ("controller.log" if n == 1 else f"controller-{n}.log"),
        )
        self._spawn(proc)
        self.controller = proc

        def healthy() -> bool:
            if not proc.alive():
                raise ClusterError(f"the controller exited:\n{proc.log()[-3000:]}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        self.wait(healthy, timeout_s=timeout_s, what="the controller's /healthz")

    def kill_controller(self, sig: int = signal.SIGKILL) -> None:
        assert self.controller is not None and self.controller.popen is not None
        self.controller.popen.send_signal(sig)
        self.controller.popen.wait(timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.controller_port}"

    # --- agents -------------------------------------------------------------------------------

    def _add_agent(self, name: str, role: str) -> AgentNode:
        d = self.run_dir / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "jobs").mkdir(exist_ok=True)
        sock_dir = self.socket_root / name
        sock_dir.mkdir(parents=True, exist_ok=True)
        token_file = d / "agent.token"
        token_file.write_text(self.agent_tokens[name] + "\n")
        os.chmod(token_file, 0o600)
        cfg = {
            "node": {"name": name, "role_hint": role, "advertise_address": "127.0.0.1"},
            "hardware": {
                "gpu_backend": "sim",
                "sim_gpus": self.config.gpus,
                "sim_ib_ports": self.config.ib_ports,
                "collect_interval_s": self.config.collect_interval_s,
                "kmsg_path": "",
            },
            "heartbeat": {"socket_path": str(sock_dir / "hb.sock")},
            "metrics": {"address": "127.0.0.1", "port": 0},
            "controller": {
                "url": self.url,
                "token_file": str(token_file),
                "report_interval_s": self.config.report_interval_s,
                "backoff_max_s": 1.0,
            },
            "jobs": {
                "work_dir": str(d / "jobs"),
                # control_dir: the default, ctl/ beside the socket (1777): the ranks of every
                # user bind there, the agent's launches and Slurm tasks alike
                "stop_grace_s": self.config.agent_stop_grace_s,
                # A dev/test cluster on one machine, often run as root (CI, containers):
                # its jobs may run as root. A real node sets jobs.run_as_user instead.
                "allow_jobs_as_root": os.geteuid() == 0,
                # The example training scripts and this environment's interpreter, so the
                # allow-list is exercised by every demo and e2e run.
                "allowed_paths": [str(REPO_ROOT / "examples"), sys.prefix],
            },
            "log": {"level": self.config.log_level},
        }
        if self.config.standby:
            cfg["standby"] = dict(self.config.standby)
        (d / "agent.yaml").write_text(json.dumps(cfg, indent=2) + "\n")
        script = Path(sys.executable).with_name("trainguard-agent")
        cmd = [str(script)] if script.exists() else [sys.executable, "-m", "trainguard.agent.main"]
        proc = _Proc(name, [*cmd, "--config", str(d / "agent.yaml")], d / "agent.log")
        node = AgentNode(name=name, role=role, dir=d, socket_dir=sock_dir, proc=proc)
        self.agents[name] = node
        return node

    def start_agent(self, name: str, *, wait: bool = True, timeout_s: float = 30.0) -> None:
        """Start (or restart) a node's agent; with `wait`, until it reports again."""
        node = self.agents[name]
        if node.proc.alive():
            raise ClusterError(f"the agent of {name} is already running")
        node.metrics_port = 0
        # a restarted agent appends to its log: read its metrics port after the old lines
        node.log_offset = len(node.proc.log())
        self._spawn(node.proc, append=True)
        if wait:
            self._wait_metrics_port(node, timeout_s=timeout_s)
            since = time.time()
            self.wait(
                lambda: any(
                    n["name"] == name and (n.get("last_report_at") or 0) > since
                    for n in self.nodes()
                ),
                timeout_s=timeout_s,
                what=f"{name} to report again",
            )

    def _wait_metrics_port(self, node: AgentNode, *, timeout_s: float) -> None:
        def port() -> int | None:
            if not node.proc.alive():
                raise ClusterError(f"the agent of {node.name} exited:\n{node.proc.log()[-3000:]}")
            found = re.findall(r"metrics_port=(\d+)", node.proc.log()[node.log_offset :])
            return int(found[-1]) if found else None

        node.metrics_port = self.wait(port, timeout_s=timeout_s, what=f"{node.name}'s metrics")

    def kill_agent(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a node's agent (default SIGKILL: node death, its jobs are left behind)."""
        p = self.agents[name].proc
        assert p.popen is not None
        p.popen.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            p.popen.wait(timeout=30)

    def kill_node(self, name: str) -> list[int]:
        """Node death: SIGKILL the node's agent and every process of its jobs at once."""
        pids = [r.pid for r in self.rank_procs() if r.node == name]
        pids += [p for p in self.leftover_pids() if proc_env(p).get("TRAINGUARD_NODE") == name]
        agent = self.agents[name].proc.popen
        assert agent is not None
        for pid in {agent.pid, *pids}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        agent.wait(timeout=30)
        return sorted(set(pids))

    def inject(self, node: str, kind: str, **fields: Any) -> dict[str, Any]:
        """Inject a fault into a sim agent (its loopback /v1/faults endpoint)."""
        port = self.agents[node].metrics_port
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/faults", json={"kind": kind, **fields}, timeout=10
        )
        if r.status_code != 200:
            raise ClusterError(f"inject {kind} into {node}: {r.status_code} {r.text}")
        out: dict[str, Any] = r.json()
        return out

    # --- processes ----------------------------------------------------------------------------

    def _spawn(self, proc: _Proc, *, append: bool = False) -> None:
        with proc.log_path.open("ab" if append else "wb") as log:
            proc.popen = subprocess.Popen(
                proc.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=str(self.run_dir),
                start_new_session=True,
            )

    def spawn(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start an extra process of the cluster (marked, own session, output to
        `<run_dir>/<name>.log`); close() ends it."""
        proc = _Proc(name, list(argv), self.run_dir / f"{name}.log")
        with proc.log_path.open("wb") as log:
            proc.popen = subprocess.Popen(
                proc.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(env),
                cwd=str(cwd or self.run_dir),
                start_new_session=True,
            )
        self._extra.append(proc)
        return proc.popen

    def rank_procs(self, job: str | None = None) -> list[RankProc]:
        """The live training workers of the cluster's jobs (torchrun's children with RANK)."""
        out = []
        for pid in self.leftover_pids():
            env = proc_env(pid)
            if "RANK" not in env or "TRAINGUARD_NODE" not in env:
                continue
            if job is not None and env.get("TRAINGUARD_JOB") != job:
                continue
            out.append(
                RankProc(
                    pid=pid,
                    node=env["TRAINGUARD_NODE"],
                    rank=int(env["RANK"]),
                    attempt=int(env.get("TRAINGUARD_ATTEMPT", "0")),
                )
            )
        return sorted(out, key=lambda r: (r.attempt, r.rank))

    def signal_rank(self, job: str, rank: int, sig: int) -> RankProc:
        """Signal the newest attempt's worker of `rank` (SIGKILL, SIGSTOP, ...)."""
        procs = [r for r in self.rank_procs(job) if r.rank == rank]
        if not procs:
            raise ClusterError(f"no live worker of job {job} rank {rank}")
        target = max(procs, key=lambda r: r.attempt)
        os.kill(target.pid, sig)
        return target

    # --- the API ------------------------------------------------------------------------------

    @property
    def client(self) -> httpx.Client:
        if self._client is None:
            self._client = httpx.Client(
                base_url=self.url,
                headers={"Authorization": f"Bearer {self.operator_token}"},
                timeout=10,
            )
        return self._client

    def api(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self.client.request(method, path, **kwargs)
        if r.status_code >= 400:
            raise ClusterError(f"{method} {path}: {r.status_code} {r.text}")
        return r.json() if r.content else None

    def nodes(self) -> list[dict[str, Any]]:
        try:
            out: list[dict[str, Any]] = self.api("GET", "/v1/nodes")
        except httpx.HTTPError:
            return []
        return out

    def node(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = self.api("GET", f"/v1/nodes/{name}")
        return out

    def submit_job(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.api("POST", "/v1/jobs", json=dict(spec))
        return out

    def job(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = self.api("GET", f"/v1/jobs/{name}")
        return out

    def incidents(self, *, limit: int = 100) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.api("GET", f"/v1/incidents?limit={limit}")
        return out

    def incident(self, incident_id: int) -> dict[str, Any]:
        out: dict[str, Any] = self.api("GET", f"/v1/incidents/{incident_id}")
        return out

    def restarted_since(self, t: float) -> dict[str, Any] | None:
        """The detail of an incident opened at or after `t` (1 s of clock slack) whose restart
        step succeeded; None while none has. A failed restart raises ClusterError."""
        for inc in self.incidents():
            if inc["opened_at"] < t - 1:
                continue
            detail = self.incident(inc["id"])
            for a in detail["actions"]:
                if a["kind"] == "restart" and a["state"] == "failed":
                    raise ClusterError(f"incident {inc['id']}: restart failed: {a['result']}")
                if a["kind"] == "restart" and a["state"] == "succeeded":
                    return detail
        return None

    def wait(
        self, cond: Callable[[], T | None], *, timeout_s: float, what: str, interval_s: float = 0.1
    ) -> T:
        return wait_until(
            cond, timeout_s=timeout_s, what=what, interval_s=interval_s, on_timeout=self.diagnose
        )

    def wait_job(
        self, name: str, cond: Callable[[dict[str, Any]], bool], *, timeout_s: float, what: str
    ) -> dict[str, Any]:
        """Poll the job's view until `cond(view)` holds; tolerates a controller restarting."""

        def check() -> dict[str, Any] | None:
            try:
                view = self.job(name)
            except (httpx.HTTPError, ClusterError):
                return None
            return view if cond(view) else None

        return self.wait(check, timeout_s=timeout_s, what=what)

    def diagnose(self) -> str:
        """A short state dump for a failed wait: job and incident views, log tails."""
        lines = []
        with contextlib.suppress(Exception):
            lines.append("jobs: " + json.dumps(self.api("GET", "/v1/jobs"))[:2000])
        with contextlib.suppress(Exception):
            for inc in self.incidents(limit=10):
                lines.append(f"incident {inc['id']} {inc['rule']} {inc['target']} {inc['state']}")
        if self.controller is not None:
            tail = self.controller.log().splitlines()[-25:]
            lines.append("controller log tail:\n  " + "\n  ".join(tail))
        return "\n".join(lines)

    # --- job output ---------------------------------------------------------------------------

    def job_logs(self, job: str) -> Iterator[tuple[str, int, Path]]:
        """(node, attempt, path) of every log of the job on every node."""
        for node in self.agents.values():
            for path in sorted(node.jobs_dir.glob(f"{job}-*.log")):
                attempt = path.stem.rsplit("-", 1)[1]
                if attempt.isdigit():
                    yield node.name, int(attempt), path

    def step_lines(self, job: str) -> list[tuple[int, dict[str, Any]]]:
        """(attempt, line) for every per-step JSON line rank 0 printed, in attempt order."""
        out: list[tuple[int, dict[str, Any]]] = []
        for _, attempt, path in self.job_logs(job):
            out += [(attempt, line) for line in read_step_lines(path)]
        return sorted(out, key=lambda x: x[0])


def restart_result(detail: Mapping[str, Any]) -> tuple[float, int | None]:
    """(when the restart step succeeded, the lost steps it reported) from an incident detail."""
    entry = next(
        e
        for e in detail["timeline"]
        if e["kind"] == "action_succeeded" and "step restart" in e["message"]
    )
    lost = re.search(r"lost steps (\d+)", entry["message"])
    return entry["ts"], int(lost.group(1)) if lost else None


_DECODER = json.JSONDecoder()


def read_step_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON step lines (`{"step": ...}`) in a log of examples/train.py; a line cut short
    by a kill is ignored."""
    out: list[dict[str, Any]] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    for raw in text.splitlines():
        line = raw.strip()
        if not _STEP_LINE.match(line):
            continue
        with contextlib.suppress(ValueError):
            # the line's JSON object; anything after it (another process's output that
            # landed on the same line of the shared log) is not part of it
            obj, _ = _DECODER.raw_decode(line)
            if isinstance(obj, dict) and isinstance(obj.get("step"), int):
                out.append(obj)
    return out


def compare_losses(
    runs: Sequence[Sequence[Mapping[str, Any]]], reference: Sequence[Mapping[str, Any]]
) -> list[str]:
    """Mismatches between every step line of `runs` and the reference run's line for the same
    step (loss compared by its exact repr: train.py prints floats with repr). Empty list =
    every logged loss equals the reference bitwise."""
    ref = {int(x["step"]): repr(x["loss"]) for x in reference}
    problems = []
    for lines in runs:
        for x in lines:
            step = int(x["step"])
            if step not in ref:
                problems.append(f"step {step}: not in the reference run")
            elif repr(x["loss"]) != ref[step]:
                problems.append(f"step {step}: loss {x['loss']!r} != reference {ref[step]}")
    return problems


__all__ = [
    "MARKER_ENV",
    "REPO_ROOT",
    "TRAIN_SCRIPT",
    "AgentNode",
    "ClusterConfig",
    "ClusterError",
    "DevCluster",
    "RankProc",
    "compare_losses",
    "free_port",
    "marked_pids",
    "read_step_lines",
    "wait_until",
]
