"""The agent's configuration: nested frozen dataclasses, loaded strictly from YAML and flags.

Every field states its unit and why its default. Invariants are checked at load, so a bad
file fails with `FILE: key: reason` instead of misbehaving at 3 a.m.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainguard.bounds import (
    IDENT_PATTERN,
    IDENT_RE,
    LABEL_VALUE_MAX_CHARS,
    MAX_EVENTS_PER_REPORT,
    MAX_MAP_ENTRIES,
    MAX_RANKS_PER_REPORT,
    bad_name_reason,
)
from trainguard.leader import url_list_problem, url_problem
from trainguard.strict import ConfigError, Invalid, apply_overrides, build, load_file

DEFAULT_CONFIG_PATH = "/etc/trainguard/agent.yaml"
DEFAULT_HEARTBEAT_SOCKET = "/run/trainguard/heartbeat.sock"
DEFAULT_JOBS_WORK_DIR = "/var/lib/trainguard/jobs"
# Link-local instance metadata address; AWS IMDS and the GCP metadata server both answer here.
METADATA_BASE_URL = "http://169.254.169.254"
# A rank binds `<control_dir>/tg-ctl-<job, <= 40 chars>-r<rank>-<pid>.sock`: at most 68 bytes
# after the directory and its slash, and a unix socket path must fit 107 bytes.
CONTROL_DIR_MAX_BYTES = 38
# Variables that load code into the interpreter, the dynamic linker or a shell before the
# training program runs: a start_job naming one is refused (jobs.env_deny).
DEFAULT_ENV_DENY = (
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "LD_AUDIT",
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONINSPECT",
    "PYTHONUSERBASE",
    "BASH_ENV",
    "ENV",
    "PERL5OPT",
    "NODE_OPTIONS",
)
_ENV_DENY_ENTRY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
# Upper bound of jobs.max_nproc_per_node: far above any node's GPU or sensible CPU rank count.
MAX_NPROC_PER_NODE_LIMIT = 1024
# Lines of a job's output a report carries: 100 lines of at most 513 characters stay within
# the wire's bound on output_tail (trainguard.bounds.TEXT_MAX_CHARS).
OUTPUT_TAIL_LINES_MAX = 100

GpuBackend = Literal["nvml", "sim"]


def _check_port(key: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise Invalid(key, f"must be within 0..65535, got {port}")


def _check_positive(key: str, value: float) -> None:
    if not value > 0:
        raise Invalid(key, f"must be > 0, got {value}")


@dataclass(frozen=True)
class NodeConfig:
    # Empty means the host name: the controller keys nodes by it, and on a cluster the host
    # name is already unique and known to the scheduler.
    name: str = ""
    # Free-form labels sent with every report (rack, zone, ...); never metric labels.
    labels: dict[str, str] = field(default_factory=dict)
    # A hint for the controller's spare pool; None leaves the decision to the controller.
    role_hint: Literal["active", "spare"] | None = None
    # Address other nodes reach this one at (IP or host name), sent as labels["address"]: the
    # controller uses it for a job's rendezvous endpoint. Empty = not advertised.
    advertise_address: str = ""

    def __post_init__(self) -> None:
        if self.name:
            bad = bad_name_reason(self.name)
            if bad is not None:
                raise Invalid("name", bad)
        if len(self.labels) > MAX_MAP_ENTRIES:
            raise Invalid("labels", f"too many entries: at most {MAX_MAP_ENTRIES}")
        for key, value in self.labels.items():
            if not IDENT_RE.fullmatch(key):
                raise Invalid(f"labels.{key}", f"key must match {IDENT_PATTERN}")
            if len(value) > LABEL_VALUE_MAX_CHARS:
                raise Invalid(
                    f"labels.{key}", f"too long: at most {LABEL_VALUE_MAX_CHARS} characters"
                )
        addr = self.advertise_address
        if addr and (any(c.isspace() for c in addr) or "/" in addr or len(addr) > 253):
            raise Invalid("advertise_address", f"must be an IP address or host name, got {addr!r}")
        if addr and "address" in self.labels:
            raise Invalid("labels.address", "conflicts with node.advertise_address (set only one)")

    def report_labels(self) -> dict[str, str]:
        """The labels sent with every report: `labels`, plus `address` when advertised."""
        out = dict(self.labels)
        if self.advertise_address:
            out["address"] = self.advertise_address
        return out

    def resolved_name(self) -> str:
        return self.name or socket.gethostname()


@dataclass(frozen=True)
class HardwareConfig:
    # "nvml" on real GPU nodes; "sim" for demos, CI and chaos tests (same interfaces).
    gpu_backend: GpuBackend = "nvml"
    # How often the collect loop assembles a snapshot (and pets the watchdog), seconds, and
    # the default interval of every source (collectors.*.interval_s). 1 s matches the report
    # interval: a lost GPU is seen within a second at ~1 % of a core of NVML polling.
    collect_interval_s: float = 1.0
    # sim backend only: number of GPUs / IB ports (8 + 8 is one HGX H100 node).
    sim_gpus: int = 8
    sim_ib_ports: int = 8
    # sim backend only: seed, so a demo or test run is reproducible.
    sim_seed: int = 0
    # sim backend only: also read kernel log lines (XIDs) from this file or FIFO, mapped to
    # the simulated GPUs by PCI address; empty: none. Replays a real dmesg into a demo.
    sim_kmsg_path: str = ""
    # Root of the InfiniBand sysfs tree; configurable so tests use fixture trees.
    ib_sysfs_root: str = "/sys/class/infiniband"
    # Kernel log to read XIDs from; empty disables XID collection (e.g. no CAP_SYSLOG).
    kmsg_path: str = "/dev/kmsg"

    def __post_init__(self) -> None:
        _check_positive("collect_interval_s", self.collect_interval_s)
        if self.sim_gpus < 0:
            raise Invalid("sim_gpus", f"must be >= 0, got {self.sim_gpus}")
        if self.sim_ib_ports < 0:
            raise Invalid("sim_ib_ports", f"must be >= 0, got {self.sim_ib_ports}")


@dataclass(frozen=True)
class SourceConfig:
    # Seconds between calls of this source; null = hardware.collect_interval_s.
    interval_s: float | None = None
    # Seconds one call may take before the source is marked stale (metric, event, report);
    # the other sources, reports and the watchdog go on. Far above a healthy call (an 8-GPU
    # NVML read takes tens of ms, sysfs and the kernel log less) and short enough that a
    # GPU gone off the bus stales its source well inside the node-silent window.
    deadline_s: float = 5.0

    def __post_init__(self) -> None:
        if self.interval_s is not None:
            _check_positive("interval_s", self.interval_s)
        _check_positive("deadline_s", self.deadline_s)

    def resolved_interval_s(self, collect_interval_s: float) -> float:
        return self.interval_s if self.interval_s is not None else collect_interval_s


@dataclass(frozen=True)
class CollectorsConfig:
    # Each source runs in its own worker on its own schedule, with its own deadline.
    # NVML: GPU and NVLink values (one NVML pass reads them all).
    gpu: SourceConfig = field(default_factory=SourceConfig)
    # InfiniBand ports from sysfs.
    ib: SourceConfig = field(default_factory=SourceConfig)
    # XID events from the kernel log (non-blocking reads).
    xid: SourceConfig = field(default_factory=SourceConfig)


@dataclass(frozen=True)
class HeartbeatConfig:
    # Unix datagram socket the trainer ranks send to; /run is tmpfs and cleaned at boot.
    socket_path: str = DEFAULT_HEARTBEAT_SOCKET
    # File mode of the socket, octal string. 0666: every local user's ranks may send (Slurm
    # and hand-started jobs of ordinary users are watched with no setup). Sound because a
    # heartbeat is not trusted for what it claims: the kernel names the sending process and
    # its uid, and a process speaks only for its own job (agent.senders, docs/security.md).
    # "0660" with `socket_group` narrows the senders to one group.
    socket_mode: str = "0666"
    # Group that owns the socket (name or number); empty = the agent's own group, or, with a
    # socket_mode others may not write, the primary group of jobs.run_as_user (its ranks
    # must send).
    socket_group: str = ""
    # A rank silent this long, seconds, is forgotten (its metrics disappear). Long enough
    # that a rank inside a multi-minute checkpoint or eval is still reported as silent
    # (heartbeat_age_s grows) so the controller's rank-silent rule can fire first.
    rank_timeout_s: float = 600.0
    # At most this many (job, rank) pairs are tracked: bounds memory against a flood of
    # invented ranks. 8 GPUs rarely run more than 8 ranks; 256 leaves room for CPU ranks.
    max_ranks: int = 256
    # Per sending process, datagrams per second accepted before decoding (token bucket);
    # a rank sends once per step, so 200/s allows 5 ms steps and stops a runaway loop.
    per_sender_rate_hz: float = 200.0
    # All senders together, datagrams per second read from the socket; above it the
    # kernel buffer fills and senders (non-blocking) drop: bounded CPU under any flood.
    max_rate_hz: float = 5000.0

    def __post_init__(self) -> None:
        if not self.socket_path:
            raise Invalid("socket_path", "must not be empty")
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            raise Invalid(
                "socket_mode", f"must be an octal string like '0666', got {self.socket_mode!r}"
            ) from None
        if not 0 <= mode <= 0o777:
            raise Invalid("socket_mode", f"must be within 0000..0777, got {self.socket_mode!r}")
        _check_positive("rank_timeout_s", self.rank_timeout_s)
        if not 1 <= self.max_ranks <= MAX_RANKS_PER_REPORT:
            raise Invalid(
                "max_ranks", f"must be in [1, {MAX_RANKS_PER_REPORT}], got {self.max_ranks}"
            )
        _check_positive("per_sender_rate_hz", self.per_sender_rate_hz)
        _check_positive("max_rate_hz", self.max_rate_hz)

    @property
    def mode(self) -> int:
        return int(self.socket_mode, 8)


@dataclass(frozen=True)
class MetricsConfig:
    # Prometheus scrapes /metrics here. 0.0.0.0 because Prometheus runs on another host;
    # the fault endpoint on the same server accepts loopback clients only.
    address: str = "0.0.0.0"
    # 9500: clear of node_exporter (9100) and dcgm-exporter (9400). 0 picks a free port.
    port: int = 9500

    def __post_init__(self) -> None:
        _check_port("port", self.port)


@dataclass(frozen=True)
class ControllerConfig:
    # Controller base URL; empty (and no `urls`) = export-only mode (no reports, no commands).
    url: str = ""
    # Several controllers (an HA leader and its standbys), instead of `url`: base URLs tried in
    # this order. Reports go to the current one; a standby's 503 naming the leader moves the
    # agent there at once, but only to a URL of this list (a standby cannot steer a node to a
    # host its operator did not name); an unreachable one moves it to the next (docs/agent.md).
    urls: list[str] = field(default_factory=list)
    # File holding the bearer token (mode 0600); required when `url` or `urls` is set. The
    # same token (or client certificate) is presented to every controller.
    token_file: str = ""
    # Seconds between reports. 1 s keeps command delivery and fault detection within the
    # 2 s detection target while 2,000 nodes stay well inside the controller's budget.
    report_interval_s: float = 1.0
    # Seconds for one POST (connect + response). Short, so a hung controller costs one
    # report, not the loop; reports are retried anyway.
    timeout_s: float = 5.0
    # Cap on the retry back-off while the controller is down, seconds: a controller coming
    # back is told about the node within ~30 s even after a long outage.
    backoff_max_s: float = 30.0
    # Events carried by one report; the rest ride on the next ones (bounds body size).
    max_events_per_report: int = 500
    # Events kept while unacknowledged; when full the oldest are dropped and counted.
    # 10,000 is hours of XIDs from a sick node and a few MB of memory at most.
    spool_max_events: int = 10_000
    # CA bundle to verify the controller's TLS certificate; empty = system store.
    ca_file: str = ""
    # Client certificate (PEM) naming this node (CN or its one DNS name) and its key, for a
    # controller with api.tls_client_ca_file (mutual TLS): the certificate then speaks for
    # the node instead of a token. Both or neither; https:// only.
    tls_cert_file: str = ""
    tls_key_file: str = ""

    def __post_init__(self) -> None:
        if self.url and self.urls:
            raise Invalid("urls", "set controller.url or controller.urls, not both")
        if self.url:
            bad = url_problem(self.url)
            if bad is not None:
                raise Invalid("url", bad)
        if self.urls:
            problem = url_list_problem(self.urls)
            if problem is not None:
                index, reason = problem
                raise Invalid("urls" if index is None else f"urls[{index}]", reason)
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise Invalid("tls_key_file", "tls_cert_file and tls_key_file go together")
        if self.tls_cert_file:
            plain = [u for u in self.resolved_urls() if not u.startswith("https://")]
            if plain or not self.resolved_urls():
                raise Invalid(
                    "tls_cert_file",
                    "a client certificate needs https:// controller URLs"
                    + (f", got {plain[0]!r}" if plain else ""),
                )
        if self.resolved_urls() and not self.token_file and not self.tls_cert_file:
            raise Invalid(
                "token_file",
                "is required when controller.url or controller.urls is set (or a tls_cert_file)",
            )
        _check_positive("report_interval_s", self.report_interval_s)
        _check_positive("timeout_s", self.timeout_s)
        if self.backoff_max_s < self.report_interval_s:
            raise Invalid(
                "backoff_max_s",
                f"must be >= controller.report_interval_s ({self.report_interval_s})",
            )
        if not 1 <= self.max_events_per_report <= MAX_EVENTS_PER_REPORT:
            raise Invalid(
                "max_events_per_report",
                f"must be in [1, {MAX_EVENTS_PER_REPORT}], got {self.max_events_per_report}",
            )
        if self.spool_max_events < 1:
            raise Invalid("spool_max_events", "must be >= 1")

    def resolved_urls(self) -> tuple[str, ...]:
        """The controllers to report to, in order: `url` alone, or `urls`; () = export-only."""
        return (self.url,) if self.url else tuple(self.urls)


@dataclass(frozen=True)
class JobsConfig:
    # Job output, `<work_dir>/<job>-<attempt>.log`: on disk (not tmpfs) so a crashed job's
    # log survives for the post-mortem. The systemd unit's StateDirectory makes it writable.
    work_dir: str = DEFAULT_JOBS_WORK_DIR
    # Where ranks bind their control sockets (TRAINGUARD_CONTROL_DIR). Empty = `ctl/` in the
    # heartbeat socket's directory (/run/trainguard/ctl), made by the agent with mode 1777
    # like /tmp so every user's ranks can bind there (each in its own `u<uid>/`): under the
    # unit's PrivateTmp the agent cannot see a rank's /tmp.
    control_dir: str = ""
    # SIGTERM -> SIGKILL grace when the agent itself stops a job's older attempt: a start_job
    # of a newer attempt while it runs, or the controller naming a newer attempt
    # (job_attempts). Long enough for an emergency checkpoint of a small job. (The agent's own
    # stop leaves jobs running: the next agent instance re-adopts them.)
    stop_grace_s: float = 10.0
    # Launch each job as a transient systemd unit (systemd-run), outside the agent's cgroup:
    # "auto" = where systemd is PID 1 (/run/systemd/system exists) and the agent is root,
    # "always", "never" (a session and process group of its own; containers, CI).
    transient_units: str = "auto"
    # Output lines kept per job for reports and job_exit events.
    output_tail_lines: int = 40
    # collect_stacks: seconds to wait for all ranks' dumps together (each rank in turn).
    stacks_timeout_s: float = 5.0
    # collect_stacks: most bytes of stack text returned (a report must stay small).
    stacks_max_bytes: int = 16384
    # The user every job runs as (name or uid): its uid, primary group and supplementary
    # groups, plus the heartbeat socket's group. An operator token can start any job, so a
    # root agent must not hand root to it: with the agent as root and this empty, start_job
    # is refused (unless allow_jobs_as_root). A non-root agent runs jobs as itself: empty or
    # that same user. The user needs write access to the job's ckpt_dir (docs/agent.md).
    run_as_user: str = ""
    # Run jobs as root when the agent is root and run_as_user is empty. Off: any operator
    # token would run code as root on every node. For single-machine dev/test clusters.
    allow_jobs_as_root: bool = False
    # Environment variables a start_job may not set (it is refused, naming the variable):
    # they load code into the interpreter or the launcher before the program runs. An entry
    # ending in "*" denies a prefix. Setting the key replaces this list. The variables the
    # agent sets itself (TRAINGUARD_JOB, ...) are refused whatever this says.
    env_deny: list[str] = field(default_factory=lambda: list(DEFAULT_ENV_DENY))
    # Executables or directories a job's interpreter (`python`) and program (`command[0]`,
    # resolved against `cwd`, symlinks resolved) must lie under; the agent's own interpreter
    # is always allowed. Empty = no restriction (a WARNING at start): any program an operator
    # names can run. List the training code and the venvs, never a path the job user can write.
    allowed_paths: list[str] = field(default_factory=list)
    # Most processes (ranks) one job may start on this node: a GPU node has 8, a CPU job a
    # few dozen; a larger nproc_per_node is refused instead of forking the node to death.
    max_nproc_per_node: int = 64

    def __post_init__(self) -> None:
        if not self.work_dir:
            raise Invalid("work_dir", "must not be empty")
        if any(c.isspace() or c == "\0" for c in self.run_as_user):
            raise Invalid("run_as_user", f"must be a user name or uid, got {self.run_as_user!r}")
        for i, entry in enumerate(self.env_deny):
            if not _ENV_DENY_ENTRY.fullmatch(entry):
                raise Invalid(
                    f"env_deny[{i}]",
                    f"must be a variable name, or a prefix ending in '*', got {entry!r}",
                )
        for i, path in enumerate(self.allowed_paths):
            if not path.startswith("/") or "\0" in path:
                raise Invalid(f"allowed_paths[{i}]", f"must be an absolute path, got {path!r}")
        if not 1 <= self.max_nproc_per_node <= MAX_NPROC_PER_NODE_LIMIT:
            raise Invalid(
                "max_nproc_per_node",
                f"must be in [1, {MAX_NPROC_PER_NODE_LIMIT}], got {self.max_nproc_per_node}",
            )
        if len(self.control_dir.encode()) > CONTROL_DIR_MAX_BYTES:
            raise Invalid(
                "control_dir",
                f"too long for unix socket paths: {len(self.control_dir.encode())} bytes "
                f"(at most {CONTROL_DIR_MAX_BYTES})",
            )
        if not 0 <= self.stop_grace_s <= 3600:
            raise Invalid("stop_grace_s", f"must be in [0, 3600], got {self.stop_grace_s}")
        if self.transient_units not in ("auto", "always", "never"):
            raise Invalid(
                "transient_units",
                f"must be one of auto, always, never, got {self.transient_units!r}",
            )
        if not 0 <= self.output_tail_lines <= OUTPUT_TAIL_LINES_MAX:
            raise Invalid(
                "output_tail_lines",
                f"must be in [0, {OUTPUT_TAIL_LINES_MAX}], got {self.output_tail_lines}",
            )
        _check_positive("stacks_timeout_s", self.stacks_timeout_s)
        if self.stacks_max_bytes < 1024:
            raise Invalid("stacks_max_bytes", f"must be >= 1024, got {self.stacks_max_bytes}")


PreemptionProvider = Literal["none", "aws", "gcp"]


@dataclass(frozen=True)
class PreemptionConfig:
    # Which metadata service announces preemption: "aws" (IMDSv2 spot instance-action),
    # "gcp" (instance/preempted, maintenance-event), or "none" (off: not every node is a VM).
    provider: PreemptionProvider = "none"
    # Metadata service base URL; empty = the link-local address (tests point it elsewhere).
    base_url: str = ""
    # Seconds between polls. AWS warns 2 minutes ahead, GCP only 30 s: 2 s costs two local
    # HTTP requests and leaves most of GCP's notice for the emergency checkpoint.
    poll_interval_s: float = 2.0
    # Seconds for one metadata request; short, the service is on the host.
    timeout_s: float = 1.0
    # Seconds one poll (up to three requests: token, read, retry) may take before the
    # preemption source is marked stale, like the hardware sources (collectors.*).
    deadline_s: float = 5.0

    def __post_init__(self) -> None:
        if self.base_url and not self.base_url.startswith(("http://", "https://")):
            raise Invalid("base_url", f"must start with http:// or https://, got {self.base_url!r}")
        _check_positive("poll_interval_s", self.poll_interval_s)
        _check_positive("timeout_s", self.timeout_s)
        if self.timeout_s > self.poll_interval_s:
            raise Invalid(
                "timeout_s", f"must not exceed preemption.poll_interval_s ({self.poll_interval_s})"
            )
        if self.deadline_s < self.timeout_s:
            raise Invalid("deadline_s", f"must be >= preemption.timeout_s ({self.timeout_s})")

    def resolved_base_url(self) -> str:
        return (self.base_url or METADATA_BASE_URL).rstrip("/")


@dataclass(frozen=True)
class LogConfig:
    # "debug" adds one line per report; "info" logs state changes only.
    level: Literal["debug", "info", "warning", "error"] = "info"


@dataclass(frozen=True)
class PreflightConfig:
    # Interpreter that runs the compute burn and the all-reduce in child processes (torch with
    # CUDA on a GPU node; the agent itself never loads torch); "" = the agent's own.
    python: str = ""
    # Seconds a check's child may take beyond its measuring time (interpreter, torch import,
    # CUDA and NCCL start-up: tens of seconds on an 8-GPU node) before it is killed.
    startup_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        _check_positive("startup_timeout_s", self.startup_timeout_s)


@dataclass(frozen=True)
class RepairConfig:
    # Whether a `repair` command may reboot the node: a reboot ends everything on it, so a
    # node opts in; off, the command is refused with a message that names this key.
    allow_reboot: bool = False
    # Seconds one GPU reset (nvidia-smi --gpu-reset) or the reboot call may take.
    reset_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _check_positive("reset_timeout_s", self.reset_timeout_s)


_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass(frozen=True)
class StandbyConfig:
    # Keep a warm standby process on this node while it is a spare (docs/agent.md, "Warm
    # standbys"): off by default, as it holds memory (~one interpreter with torch imported).
    enabled: bool = False
    # The job's interpreter (torch and trainguard installed); "" = the agent's own.
    python: str = ""
    # The job's entry module, imported ahead of time and run as __main__ on assignment.
    module: str = ""
    # Arguments the entry module gets (before `--membership JSON`), at most 64.
    args: tuple[str, ...] = ()
    # Working directory of the standby ("" = the agent's).
    cwd: str = ""
    # Standbys kept at once: 0 or 1 (one is enough to replace one failed node quickly).
    max_standbys: int = 1
    # Seconds from start to ready (torch + module imported) before the standby is replaced.
    ready_timeout_s: float = 120.0
    # First wait after a standby dies before it is restarted, doubled per death up to
    # max_backoff_s (a broken module must not fork-loop the node).
    restart_backoff_s: float = 5.0
    max_backoff_s: float = 300.0

    def __post_init__(self) -> None:
        _check_positive("ready_timeout_s", self.ready_timeout_s)
        _check_positive("restart_backoff_s", self.restart_backoff_s)
        if self.max_backoff_s < self.restart_backoff_s:
            raise Invalid("max_backoff_s", "must be >= standby.restart_backoff_s")
        if self.max_standbys not in (0, 1):
            raise Invalid("max_standbys", "must be 0 or 1")
        if len(self.args) > 64 or any(len(a) > 4096 for a in self.args):
            raise Invalid("args", "at most 64 arguments of at most 4096 characters")
        if self.module and not _MODULE_NAME.match(self.module):
            raise Invalid("module", f"not a dotted module name: {self.module!r}")
        if self.enabled and not self.module:
            raise Invalid("module", "required when standby.enabled is true")


@dataclass(frozen=True)
class AgentConfig:
    node: NodeConfig = field(default_factory=NodeConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    collectors: CollectorsConfig = field(default_factory=CollectorsConfig)
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    jobs: JobsConfig = field(default_factory=JobsConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    repair: RepairConfig = field(default_factory=RepairConfig)
    standby: StandbyConfig = field(default_factory=StandbyConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        if self.heartbeat.rank_timeout_s <= self.hardware.collect_interval_s:
            raise Invalid(
                "heartbeat.rank_timeout_s",
                f"must exceed hardware.collect_interval_s ({self.hardware.collect_interval_s})",
            )
        if self.heartbeat.rank_timeout_s <= self.controller.report_interval_s:
            raise Invalid(
                "heartbeat.rank_timeout_s",
                f"must exceed controller.report_interval_s ({self.controller.report_interval_s})",
            )


def load_config(
    path: str | None, *, overrides: dict[str, Any] | None = None
) -> tuple[AgentConfig, str]:
    """Load the config and apply flag overrides; returns (config, source it came from).

    `path=None` means the default path, which may be absent (then defaults + flags apply);
    an explicitly given path that does not exist is an error.
    """
    overrides = overrides or {}
    if path is None:
        if Path(DEFAULT_CONFIG_PATH).exists():
            return load_file(AgentConfig, DEFAULT_CONFIG_PATH, overrides=overrides), (
                DEFAULT_CONFIG_PATH
            )
        source = "(flags)"
        return build(AgentConfig, apply_overrides({}, overrides, source=source), source=source), (
            source
        )
    return load_file(AgentConfig, path, overrides=overrides), path


__all__ = [
    "DEFAULT_CONFIG_PATH",
    "DEFAULT_ENV_DENY",
    "DEFAULT_HEARTBEAT_SOCKET",
    "DEFAULT_JOBS_WORK_DIR",
    "METADATA_BASE_URL",
    "AgentConfig",
    "CollectorsConfig",
    "ConfigError",
    "ControllerConfig",
    "HardwareConfig",
    "HeartbeatConfig",
    "JobsConfig",
    "LogConfig",
    "MetricsConfig",
    "NodeConfig",
    "PreemptionConfig",
    "PreflightConfig",
    "RepairConfig",
    "SourceConfig",
    "StandbyConfig",
    "load_config",
]
