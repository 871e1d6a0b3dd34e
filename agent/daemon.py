"""The agent daemon: builds the backends, runs the collect loop, serves, reports, executes.

`Agent.tick()` is one collect iteration (testable on a FakeClock): it takes what each source
finished (`agent.sources`), spools events and publishes a snapshot, never waiting on a source;
`Agent.run()` is the loop that also executes controller commands as they arrive and drives the
job backend. Threads: one worker per source (GPU, IB, XIDs, preemption; each with its own
interval and deadline, so a hung NVML call stales one source, never the loop), heartbeat
reader, HTTP server, reporter (only with a controller), one worker for slow commands
(`collect_stacks`, `preflight`, `repair`: one at a time); everything they share is an
immutable snapshot or guarded by a lock.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import random
import ssl
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard import __version__
from trainguard.agent.collectors.infiniband import SysfsIbCollector
from trainguard.agent.collectors.nvml import NvmlGpuCollector
from trainguard.agent.collectors.xid import KmsgXidSource
from trainguard.agent.commands import CommandExecutor, CommandResult, default_executor
from trainguard.agent.config import (
    DEFAULT_HEARTBEAT_SOCKET,
    DEFAULT_JOBS_WORK_DIR,
    AgentConfig,
    ControllerConfig,
)
from trainguard.agent.heartbeat import HeartbeatServer, TrainerEvent
from trainguard.agent.inprocess import StandbyEnv, inprocess_handlers
from trainguard.agent.jobpolicy import (
    PolicyError,
    policy_from_config,
    prepare_access,
    prepare_control_dir,
)
from trainguard.agent.jobs import JobRunner, job_handlers
from trainguard.agent.metrics import AgentHttpServer, AgentSnapshot, SnapshotCollector, xid_labels
from trainguard.agent.preemption import (
    MetadataProbe,
    PreemptionNotice,
    PreemptionWatcher,
    build_probe,
)
from trainguard.agent.preflight import PreflightRunner, preflight_handler
from trainguard.agent.preflight_backends import WorkerRun, build_workers
from trainguard.agent.repair import (
    RebootRecord,
    RepairBackend,
    SimRepair,
    SystemRepair,
    repair_handler,
)
from trainguard.agent.reporter import EventSpool, Reporter, read_token
from trainguard.agent.senders import JobClaims, SenderResolver
from trainguard.agent.sim import SimHardware
from trainguard.agent.sources import CallOutcome, Source, TakeResult, Transition
from trainguard.agent.stacks import stacks_handler
from trainguard.agent.standby import ProcessLauncher, StandbyPool, keeps_standby
from trainguard.agent.standby_ranks import StandbyRanks
from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.model import (
    EventSource,
    GpuCollection,
    GpuCollector,
    GpuSample,
    HardwareEvent,
    IbCollector,
    IbPortSample,
)
from trainguard.protocol import (
    Command,
    CommandKind,
    Control,
    Event,
    EventKind,
    FaultSpec,
    Report,
    StandbyState,
)
from trainguard.strict import ConfigError
from trainguard.systemd import SystemdNotifier
from trainguard.xid_catalog import XidCatalog

log = logging.getLogger("trainguard.agent")

# (gpu, xid, severity) series counted; a garbled kernel log cannot grow it further
MAX_XID_SERIES = 1024
COMMAND_QUEUE_MAX = 1000
# Commands that wait on the ranks (seconds): run by a worker thread so the collect loop, the
# watchdog and /healthz keep going meanwhile. One at a time, in arrival order.
# The preflight and a repair share the worker: a GPU reset never lands in a burn.
SLOW_COMMANDS = frozenset({CommandKind.COLLECT_STACKS, CommandKind.PREFLIGHT, CommandKind.REPAIR})
# The last report on shutdown carries the stop's own events (job exits); bounded so a dead
# controller cannot hold up the stop (systemd's TimeoutStopSec is 20 s).
FINAL_REPORT_TIMEOUT_S = 2.0
# start() waits this long at most for every source's first result, so /metrics and the first
# report have hardware in them; a source hung from the start only delays READY by this much.
FIRST_RESULTS_WAIT_S = 2.0
# close(): how long one source worker is given to leave its call; a hung one is abandoned.
SOURCE_STOP_WAIT_S = 0.5


class StartupError(RuntimeError):
    """The agent cannot start (message says what and where); main() exits 1."""


@dataclass
class Backends:
    """The hardware side: collectors and event sources (sim or real), and how to close them."""

    gpu: GpuCollector | None
    ib: IbCollector | None
    event_sources: list[tuple[str, EventSource]] = field(default_factory=list)
    sim: SimHardware | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)
    kmsg: KmsgXidSource | None = None  # the kernel log reader, for its refused-record count

    def close(self) -> None:
        for close in self.closers:
            try:
                close()
            except Exception:
                log.exception("event=backend_close_failed")


def build_backends(config: AgentConfig, *, node: str, clock: Clock) -> Backends:
    """The sim backend, or the real NVML/kmsg/sysfs collectors (imported only here)."""
    hw = config.hardware
    if hw.gpu_backend == "sim":
        sim = SimHardware(
            gpus=hw.sim_gpus,
            ib_ports=hw.sim_ib_ports,
            node_name=node,
            seed=hw.sim_seed,
            clock=clock,
        )
        backends = Backends(
            gpu=sim, ib=sim.ib, event_sources=[("xid", sim)], sim=sim, closers=[sim.close]
        )
        if hw.sim_kmsg_path:  # a kernel log replayed into the simulated GPUs
            kmsg = KmsgXidSource(
                path=hw.sim_kmsg_path, bus_to_index=sim.bus_id_to_index, clock=clock
            )
            backends.event_sources.append(("kmsg", kmsg))
            backends.closers.append(kmsg.close)
            backends.kmsg = kmsg
        return backends
    try:
        gpu = NvmlGpuCollector(clock=clock)
    except Exception as e:
        raise StartupError(f"cannot initialise NVML: {type(e).__name__}: {e}") from None
    backends = Backends(gpu=gpu, ib=SysfsIbCollector(root=hw.ib_sysfs_root), closers=[gpu.close])
    if hw.kmsg_path:
        try:
            xid = KmsgXidSource(path=hw.kmsg_path, bus_to_index=gpu.bus_id_to_index, clock=clock)
            backends.event_sources.append(("xid", xid))
            backends.closers.append(xid.close)
            backends.kmsg = xid
        except Exception as e:  # XIDs are lost, GPUs and IB are still watched: say so loudly
            log.error(
                "event=xid_source_unavailable path=%s error=%r",
                hw.kmsg_path,
                f"{type(e).__name__}: {e}",
            )
    return backends


def _load_xid_catalog() -> XidCatalog:
    """The shipped XID catalog, which gives each XID line its `severity` label. It is package
    data: a missing or broken one is an installation error, never a silent start without the
    label (the "fatal XID" panels and alerts select on it)."""
    try:
        return XidCatalog.load()
    except ConfigError as e:
        raise StartupError(f"XID catalog: {e}") from None


def _tls_context(c: ControllerConfig) -> ssl.SSLContext | bool:
    """How the reporter verifies the controller (ca_file or the system store) and, with
    tls_cert_file, the client certificate that names this node (mutual TLS)."""
    if not c.ca_file and not c.tls_cert_file:
        return True
    ctx = ssl.create_default_context(cafile=c.ca_file or None)
    if c.tls_cert_file:
        try:
            ctx.load_cert_chain(c.tls_cert_file, c.tls_key_file)
        except (OSError, ssl.SSLError) as e:
            raise StartupError(
                f"controller.tls_cert_file {c.tls_cert_file} / tls_key_file {c.tls_key_file}: "
                f"cannot load: {e}"
            ) from None
    return ctx


def _fallback_socket_path() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"trainguard-{os.getuid()}" / "heartbeat.sock"


def _fallback_jobs_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or tempfile.gettempdir()
    return Path(base) / f"trainguard-{os.getuid()}" / "jobs"


def _stale_health(stale: Mapping[str, bool]) -> dict[str, float]:
    """The report's `sources_stale` (how many) and `source_stale.<name>` (0/1) figures."""
    out = {f"source_stale.{name}": 1.0 if v else 0.0 for name, v in sorted(stale.items())}
    out["sources_stale"] = float(sum(stale.values()))
    return out


class _ForwardingGpu:
    """The GPU backend as a preflight reads it, off the loop: the edge events of that read
    (a GPU lost) are handed to the loop, which would otherwise never see them."""

    def __init__(self, gpu: GpuCollector, forward: Callable[[tuple[HardwareEvent, ...]], None]):
        self._gpu = gpu
        self._forward = forward

    def collect(self) -> GpuCollection:
        coll = self._gpu.collect()
        if coll.events:
            self._forward(coll.events)
        return coll


class _AgentFaults:
    """The agent as a FaultTarget: controller-injected faults are logged and spooled too."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def inject(self, spec: FaultSpec) -> None:
        self._agent.inject_fault(spec)


class Agent:
    """One node agent. `start()`, then `run()` until `stop()` (signal-safe)."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        backends: Backends | None = None,
        notifier: SystemdNotifier | None = None,
        serve_http: bool = True,
        inline_sources: bool = False,
        xid_catalog: XidCatalog | None = None,
    ) -> None:
        """`inline_sources=True` runs each due source inside `tick()`, in the caller's thread,
        instead of in its worker: deterministic tests on a FakeClock, no threads.
        `xid_catalog`: classifies XID lines (default: the shipped one; StartupError if broken)."""
        self.config = config
        self.node = config.node.resolved_name()
        self.instance = uuid.uuid4().hex[:16]
        self._clock = clock
        self._xid_catalog = xid_catalog if xid_catalog is not None else _load_xid_catalog()
        self._backends = backends or build_backends(config, node=self.node, clock=clock)
        self._notifier = notifier or SystemdNotifier()
        self._serve_http = serve_http
        self._stop = threading.Event()
        # None wakes the loop to spool a source's fresh events before the next tick
        self._commands: queue.Queue[Command | None] = queue.Queue(maxsize=COMMAND_QUEUE_MAX)
        self._snapshot: AgentSnapshot | None = None
        self._inline_sources = inline_sources
        self._sources: list[tuple[Source, Callable[[Any], None]]] = []
        self._source_stale: dict[str, bool] = {}
        self._source_last_success: dict[str, float] = {}
        self._gpus: tuple[GpuSample, ...] = ()
        self._most_gpus = 0  # the most GPUs the backend has shown: fewer fails a preflight
        self._side_events: list[HardwareEvent] = []  # from reads off the loop (a preflight's)
        self._side_lock = threading.Lock()
        self._ib_ports: tuple[IbPortSample, ...] = ()
        self._hw_events: list[HardwareEvent] = []
        self._xid_total: dict[tuple[int, str, str], int] = {}
        self._collect_duration_s: dict[str, float] = {}
        self._collect_errors_total: dict[str, int] = {}
        self._collector_failing: set[str] = set()
        self._events_total: dict[str, int] = {}
        self._commands_total: dict[tuple[str, str], int] = {}
        self._checkpoints: dict[tuple[str, int], tuple[float | None, float]] = {}
        self._loops = 0
        self._last_tick_mono: float | None = None
        self._started_mono = clock.monotonic()
        self.spool = EventSpool(max_events=config.controller.spool_max_events)
        self.heartbeat: HeartbeatServer | None = None
        self.http: AgentHttpServer | None = None
        self.reporter: Reporter | None = None
        self._reporter_thread: threading.Thread | None = None
        self.executor: CommandExecutor | None = None
        self.jobs: JobRunner | None = None
        self._senders = SenderResolver(
            proc_root="/proc", launches=self._launch_leaders, monotonic=clock.monotonic
        )
        self._slow: queue.Queue[Command | None] = queue.Queue(maxsize=COMMAND_QUEUE_MAX)
        self._slow_thread: threading.Thread | None = None
        self._count_lock = threading.Lock()  # the loop and the slow-command worker both count
        self.preemption: PreemptionWatcher | None = None
        self._preemption_seen: PreemptionNotice | None = None  # set by the watcher thread
        self._preemption_handled: PreemptionNotice | None = None  # the loop acted on it
        self.standby: StandbyPool | None = None
        # the ranks a warm standby became (assign_standby): the job's share of this node too
        self.standby_ranks = StandbyRanks(clock=clock)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Bind sockets, start threads, take a first sample; raises StartupError."""
        self.heartbeat = self._open_heartbeat()
        self.heartbeat.start()
        self.executor = default_executor(
            sender=self.heartbeat,
            fault_target=_AgentFaults(self) if self._backends.sim is not None else None,
        )
        self.jobs = self._open_jobs(self.heartbeat)
        # before the first report: a job an earlier instance launched is reported running
        # from this instance's first report on, with the same pid and attempt
        self.jobs.adopt()
        standby_ranks = self.standby_ranks

        def stop_standby_rank(job: str, grace_s: float) -> bool:
            return standby_ranks.stop(job, grace_s=grace_s)

        for kind, handler in job_handlers(self.jobs, also_stop=stop_standby_rank).items():
            self.executor.register(kind, handler)
        if self.config.standby.enabled:
            self.standby = StandbyPool(
                config=self.config.standby,
                launcher=ProcessLauncher(work_dir=self.jobs.work_dir / "standby"),
                clock=self._clock,
            )
        for kind, handler in inprocess_handlers(
            sender=self.heartbeat,
            launches=self.jobs,
            ranks=standby_ranks,
            pool=lambda: self.standby,
            policy=self.jobs.policy,
            where=StandbyEnv(
                node=self.node,
                heartbeat_socket=str(self.heartbeat.path),
                control_dir=self.jobs.control_dir,
            ),
        ).items():
            self.executor.register(kind, handler)
        heartbeat = self.heartbeat
        for kind, handler in stacks_handler(
            source=self.jobs,
            ranks=heartbeat.ranks,
            clock=self._clock,
            timeout_s=self.config.jobs.stacks_timeout_s,
            max_bytes=self.config.jobs.stacks_max_bytes,
        ).items():
            self.executor.register(kind, handler)
        self._register_node_commands(self.executor)
        self._build_sources()
        self._start_sources()
        self.tick()
        if self._serve_http:
            m = self.config.metrics
            try:
                self.http = AgentHttpServer(
                    address=m.address,
                    port=m.port,
                    collector=SnapshotCollector(lambda: self._snapshot),
                    health=self.health,
                    inject=self.inject_fault if self._backends.sim is not None else None,
                )
            except OSError as e:
                raise StartupError(
                    f"cannot listen on {m.address}:{m.port} for /metrics: {e.strerror or e}"
                ) from None
            self.http.start()
        c = self.config.controller
        if c.resolved_urls():
            try:
                token = read_token(c.token_file) if c.token_file else None
                tls = _tls_context(c)
            except (ValueError, OSError, ssl.SSLError) as e:
                raise StartupError(str(e)) from None
            self.reporter = Reporter(
                urls=c.resolved_urls(),
                token=token,
                spool=self.spool,
                build_report=self.build_report,
                clock=self._clock,
                interval_s=c.report_interval_s,
                timeout_s=c.timeout_s,
                backoff_max_s=c.backoff_max_s,
                max_events_per_report=c.max_events_per_report,
                verify=tls,
                rng=random.Random(),
            )
            self._reporter_thread = threading.Thread(
                target=self.reporter.run,
                args=(self._stop, self._enqueue_commands, self._on_job_attempts),
                name="reporter",
                daemon=True,
            )
            self._reporter_thread.start()
        log.info(
            "event=agent_started version=%s instance=%s backend=%s gpus=%d ib_ports=%d "
            "metrics_port=%s heartbeat_socket=%s control_dir=%s controller=%s jobs=%s "
            "jobs_dir=%s preemption=%s",
            __version__,
            self.instance,
            self.config.hardware.gpu_backend,
            len(self._gpus),
            len(self._snapshot.ib_ports) if self._snapshot else 0,
            self.http.port if self.http else "none",
            self.heartbeat.path,
            self.jobs.control_dir,
            ",".join(c.resolved_urls()) or "none",
            self.jobs.policy.summary(),
            self.jobs.work_dir,
            self.config.preemption.provider,
        )
        self._notifier.ready(status=f"serving node={self.node}")

    def _register_node_commands(self, executor: CommandExecutor) -> None:
        """`preflight` and `repair`, on the GPU backend (real or sim) this agent watches."""
        b = self._backends
        if b.gpu is not None:
            pc = self.config.preflight
            burner, collective = build_workers(
                sim=b.sim,
                run=WorkerRun(python=pc.python or sys.executable, startup_s=pc.startup_timeout_s),
            )
            runner = PreflightRunner(
                gpu=_ForwardingGpu(b.gpu, self._add_side_events),
                burner=burner,
                collective=collective,
                clock=self._clock,
                expected_gpus=lambda: self._most_gpus,
                read_timeout_s=self.config.collectors.gpu.deadline_s,
            )
            for kind, handler in preflight_handler(runner).items():
                executor.register(kind, handler)
        rc = self.config.repair
        repair: RepairBackend = (
            SimRepair(b.sim)
            if b.sim is not None
            else SystemRepair(gpu_count=lambda: len(self._gpus), reset_timeout_s=rc.reset_timeout_s)
        )
        assert self.jobs is not None, "start() opens the job runner first"
        for kind, handler in repair_handler(
            repair,
            busy_jobs=self._busy_jobs,
            allow_reboot=rc.allow_reboot,
            reboots=RebootRecord(self.jobs.work_dir / "last-reboot-command"),
        ).items():
            executor.register(kind, handler)

    def _add_side_events(self, events: tuple[HardwareEvent, ...]) -> None:
        with self._side_lock:
            self._side_events.extend(events)
        self._wake_loop()

    def _wake_loop(self) -> None:
        """From any thread: the loop spools fresh events (sources', side events, the ranks')
        now instead of at its next tick; never blocks."""
        try:
            self._commands.put_nowait(None)
        except queue.Full:
            pass  # the loop is busy with commands and takes the events at its next tick

    def _busy_jobs(self) -> list[str]:
        """Jobs with a process on this node: launched here and running, or heartbeating."""
        jobs = set(self._running_jobs())
        if self.heartbeat is not None:
            jobs.update(r.job for r in self.heartbeat.ranks())
        return sorted(jobs)

    def _launch_leaders(self) -> dict[tuple[int, int], str]:
        leaders = self.jobs.launch_leaders() if self.jobs is not None else {}
        return {**leaders, **self.standby_ranks.launch_leaders()}

    def _running_jobs(self) -> frozenset[str]:
        running = self.jobs.running_jobs() if self.jobs is not None else frozenset()
        return running | self.standby_ranks.running_jobs()

    def _open_heartbeat(self) -> HeartbeatServer:
        hb = self.config.heartbeat
        kwargs: dict[str, Any] = {
            "clock": self._clock,
            "max_ranks": hb.max_ranks,
            "rank_timeout_s": hb.rank_timeout_s,
            "mode": hb.mode,
            "group": hb.socket_group or None,
            "per_sender_rate_hz": hb.per_sender_rate_hz,
            "max_rate_hz": hb.max_rate_hz,
            "proc_root": "/proc",  # forget ranks whose process exited
            # a heartbeat speaks only for its sender's job: launches are known once the job
            # runner exists (it is opened after the socket it hands to its jobs)
            "origin_of": self._senders.origin,
            "claims": JobClaims(launched=self._running_jobs),
            "on_event": self._wake_loop,  # a rank's event is spooled and reported now
            # a rank that exited is reported once more, with its last steps, then forgotten
            "keep_exited_until_reported": bool(self.config.controller.resolved_urls()),
        }
        try:
            return HeartbeatServer(path=hb.socket_path, **kwargs)
        except PermissionError as e:
            if hb.socket_path != DEFAULT_HEARTBEAT_SOCKET:
                raise StartupError(
                    f"{hb.socket_path}: cannot create heartbeat socket: {e.strerror}"
                ) from None
            fallback = _fallback_socket_path()
            log.warning(
                "event=heartbeat_socket_fallback wanted=%s using=%s reason=%r "
                "hint=trainers_must_send_to_the_used_path",
                hb.socket_path,
                fallback,
                e.strerror,
            )
        except OSError as e:
            raise StartupError(
                f"{hb.socket_path}: cannot create heartbeat socket: {e.strerror or e}"
            ) from None
        try:
            return HeartbeatServer(path=fallback, **kwargs)
        except OSError as e:
            raise StartupError(
                f"{fallback}: cannot create heartbeat socket: {e.strerror or e}"
            ) from None

    def _open_jobs(self, heartbeat: HeartbeatServer) -> JobRunner:
        """The torchrun backend; its ranks send to the socket actually bound (after any
        fallback) and bind control sockets beside it unless jobs.control_dir says otherwise.
        Jobs run as jobs.run_as_user under the node's policy (agent.jobpolicy)."""
        jc = self.config.jobs
        socket_group_set = bool(self.config.heartbeat.socket_group)
        try:
            policy = policy_from_config(
                jc, socket_gid=heartbeat.path.stat().st_gid if socket_group_set else None
            )
        except (PolicyError, OSError) as e:
            raise StartupError(str(e)) from None
        try:
            if policy.user is not None:
                prepare_access(
                    policy.user,
                    heartbeat_socket=heartbeat.path,
                    socket_group_set=socket_group_set,
                )
            control_dir = prepare_control_dir(
                heartbeat_socket=heartbeat.path, control_dir=jc.control_dir
            )
        except OSError as e:
            raise StartupError(
                f"cannot prepare the control dir or the socket's group: {e}"
            ) from None
        for warning in policy.startup_warnings():
            log.warning("%s", warning)
        kwargs: dict[str, Any] = {
            "node_name": self.node,
            "heartbeat_socket": str(heartbeat.path),
            "policy": policy,
            "control_dir": control_dir,
            "clock": self._clock,
            "output_tail_lines": jc.output_tail_lines,
            "replace_grace_s": jc.stop_grace_s,
            "systemd": {"auto": None, "always": True, "never": False}[jc.transient_units],
        }
        try:
            return JobRunner(work_dir=jc.work_dir, **kwargs)
        except PermissionError as e:
            if jc.work_dir != DEFAULT_JOBS_WORK_DIR:
                raise StartupError(
                    f"{jc.work_dir}: cannot create jobs.work_dir: {e.strerror}"
                ) from None
            fallback = _fallback_jobs_dir()
            log.warning(
                "event=jobs_dir_fallback wanted=%s using=%s reason=%r",
                jc.work_dir,
                fallback,
                e.strerror,
            )
        except OSError as e:
            raise StartupError(
                f"{jc.work_dir}: cannot create jobs.work_dir: {e.strerror or e}"
            ) from None
        try:
            return JobRunner(work_dir=str(fallback), **kwargs)
        except OSError as e:
            raise StartupError(f"{fallback}: cannot create the jobs directory: {e}") from None

    def _probe(self) -> MetadataProbe | None:
        return build_probe(self.config.preemption, clock=self._clock)

    def _build_sources(self) -> None:
        """One Source per collector, event source and the preemption probe, each with its
        interval and deadline from the config and the handler the loop feeds its results to."""
        collect_s = self.config.hardware.collect_interval_s
        cc = self.config.collectors

        def add(
            name: str,
            body: Callable[[], Any],
            handle: Callable[[Any], None],
            *,
            interval_s: float,
            deadline_s: float,
        ) -> None:
            source = Source(
                name,
                body,
                interval_s=interval_s,
                deadline_s=deadline_s,
                clock=self._clock,
                on_outcome=None if self._inline_sources else self._wake_on_events,
            )
            self._sources.append((source, handle))

        b = self._backends
        if b.gpu is not None:
            add(
                "gpu",
                b.gpu.collect,
                self._take_gpu,
                interval_s=cc.gpu.resolved_interval_s(collect_s),
                deadline_s=cc.gpu.deadline_s,
            )
        if b.ib is not None:
            add(
                "ib",
                b.ib.collect,
                self._take_ib,
                interval_s=cc.ib.resolved_interval_s(collect_s),
                deadline_s=cc.ib.deadline_s,
            )
        for name, event_source in b.event_sources:  # the kernel log's XIDs
            add(
                name,
                event_source.poll,
                self._take_events,
                interval_s=cc.xid.resolved_interval_s(collect_s),
                deadline_s=cc.xid.deadline_s,
            )
        probe = self._probe()
        if probe is not None:
            p = self.config.preemption
            self.preemption = PreemptionWatcher(
                probe, interval_s=p.poll_interval_s, on_notice=self._on_preemption_notice
            )
            add(
                "preemption",
                self.preemption.check_once,
                lambda _notice: None,  # check_once hands a notice to _on_preemption_notice
                interval_s=p.poll_interval_s,
                deadline_s=p.deadline_s,
            )
        for source, _ in self._sources:
            self._source_stale[source.name] = False

    def _start_sources(self) -> None:
        """Start every source's worker and give them a bounded moment for a first result."""
        if self._inline_sources:
            return
        for source, _ in self._sources:
            source.start()
        until = self._clock.monotonic() + FIRST_RESULTS_WAIT_S
        for source, _ in self._sources:
            if not source.wait_first(max(0.0, until - self._clock.monotonic())):
                log.warning(
                    "event=source_slow_at_start source=%s waited_s=%.1f",
                    source.name,
                    FIRST_RESULTS_WAIT_S,
                )

    def _stop_sources(self) -> None:
        for source, _ in self._sources:
            if not source.stop(timeout_s=SOURCE_STOP_WAIT_S):
                log.warning("event=source_abandoned source=%s reason=call_in_progress", source.name)

    def stop(self) -> None:
        """Ask the loop to end (safe from a signal handler: sets a flag only)."""
        self._stop.set()

    def close(self) -> None:
        """Stop everything in order: reporting loop, watchers, one last bounded report, then
        the sockets and backends. Jobs are left running for the next agent instance."""
        self._notifier.stopping()
        self._stop.set()
        if self.reporter is not None:
            self.reporter.nudge()  # its wait ends now
        if self._reporter_thread is not None:
            self._reporter_thread.join(timeout=10.0)
        self._stop_sources()
        if self.preemption is not None:
            self.preemption.close()
        if self.standby is not None:
            self.standby.close()
        self.standby_ranks.close()
        if self._slow_thread is not None:
            self._slow.put(None)
            self._slow_thread.join(timeout=self.config.jobs.stacks_timeout_s + 1.0)
        if self.jobs is not None:
            # jobs outlive the agent: the next instance re-adopts them (an upgrade or a
            # watchdog restart must never cost a training job); stop_job stops them
            self.jobs.detach()
            self._spool_job_events()
        if self.heartbeat is not None:
            self._spool_trainer_events()  # the ranks' exit / checkpoint events of the stop
        if self.reporter is not None:
            reporter = self.reporter
            final_timeout_s = min(FINAL_REPORT_TIMEOUT_S, self.config.controller.timeout_s)
            last = threading.Thread(
                target=reporter.final_report,
                kwargs={"timeout_s": final_timeout_s},
                name="final-report",
                daemon=True,
            )
            last.start()
            last.join(final_timeout_s + 0.5)
            reporter.close()
        if self.http is not None:
            self.http.close()
        if self.heartbeat is not None:
            self.heartbeat.close()
        self._backends.close()
        self._notifier.close()
        log.info("event=agent_stopped instance=%s", self.instance)

    def run(self) -> None:
        """The collect loop; executes queued commands between ticks. Returns after stop()."""
        interval = self.config.hardware.collect_interval_s
        next_mono = self._clock.monotonic() + interval
        while not self._stop.is_set():
            self._spool_job_events()
            now = self._clock.monotonic()
            if now >= next_mono:
                self.tick()
                # keep the cadence; after a long stall start afresh instead of bursting
                next_mono = max(next_mono + interval, self._clock.monotonic())
                continue
            try:
                # a signal's stop() is seen within one wait (<= 0.5 s); longer waits would only
                # save wake-ups that cost nothing measurable
                cmd = self._commands.get(timeout=min(0.5, next_mono - now))
            except queue.Empty:
                continue
            if cmd is None:  # fresh events (a source's, a rank's): spool them now, not next tick
                self._take_sources()
                self._spool_trainer_events()
                continue
            self.execute(cmd)

    # -- the loop's work -------------------------------------------------------------------

    def tick(self) -> None:
        """Take every source's latest results, spool new events, publish a snapshot, pet the
        watchdog. Never waits on a source: a hung one is stale and keeps its last values."""
        if self._inline_sources:
            for source, _ in self._sources:
                source.run_if_due()
        self._take_sources()
        assert self.heartbeat is not None, "start() binds the heartbeat socket first"
        self._spool_trainer_events()
        self._spool_job_events()
        self._act_on_preemption()
        if self.standby is not None:
            self.standby.tick(spare=self._keeps_standby())
        ranks = self.heartbeat.ranks()
        if self._checkpoints:  # forget ranks the heartbeat server forgot (bounded series)
            live = {(r.job, r.rank) for r in ranks}
            self._checkpoints = {k: v for k, v in self._checkpoints.items() if k in live}
        self._loops += 1
        hb = self.heartbeat.stats()
        rep = self.reporter
        with self._count_lock:
            events_total = dict(self._events_total)
            commands_total = dict(self._commands_total)
        self._snapshot = AgentSnapshot(
            node=self.node,
            version=__version__,
            gpus=self._gpus,
            ib_ports=self._ib_ports,
            ranks=ranks,
            xid_total=dict(self._xid_total),
            kmsg_non_kernel_records_total=(
                self._backends.kmsg.non_kernel_records_total if self._backends.kmsg else 0
            ),
            collect_duration_s=dict(self._collect_duration_s),
            collect_errors_total=dict(self._collect_errors_total),
            reports_total=dict(rep.results_total) if rep else {},
            controller_urls=rep.urls if rep else (),
            controller_current=rep.current_url if rep else None,
            controller_switches_total=dict(rep.switches_total) if rep else {},
            heartbeats_received_total=hb["received_total"],
            heartbeats_dropped_total=hb["dropped_total"],
            heartbeat_senders_refused_total=hb["refused_total"],
            control_sent_total=hb["control_sent_total"],
            control_errors_total=hb["control_errors_total"],
            spool_events=len(self.spool),
            spool_dropped_total=self.spool.dropped_total,
            events_total=events_total,
            commands_total=commands_total,
            loop_iterations_total=self._loops,
            checkpoints=dict(self._checkpoints),
            preemption_notice=self._preemption_handled is not None,
            source_stale=dict(self._source_stale),
            source_last_success_unix=dict(self._source_last_success),
            standby_ready=self.standby.is_ready if self.standby else False,
            standbys_started_total=self.standby.started_total if self.standby else 0,
            standby_ready_s=self.standby.ready_s if self.standby else None,
        )
        self._last_tick_mono = self._clock.monotonic()
        self._notifier.watchdog()

    def _spool_trainer_events(self) -> None:
        assert self.heartbeat is not None, "start() binds the heartbeat socket first"
        for tev in self.heartbeat.drain_events():
            log.info(
                "event=trainer_event kind=%s job=%s rank=%d step=%s",
                tev.kind,
                tev.job,
                tev.rank,
                tev.data.get("step"),
            )
            self._spool_event(
                kind=tev.kind,
                ts=tev.ts,
                job=tev.job,
                rank=tev.rank,
                message=tev.message,
                data=tev.data,
            )
            if tev.kind == EventKind.CHECKPOINT_COMMITTED:
                self._note_checkpoint(tev)

    def _spool_job_events(self) -> None:
        """Reap job exits and escalate overdue stops; spool each `job_exit` once."""
        if self.jobs is None:
            return
        for jev in (*self.jobs.poll(), *self.standby_ranks.poll()):
            self._spool_event(
                kind=jev.kind,
                ts=jev.ts,
                job=jev.job,
                code=jev.exit_code,
                message=jev.message,
                data={"attempt": jev.attempt, **jev.data},
            )

    # -- preemption ------------------------------------------------------------------------

    def _on_preemption_notice(self, notice: PreemptionNotice) -> None:
        """From the watcher thread: remember the notice; the loop acts on it at its next tick."""
        self._preemption_seen = notice

    def _act_on_preemption(self) -> None:
        """Once per notice: ask every local rank for an emergency checkpoint-and-stop, and
        tell the controller."""
        notice = self._preemption_seen
        if notice is None or self._preemption_handled is not None:
            return
        self._preemption_handled = notice
        assert self.heartbeat is not None, "start() binds the heartbeat socket first"
        jobs = sorted({r.job for r in self.heartbeat.ranks()})
        request_id = f"preempt-{self.instance}"
        sent = failed = 0
        for job in jobs:
            s, f = self.heartbeat.send_control(
                job, Control(action="checkpoint_stop", request_id=request_id, job=job)
            )
            sent += s
            failed += f
        log.warning(
            "event=preemption_checkpoint_stop provider=%s action=%s time=%s jobs=%s "
            "ranks_sent=%d ranks_failed=%d request_id=%s",
            notice.provider,
            notice.action,
            notice.time or "-",
            ",".join(jobs) or "-",
            sent,
            failed,
            request_id,
        )
        self._spool_event(
            kind=EventKind.PREEMPTION_NOTICE,
            ts=self._clock.now(),
            message=f"{notice.provider} {notice.action}",
            data={
                "provider": notice.provider,
                "action": notice.action,
                "time": notice.time,
                "jobs": jobs,
                "ranks_sent": sent,
                "ranks_failed": failed,
                "request_id": request_id,
            },
        )

    def _note_checkpoint(self, tev: TrainerEvent) -> None:
        """Keep the newest commit per rank; a missing or nonsensical duration is absent."""
        raw = tev.data.get("duration_s")
        duration_s: float | None = None
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            if math.isfinite(raw) and raw >= 0:
                duration_s = float(raw)
        self._checkpoints[(tev.job, tev.rank)] = (duration_s, tev.ts)

    # -- sources -------------------------------------------------------------------------

    def _wake_on_events(self, name: str, outcome: CallOutcome) -> None:
        """From a source worker: wake the loop when the result carries events (an XID must
        not wait for the next tick to reach the spool)."""
        v = outcome.value
        if (isinstance(v, GpuCollection) and v.events) or (isinstance(v, list) and v):
            self._wake_loop()

    def _take_sources(self) -> None:
        """Feed every source's finished results to its handler and note stale/recovered
        edges (the loop's thread only: the handlers touch the loop's own state)."""
        for source, handle in self._sources:
            taken: TakeResult = source.take()
            for transition in taken.transitions:
                self._on_source_transition(transition)
            for outcome in taken.outcomes:
                self._take_outcome(source.name, outcome, handle)
            self._source_stale[source.name] = taken.stale
            if taken.last_success_unix is not None:
                self._source_last_success[source.name] = taken.last_success_unix
        with self._side_lock:
            side, self._side_events = self._side_events, []
        for ev in side:
            self._on_hardware_event(ev)

    def _take_outcome(self, name: str, outcome: CallOutcome, handle: Callable[[Any], None]) -> None:
        self._collect_duration_s[name] = outcome.duration_s
        if outcome.error is not None:
            self._collect_errors_total[name] = self._collect_errors_total.get(name, 0) + 1
            if name not in self._collector_failing:  # log the edge, count every failure
                log.error("event=collector_failed collector=%s error=%r", name, outcome.error)
                self._collector_failing.add(name)
            return
        if name in self._collector_failing:
            log.info("event=collector_recovered collector=%s", name)
            self._collector_failing.discard(name)
        handle(outcome.value)

    def _take_gpu(self, coll: GpuCollection) -> None:
        self._gpus = coll.gpus
        self._most_gpus = max(self._most_gpus, len(coll.gpus))
        if coll.errors:
            self._collect_errors_total["gpu"] = self._collect_errors_total.get("gpu", 0) + len(
                coll.errors
            )
        for ev in coll.events:
            self._on_hardware_event(ev)

    def _take_ib(self, ports: tuple[IbPortSample, ...]) -> None:
        self._ib_ports = ports

    def _take_events(self, events: list[HardwareEvent]) -> None:
        for ev in events:
            self._on_hardware_event(ev)

    def _on_source_transition(self, t: Transition) -> None:
        """A source went stale (once per episode) or recovered: log it and tell the
        controller; its last values stay in the snapshot, marked stale."""
        if t.kind == "stale":
            log.error(
                "event=source_stale source=%s running_s=%.1f deadline_s=%g",
                t.source,
                t.running_s,
                t.deadline_s,
            )
            self._spool_event(
                kind=EventKind.SOURCE_STALE,
                ts=self._clock.now(),
                message=f"{t.source}: a call has run {t.running_s:.1f} s "
                f"(deadline {t.deadline_s:g} s)",
                data={"source": t.source, "deadline_s": t.deadline_s, "running_s": t.running_s},
            )
        else:
            log.warning(
                "event=source_recovered source=%s stale_for_s=%.1f", t.source, t.stale_for_s
            )
            self._spool_event(
                kind=EventKind.SOURCE_RECOVERED,
                ts=self._clock.now(),
                message=f"{t.source}: on time again after {t.stale_for_s:.1f} s stale",
                data={"source": t.source, "stale_for_s": t.stale_for_s},
            )

    def _on_hardware_event(self, ev: HardwareEvent) -> None:
        if ev.kind == EventKind.XID and ev.gpu is not None and ev.code is not None:
            # the line's own severity (a Nonfatal NVLink5 XID is not a fatal one)
            key = (ev.gpu, *xid_labels(self._xid_catalog, ev.code, ev.message))
            if key in self._xid_total or len(self._xid_total) < MAX_XID_SERIES:
                self._xid_total[key] = self._xid_total.get(key, 0) + 1
        log.warning(
            "event=hardware_event kind=%s gpu=%s code=%s pci_bus_id=%s",
            ev.kind,
            ev.gpu,
            ev.code,
            ev.pci_bus_id,
        )
        self._spool_event(
            kind=ev.kind,
            ts=ev.ts,
            gpu=ev.gpu,
            code=ev.code,
            message=ev.message,
            data={"pci_bus_id": ev.pci_bus_id} if ev.pci_bus_id else {},
        )

    def _spool_event(self, *, kind: EventKind, ts: float, **kwargs: Any) -> Event | None:
        """Count the event; spool it only when a controller will ever read the spool."""
        with self._count_lock:
            self._events_total[kind] = self._events_total.get(kind, 0) + 1
        if not self.config.controller.resolved_urls():
            return None
        event = self.spool.add(kind=kind, ts=ts, **kwargs)
        if self.reporter is not None:
            self.reporter.nudge()  # an event reaches the controller now, not next interval
        return event

    # -- commands, faults, reports ---------------------------------------------------------

    def _enqueue_commands(self, commands: tuple[Command, ...]) -> None:
        for cmd in commands:
            try:
                self._commands.put_nowait(cmd)
            except queue.Full:
                log.error(
                    "event=command_dropped command_id=%s kind=%s reason=queue_full",
                    cmd.id,
                    cmd.kind,
                )

    def _keeps_standby(self) -> bool:
        """A warm standby is kept while the node is a spare (as the controller last said; its
        role_hint before that) that runs no rank: once a job's rank runs here (its launch, or
        the standby it took), an idle one would only hold memory."""
        busy = self.standby_ranks.running_jobs()
        if self.jobs is not None:
            busy = busy | self.jobs.running_jobs()
        return keeps_standby(
            said=self.reporter.spare if self.reporter is not None else None,
            role_hint=self.config.node.role_hint,
            running_jobs=busy,
        )

    def _on_job_attempts(self, attempts: Mapping[str, int]) -> None:
        """From the reporter: the controller names each job's current attempt (fencing);
        every local launch of an older attempt is stopped at once (JobRunner is
        thread-safe and stop is non-blocking)."""
        if self.jobs is None:
            return
        for job, attempt in sorted(attempts.items()):
            self.jobs.stop_stale(job, current_attempt=attempt)
            self.standby_ranks.stop_stale(job, current_attempt=attempt)

    def execute(self, cmd: Command) -> None:
        """Run one command now, or hand a slow one to the worker; its result is spooled."""
        assert self.executor is not None, "start() creates the executor"
        if cmd.kind in SLOW_COMMANDS:
            self._submit_slow(cmd)
            return
        self._record_result(cmd, self.executor.execute(cmd))

    def _submit_slow(self, cmd: Command) -> None:
        if self._slow_thread is None:
            self._slow_thread = threading.Thread(
                target=self._slow_worker, name="slow-commands", daemon=True
            )
            self._slow_thread.start()
        try:
            self._slow.put_nowait(cmd)
        except queue.Full:
            self._record_result(cmd, CommandResult(ok=False, message="agent busy: queue full"))

    def _slow_worker(self) -> None:
        assert self.executor is not None, "start() creates the executor"
        while True:
            cmd = self._slow.get()
            if cmd is None:
                return
            if self._stop.is_set():
                result = CommandResult(ok=False, message="agent stopping")
            else:
                result = self.executor.execute(cmd)
            self._record_result(cmd, result)

    def _record_result(self, cmd: Command, result: CommandResult) -> None:
        key = (cmd.kind, "ok" if result.ok else "failed")
        with self._count_lock:
            self._commands_total[key] = self._commands_total.get(key, 0) + 1
        for kind, data in result.events:  # before the command_result that completes it
            self._spool_event(kind=kind, ts=self._clock.now(), message=result.message, data=data)
        self._spool_event(
            kind=EventKind.COMMAND_RESULT,
            ts=self._clock.now(),
            job=cmd.args.get("job") if isinstance(cmd.args.get("job"), str) else None,
            message=result.message,
            data={
                "command_id": cmd.id,
                "kind": cmd.kind,
                "ok": result.ok,
                "message": result.message,
                **result.data,
            },
        )

    def inject_fault(self, spec: FaultSpec) -> dict[str, Any]:
        """Local fault injection (sim only); raises ValueError for a bad target."""
        sim = self._backends.sim
        if sim is None:
            raise ValueError("fault injection needs the sim GPU backend")
        sim.inject(spec)
        log.warning(
            "event=fault_injected kind=%s gpu=%d link=%d device=%s port=%d code=%d duration_s=%s",
            spec.kind,
            spec.gpu,
            spec.link,
            spec.device,
            spec.port,
            spec.code,
            spec.duration_s,
        )
        ev = self._spool_event(
            kind=EventKind.FAULT_INJECTED,
            ts=self._clock.now(),
            gpu=spec.gpu,
            message=spec.kind,
            data={"fault": spec.kind},
        )
        return {"fault": spec.kind, **({"event_id": ev.id} if ev else {})}

    def build_report(self, seq: int, events: tuple[Event, ...]) -> Report:
        snap = self._snapshot
        hb = self.heartbeat.stats() if self.heartbeat else {}
        return Report(
            node=self.node,
            instance=self.instance,
            seq=seq,
            sent_at=self._clock.now(),
            agent_version=__version__,
            role_hint=self.config.node.role_hint,
            labels=self.config.node.report_labels(),
            gpus=snap.gpus if snap else (),
            ib_ports=snap.ib_ports if snap else (),
            ranks=self.heartbeat.ranks(report=True) if self.heartbeat else (),
            jobs=(*self.jobs.processes(), *self.standby_ranks.processes()) if self.jobs else (),
            events=events,
            standby=(
                StandbyState(module=self.standby.config.module, ready=self.standby.is_ready)
                if self.standby is not None
                else None
            ),
            health={
                "spool_events": float(len(self.spool)),
                "spool_dropped_total": float(self.spool.dropped_total),
                "heartbeats_dropped_total": float(sum(hb.get("dropped_total", {}).values())),
                "collect_errors_total": float(sum(self._collect_errors_total.values())),
                "loop_age_s": self._loop_age_s(),
                **_stale_health(snap.source_stale if snap else {}),
            },
        )

    def _loop_age_s(self) -> float:
        last = self._last_tick_mono if self._last_tick_mono is not None else self._started_mono
        return max(0.0, self._clock.monotonic() - last)

    def health(self) -> tuple[bool, str]:
        """Healthy while the collect loop is making progress."""
        limit_s = max(3 * self.config.hardware.collect_interval_s, 5.0)
        age = self._loop_age_s()
        if self._last_tick_mono is None or age > limit_s:
            return False, f"stale: last collect {age:.1f}s ago (limit {limit_s:.1f}s)"
        return True, "ok"

    @property
    def snapshot(self) -> AgentSnapshot | None:
        return self._snapshot

    @property
    def sources(self) -> dict[str, Source]:
        """The collection sources by name (built by start())."""
        return {source.name: source for source, _ in self._sources}

    @property
    def metrics_port(self) -> int | None:
        return self.http.port if self.http else None
