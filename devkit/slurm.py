"""A real Slurm cluster on one machine, for the Slurm backend's tests, demo and benchmark:
munged, slurmctld and one slurmd per node name (n1..n4 by default), every daemon in the
foreground as a child of this process, on free loopback ports, with its files in one run dir;
and `SlurmSite`, that cluster plus a trainguard controller (Slurm backend) and sim agents.

The spare nodes are held in a reservation (`trainguard_spares`), so general work cannot take
them: what docs/slurm.md asks of a real site. Needs root (slurmd runs jobs as their user) and
the Debian packages slurmctld, slurmd, slurm-client and munge (`install_packages`). Every
daemon and every process Slurm starts for a job carries the environment marker
TRAINGUARD_DEVCLUSTER=<run id>, so `close()` finds and ends them all, also after a kill.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.devkit.devcluster import (
    MARKER_ENV,
    REPO_ROOT,
    ClusterConfig,
    ClusterError,
    DevCluster,
    free_port_block,
    marked_pids,
    proc_env,
    wait_until,
)

DEB_PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
_DAEMONS = ("munged", "slurmctld", "slurmd")
_CLIENTS = ("sbatch", "scontrol", "squeue", "sinfo", "srun")
SPARE_RESERVATION = "trainguard_spares"
SBATCH_EXAMPLE = REPO_ROOT / "examples" / "slurm" / "train.sbatch"
# the unprivileged user the demo and the tests submit as: a site's jobs are an ordinary
# user's, and trainguard must watch them (docs/slurm.md)
SUBMIT_USER = "trainguard-user"


def ensure_user(name: str = SUBMIT_USER) -> pwd.struct_passwd:
    """The system user `name`, created (no home, no login) when missing. Needs root."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
            timeout=30,
        )
        return pwd.getpwnam(name)


class OpenPaths:
    """Search permission for others (o+x) on the directories above some paths, so an
    unprivileged user reaches the interpreter, the code and the run dir; `restore()` puts
    every changed mode back. Only search: nothing becomes listable or writable."""

    def __init__(self) -> None:
        self._changed: dict[Path, int] = {}

    def open(self, *paths: Path | str) -> None:
        for path in paths:
            for p in dict.fromkeys((Path(os.path.abspath(path)), Path(path).resolve())):
                self._open_dirs([p, *p.parents] if p.is_dir() else list(p.parents))

    def _open_dirs(self, dirs: list[Path]) -> None:
        for d in dirs:
            mode = d.stat().st_mode & 0o7777
            if not mode & 0o001 and d not in self._changed:
                self._changed[d] = mode
                os.chmod(d, mode | 0o001)

    def restore(self) -> None:
        for d, mode in reversed(list(self._changed.items())):
            with contextlib.suppress(OSError):
                os.chmod(d, mode)
        self._changed.clear()


def missing_reason() -> str | None:
    """Why a local Slurm cluster cannot start here (not root, a binary missing); None: it can."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs jobs as their user)"
    missing = [b for b in (*_DAEMONS, *_CLIENTS) if _which(b) is None]
    if missing:
        return (
            f"Slurm binaries not found: {', '.join(missing)} (Debian packages:"
            f" {' '.join(DEB_PACKAGES)})"
        )
    return None


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def install_packages(*, timeout_s: float = 600.0) -> None:
    """apt-get install the Debian packages a local cluster needs (root only; a no-op when
    they are installed)."""
    missing = [
        p
        for p in DEB_PACKAGES
        if subprocess.run(["dpkg", "-s", p], capture_output=True, check=False).returncode != 0
    ]
    if not missing:
        return
    if os.geteuid() != 0:
        raise ClusterError(f"not root: cannot install {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=timeout_s)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
        check=True,
        env=env,
        timeout=timeout_s,
    )


@dataclass
class SlurmConfig:
    """What to run. The defaults make a 4-node cluster whose last node is the spare."""

    nodes: Sequence[str] = ("n1", "n2", "n3", "n4")
    spares: Sequence[str] = ("n4",)
    partition: str = "gpu"
    reservation: str = SPARE_RESERVATION
    # After a requeue a job may start again only after cred_expire: 10 s, not 120.
    cred_expire_s: int = 10
    # SIGTERM -> SIGKILL on a requeue or cancel: the trainer's emergency checkpoint fits.
    kill_wait_s: int = 10
    # A slurmd silent this long is marked DOWN by slurmctld itself.
    slurmd_timeout_s: int = 30
    extra_conf: Mapping[str, str] = field(default_factory=dict)


@dataclass
class _Daemon:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


class SlurmCluster:
    """munged + slurmctld + one slurmd per node, on loopback. A context manager."""

    def __init__(
        self, run_dir: Path | str, config: SlurmConfig | None = None, *, run_id: str = ""
    ) -> None:
        self.config = config or SlurmConfig()
        self.run_dir = Path(run_dir).resolve()
        # the marker of the processes this cluster starts; a DevCluster's run id puts the
        # job processes under that cluster's cleanup as well
        self.run_id = run_id or os.urandom(6).hex()
        self.daemons: dict[str, _Daemon] = {}
        self.ctld_port = 0
        self.node_ports: dict[str, int] = {}
        self.submit_users: list[str] = []  # whose jobs close() cancels, besides root's
        self._closed = False

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def conf_path(self) -> Path:
        return self.run_dir / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.run_dir / "munge" / "munge.sock"

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for Slurm commands of this cluster (and for sbatch: a job gets
        the submitter's environment, marker included)."""
        env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        env["SLURM_CONF"] = str(self.conf_path)
        env[MARKER_ENV] = self.run_id
        env.update(extra or {})
        return env

    # --- start ------------------------------------------------------------------------------

    def start(self, *, timeout_s: float = 60.0) -> None:
        """Write the key and slurm.conf, start the daemons, wait until every node is idle,
        and hold the spares in the reservation."""
        why = missing_reason()
        if why is not None:
            raise ClusterError(why)
        for sub in ("munge", "state", "spool", "log"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        # 0711: another user's sbatch reaches munged's socket; the key stays root's (0400)
        os.chmod(self.run_dir / "munge", 0o711)  # noqa: S103 - search only, no listing
        key = self.run_dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        self._start_daemon(
            "munged",
            [
                _need("munged"), "--foreground", "--force", f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self.run_dir / 'munge' / 'munged.pid'}",
                f"--log-file={self.run_dir / 'munge' / 'munged.log'}",
                f"--seed-file={self.run_dir / 'munge' / 'munged.seed'}",
            ],
        )  # fmt: skip
        wait_until(self.munge_socket.exists, timeout_s=timeout_s, what="munged's socket")
        span = 1 + len(self.config.nodes)
        base = free_port_block(span)
        self.ctld_port = base
        self.node_ports = {n: base + 1 + i for i, n in enumerate(self.config.nodes)}
        self.conf_path.write_text(self._slurm_conf())
        self._start_daemon(
            "slurmctld", [_need("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf_path)]
        )
        for node in self.config.nodes:
            (self.run_dir / "spool" / node).mkdir(exist_ok=True)
            self._start_daemon(
                f"slurmd-{node}",
                [_need("slurmd"), "-D", "-f", str(self.conf_path), "-N", node],
            )
        wait_until(
            self._all_idle,
            timeout_s=timeout_s,
            what=f"Slurm nodes {', '.join(self.config.nodes)} to be idle",
            interval_s=0.3,
            on_timeout=self.diagnose,
        )
        if self.config.spares:
            self.scontrol(
                "create", "reservation", f"reservationname={self.config.reservation}",
                f"nodes={','.join(self.config.spares)}", "starttime=now",
                "duration=infinite", "users=root", "flags=ignore_jobs",
            )  # fmt: skip

    def _slurm_conf(self) -> str:
        c = self.config
        host = socket.gethostname()
        d = self.run_dir
        lines = {
            "ClusterName": "tglocal",
            "SlurmctldHost": f"{host}(127.0.0.1)",
            "SlurmctldPort": str(self.ctld_port),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.munge_socket},cred_expire={c.cred_expire_s}",
            "StateSaveLocation": str(d / "state"),
            "SlurmdSpoolDir": str(d / "spool" / "%n"),
            "SlurmctldPidFile": str(d / "slurmctld.pid"),
            "SlurmdPidFile": str(d / "slurmd-%n.pid"),
            "SlurmctldLogFile": str(d / "log" / "slurmctld.log"),
            "SlurmdLogFile": str(d / "log" / "slurmd-%n.log"),
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "AccountingStorageType": "accounting_storage/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_Core",
            "MpiDefault": "none",
            "MailProg": "/bin/true",
            # 1, not 2: a node an admin (or trainguard) set DOWN stays down
            "ReturnToService": "1",
            "SlurmdTimeout": str(c.slurmd_timeout_s),
            "KillWait": str(c.kill_wait_s),
            "SchedulerParameters": "sched_min_interval=100000",
            **c.extra_conf,
        }
        text = "".join(f"{k}={v}\n" for k, v in lines.items())
        for node in c.nodes:
            text += (
                f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1"
                f" Port={self.node_ports[node]} CPUs=1 RealMemory=500 State=UNKNOWN\n"
            )
        text += (
            f"PartitionName={c.partition} Nodes={','.join(c.nodes)} Default=YES"
            " MaxTime=INFINITE State=UP\n"
        )
        return text

    def _start_daemon(self, name: str, argv: list[str]) -> None:
        log_path = self.run_dir / "log" / f"{name}.out"
        d = _Daemon(name, argv, log_path)
        with log_path.open("ab") as log:
            d.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env(),
                cwd=str(self.run_dir),
                start_new_session=True,
            )
        self.daemons[name] = d

    def _all_idle(self) -> bool:
        for name, d in self.daemons.items():
            if not d.alive():
                raise ClusterError(f"{name} exited:\n{self.diagnose()}")
        try:
            nodes = self.nodes()
        except ClusterError:
            return False
        return all("IDLE" in nodes.get(n, {}).get("state", ()) for n in self.config.nodes)

    # --- commands ---------------------------------------------------------------------------

    def run(self, *argv: str, timeout_s: float = 20.0, check: bool = True) -> str:
        """A Slurm client command of this cluster (argument list, bounded); stdout."""
        try:
            done = subprocess.run(
                [_need(argv[0]), *argv[1:]],
                capture_output=True,
                text=True,
                env=self.env(),
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ClusterError(f"{' '.join(argv)}: no answer within {timeout_s:g} s") from None
        if check and done.returncode != 0:
            raise ClusterError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")
        return done.stdout

    def scontrol(self, *args: str) -> str:
        return self.run("scontrol", *args)

    def nodes(self) -> dict[str, dict[str, Any]]:
        """`sinfo --json` nodes by name: {"state": [...flags], "reason": ...}."""
        doc = json.loads(self.run("sinfo", "--json"))
        out: dict[str, dict[str, Any]] = {}
        for n in doc.get("nodes", []):
            state = n.get("state")
            flags = [state] if isinstance(state, str) else list(state or [])
            flags += list(n.get("state_flags") or [])
            out[str(n["name"])] = {**n, "state": [str(f).upper() for f in flags]}
        return out

    def reservation_nodes(self, name: str = SPARE_RESERVATION) -> list[str]:
        """The nodes of a reservation; [] when it does not exist."""
        text = self.run("scontrol", "show", "reservation", name, "-o", check=False)
        m = re.search(r"\bNodes=(\S+)", text)
        if m is None or m.group(1) == "(null)":
            return []
        return self.run("scontrol", "show", "hostnames", m.group(1)).split()

    def drain_reasons(self) -> dict[str, str]:
        """What `sinfo -R` shows: node -> reason, for every drained or down node."""
        out: dict[str, str] = {}
        for line in self.run("sinfo", "-R", "-h", "-N", "-o", "%N|%E").splitlines():
            node, sep, reason = line.partition("|")
            if sep:
                out[node.strip()] = reason.strip()
        return out

    def jobs(self) -> dict[str, dict[str, Any]]:
        """`squeue --json` jobs by id."""
        doc = json.loads(self.run("squeue", "--json"))
        return {str(j["job_id"]): j for j in doc.get("jobs", [])}

    def job_nodes(self, job_id: str) -> list[str]:
        job = self.jobs().get(job_id)
        if not job or not job.get("nodes"):
            return []
        return self.run("scontrol", "show", "hostnames", str(job["nodes"])).split()

    def sbatch(
        self,
        script: Path | str,
        *args: str,
        options: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        user: str | None = None,
        cwd: Path | str | None = None,
    ) -> str:
        """Submit a batch script with sbatch `options` and the script's own `args`, as `user`
        (runuser; None: as this process's user) from `cwd`; the job id."""
        argv = [_need("sbatch"), "--parsable", *options, str(script), *args]
        if user is not None:
            argv = ["runuser", "-u", user, "--", *argv]
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=self.env(env),
            cwd=None if cwd is None else str(cwd),
            timeout=30,
            check=False,
        )
        if done.returncode != 0:
            raise ClusterError(f"sbatch {script}: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    # --- faults -----------------------------------------------------------------------------

    def task_pids(self, node: str) -> list[int]:
        """Processes Slurm runs for jobs on `node` (their environment names it)."""
        out = []
        for pid in marked_pids(self.run_id):
            env = proc_env(pid)
            if env.get("SLURMD_NODENAME") == node:
                out.append(pid)
        return out

    def kill_node(self, node: str) -> list[int]:
        """Node death under Slurm: SIGKILL the node's slurmd, its job steps' slurmstepd and
        every task it runs, at once."""
        d = self.daemons[f"slurmd-{node}"]
        pids = set(self.task_pids(node))
        pids |= {p for pid in list(pids) if (p := _ppid(pid)) and _is_stepd(p)}
        assert d.popen is not None
        pids.add(d.popen.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        d.popen.wait(timeout=30)
        return sorted(pids)

    def stop_controller(self) -> None:
        """Stop slurmctld (a site whose controller is down)."""
        d = self.daemons["slurmctld"]
        if d.alive():
            assert d.popen is not None
            d.popen.terminate()
            d.popen.wait(timeout=30)

    def start_controller(self, *, timeout_s: float = 30.0) -> None:
        d = self.daemons["slurmctld"]
        if d.alive():
            return
        self._start_daemon("slurmctld", d.argv)
        wait_until(
            lambda: bool(self.nodes()) if self._ctld_answers() else False,
            timeout_s=timeout_s,
            what="slurmctld to answer again",
            interval_s=0.3,
        )

    def _ctld_answers(self) -> bool:
        with contextlib.suppress(ClusterError):
            self.run("sinfo", "-h", timeout_s=5)
            return True
        return False

    # --- teardown ---------------------------------------------------------------------------

    def diagnose(self) -> str:
        lines = []
        for name in ("slurmctld.log",):
            path = self.run_dir / "log" / name
            with contextlib.suppress(OSError):
                lines.append(f"{name} tail:\n  " + "\n  ".join(path.read_text().splitlines()[-15:]))
        for d in self.daemons.values():
            if not d.alive():
                with contextlib.suppress(OSError):
                    tail = d.log_path.read_text(errors="replace").splitlines()[-10:]
                    lines.append(f"{d.name} exited:\n  " + "\n  ".join(tail))
        return "\n".join(lines)

    def close(self, *, grace_s: float = 10.0) -> None:
        """Cancel every job, stop the daemons, SIGKILL whatever of ours is left."""
        if self._closed:
            return
        self._closed = True
        ctld = self.daemons.get("slurmctld")
        if ctld is not None and ctld.alive():
            for user in dict.fromkeys(("root", *self.submit_users)):
                with contextlib.suppress(ClusterError, OSError):
                    self.run("scancel", "--full", "--quiet", "-u", user, timeout_s=10, check=False)
        for d in reversed(list(self.daemons.values())):
            if d.alive():
                assert d.popen is not None
                with contextlib.suppress(ProcessLookupError):
                    d.popen.terminate()
        deadline = time.monotonic() + grace_s
        while any(d.alive() for d in self.daemons.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + grace_s
        while True:
            left = {p for p in marked_pids(self.run_id) if _state(p) not in (None, "Z")}
            if not left:
                break
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            for d in self.daemons.values():
                if d.popen is not None:
                    d.popen.poll()
            if time.monotonic() > deadline:
                raise ClusterError(f"Slurm processes {sorted(left)} survived SIGKILL")
            time.sleep(0.05)
        for d in self.daemons.values():
            if d.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    d.popen.wait(timeout=5)


class SlurmSite:
    """A whole site on one machine: the Slurm cluster, the trainguard controller with its
    Slurm backend, and a sim agent per Slurm node (same names). `nodes[:-len(spares)]` run
    jobs; the spares sit in the spare reservation. A context manager; `close()` ends every
    process of both (one environment marker)."""

    def __init__(
        self,
        run_dir: Path | str,
        *,
        slurm: SlurmConfig | None = None,
        jobs: Mapping[str, Any] | None = None,
        safety: Mapping[str, Any] | None = None,
        lifecycle: Mapping[str, Any] | None = None,
        sync_interval_s: float = 1.0,
        user: str | None = SUBMIT_USER,
    ) -> None:
        self.run_dir = Path(run_dir).resolve()
        # jobs are submitted as this unprivileged user (None: as root), as on a real site
        self.user = user
        self._open_paths = OpenPaths()
        sc = slurm or SlurmConfig()
        active = tuple(n for n in sc.nodes if n not in sc.spares)
        self.cluster = DevCluster(
            self.run_dir / "cluster",
            ClusterConfig(
                active=active,
                spares=tuple(sc.spares),
                safety=dict(safety or {"drain_budget": 100, "breaker_threshold": 100}),
                jobs=dict(jobs or {}),
                lifecycle=dict(lifecycle or {}),
                backend={
                    "kind": "slurm",
                    "slurm": {
                        "slurm_conf": str(self.run_dir / "slurm" / "slurm.conf"),
                        "sync_interval_s": sync_interval_s,
                        "spare_reservation": sc.reservation,
                    },
                },
            ),
        )
        # one marker for both: closing the trainguard cluster ends the job processes too
        self.slurm = SlurmCluster(self.run_dir / "slurm", sc, run_id=self.cluster.run_id)
        if user is not None:
            self.slurm.submit_users.append(user)

    def __enter__(self) -> SlurmSite:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def jobs_dir(self) -> Path:
        """The submitting user's own directory: job output and checkpoints."""
        return self.run_dir / "jobs"

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jobs_dir.mkdir(exist_ok=True)
        if self.user is not None:
            pw = ensure_user(self.user)
            os.chown(self.jobs_dir, pw.pw_uid, pw.pw_gid)
            # the user reaches slurm.conf, munged's socket, the agents' sockets, the code and
            # the interpreter (search only), and writes only its jobs dir
            self._open_paths.open(
                self.jobs_dir, self.cluster.socket_root, REPO_ROOT, Path(sys.executable)
            )
        self.slurm.start()
        self.cluster.start()

    def close(self) -> None:
        try:
            self.cluster.close()
        finally:
            try:
                self.slurm.close()
            finally:
                self._open_paths.restore()

    def submit(
        self, tag: str, args: Sequence[str], *, script: Path = SBATCH_EXAMPLE
    ) -> tuple[str, Path]:
        """sbatch the example (or `script`) as the site's user with the trainer's `args`,
        every rank talking to the agent named like its Slurm node; (job id, its output
        file)."""
        out = self.jobs_dir / f"{tag}-%j.out"
        job_id = self.slurm.sbatch(
            script,
            *args,
            options=[f"--output={out}"],
            env={
                "TG_AGENT_SOCKET_PATTERN": str(self.cluster.socket_root / "%n" / "hb.sock"),
                "TG_CKPT_DIR": str(self.jobs_dir / "ckpt" / tag),
                "TG_PYTHON": sys.executable,
                "TG_REPO": str(REPO_ROOT),
            },
            user=self.user,
            cwd=self.jobs_dir,
        )
        return job_id, Path(str(out).replace("%j", job_id))


_START_LINE = re.compile(r"event=slurm_start job=(\d+) restart=(\d+)")
_DECODER = json.JSONDecoder()


def attempt_lines(path: Path) -> dict[int, list[dict[str, Any]]]:
    """The step lines rank 0 of examples/slurm/train.sbatch printed (`{"step": ...}`), by
    restart count: the output file holds every attempt (--open-mode=append), each after
    its start line. A line cut short by a kill is ignored."""
    out: dict[int, list[dict[str, Any]]] = {}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return out
    restart = 0
    for raw in text.splitlines():
        m = _START_LINE.search(raw)
        if m is not None:
            restart = int(m.group(2))
            continue
        line = raw.strip()
        if not line.startswith('{"step": '):
            continue
        with contextlib.suppress(ValueError):
            obj, _ = _DECODER.raw_decode(line)
            if isinstance(obj, dict) and isinstance(obj.get("step"), int):
                out.setdefault(restart, []).append(obj)
    return out


def _need(name: str) -> str:
    path = _which(name)
    if path is None:
        raise ClusterError(f"{name} not found (Debian packages: {' '.join(DEB_PACKAGES)})")
    return path


def _stat(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _state(pid: int) -> str | None:
    stat = _stat(pid)
    return stat[stat.rfind(b")") + 2 :][:1].decode() or None if stat else None


def _ppid(pid: int) -> int | None:
    stat = _stat(pid)
    if not stat:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def _is_stepd(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"slurmstepd")
    except OSError:
        return False


__all__ = [
    "DEB_PACKAGES",
    "SPARE_RESERVATION",
    "SlurmCluster",
    "SBATCH_EXAMPLE",
    "SlurmConfig",
    "SlurmSite",
    "attempt_lines",
    "install_packages",
    "missing_reason",
]
