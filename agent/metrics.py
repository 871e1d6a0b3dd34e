"""Prometheus exposition of the agent's latest samples, and its small HTTP server.

`metric_families(snapshot)` is a pure function from an `AgentSnapshot` (what the collect loop
last saw) to metric families; `SnapshotCollector` plugs it into a prometheus_client registry.
`AgentHttpServer` serves /metrics, /healthz and, for loopback clients of a sim-backend agent
only, POST /v1/faults (local fault injection). No value can break the exposition: one that
has no sample value (`trainguard.bounds.metric_value`) is skipped and counted.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from trainguard.bounds import metric_value
from trainguard.model import GpuSample, IbPortSample
from trainguard.protocol import FaultSpec, ProtocolError, RankState, from_wire

log = logging.getLogger("trainguard.agent.metrics")

FAULT_BODY_MAX_BYTES = 64 * 1024
IB_DATA_COUNTERS = {"port_xmit_data": "transmit", "port_rcv_data": "receive"}


@dataclass(frozen=True)
class AgentSnapshot:
    """Everything /metrics shows, as of the end of one collect tick (immutable)."""

    node: str
    version: str
    gpus: tuple[GpuSample, ...] = ()
    ib_ports: tuple[IbPortSample, ...] = ()
    ranks: tuple[RankState, ...] = ()
    # (gpu index, xid code) -> XIDs seen since the agent started
    xid_total: Mapping[tuple[int, int], int] = field(default_factory=dict)
    collect_duration_s: Mapping[str, float] = field(default_factory=dict)
    collect_errors_total: Mapping[str, int] = field(default_factory=dict)
    reports_total: Mapping[str, int] = field(default_factory=dict)
    # the configured controllers (a bounded list), the one reports go to now (None: export
    # only), and moves between them by reason
    controller_urls: tuple[str, ...] = ()
    controller_current: str | None = None
    controller_switches_total: Mapping[str, int] = field(default_factory=dict)
    heartbeats_received_total: int = 0
    heartbeats_dropped_total: Mapping[str, int] = field(default_factory=dict)
    control_sent_total: int = 0
    control_errors_total: int = 0
    spool_events: int = 0
    spool_dropped_total: int = 0
    events_total: Mapping[str, int] = field(default_factory=dict)
    commands_total: Mapping[tuple[str, str], int] = field(default_factory=dict)
    loop_iterations_total: int = 0
    # (job, rank) -> (duration_s or None, commit unix time) of the newest committed checkpoint
    checkpoints: Mapping[tuple[str, int], tuple[float | None, float]] = field(default_factory=dict)
    # a cloud preemption notice was seen (the node is going away; ranks were told to stop)
    preemption_notice: bool = False
    # source name -> a call overran its deadline and no call has been on time since
    source_stale: Mapping[str, bool] = field(default_factory=dict)
    # source name -> unix time its last call returned without error (absent: none yet)
    source_last_success_unix: Mapping[str, float] = field(default_factory=dict)


class _Skipped:
    """Samples skipped since start because their value had no sample value (see
    `metric_value`), or their family group failed to build."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.total += n


SKIPPED = _Skipped()


class _SafeGauge(GaugeMetricFamily):
    def add_metric(self, labels: Any, value: Any, timestamp: Any = None) -> None:
        v = metric_value(value)
        if v is None:
            SKIPPED.add()
            return
        super().add_metric(labels, v, timestamp)


class _SafeCounter(CounterMetricFamily):
    def add_metric(
        self,
        labels: Any,
        value: Any,
        created: Any = None,
        timestamp: Any = None,
        exemplar: Any = None,
    ) -> None:
        v = metric_value(value)
        if v is None:
            SKIPPED.add()
            return
        super().add_metric(labels, v, created, timestamp, exemplar)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return _SafeGauge(name, doc, labels=labels)


def _counter(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
    # prometheus_client appends `_total` to counter samples; give the name without it
    return _SafeCounter(name.removesuffix("_total"), doc, labels=labels)


def _b(v: bool) -> float:
    return 1.0 if v else 0.0


def metric_families(
    snap: AgentSnapshot, *, xid_severity: Callable[[int], str] | None = None
) -> list[Metric]:
    """The metric families for one snapshot. Absent (None) fields give no sample."""
    node = snap.node
    out: list[Metric] = []
    groups: list[Callable[[], Iterator[Metric]]] = [
        lambda: _gpu_families(snap, node, xid_severity),
        lambda: _nvlink_families(snap, node),
        lambda: _ib_families(snap, node),
        lambda: _trainer_families(snap, node),
        lambda: _agent_families(snap, node),
    ]
    for group in groups:
        # the last line of defence: a group that fails is left out (its complete families
        # stay), counted and logged, and the rest of the page is served
        try:
            for fam in group():
                out.append(fam)
        except Exception as e:
            SKIPPED.add()
            log.error("event=metrics_group_failed error=%s", type(e).__name__, exc_info=e)
    skipped = _counter(
        "trainguard_agent_metric_values_skipped_total",
        "Samples left out of /metrics because their value could not be exported.",
        ["node"],
    )
    skipped.add_metric([node], SKIPPED.total)
    out.append(skipped)
    return out


def _gpu_families(
    snap: AgentSnapshot, node: str, xid_severity: Callable[[int], str] | None
) -> Iterator[Metric]:
    gl = ["node", "gpu", "uuid"]
    simple: list[tuple[str, str, Callable[[GpuSample], float | None]]] = [
        (
            "trainguard_gpu_temperature_celsius",
            "GPU core temperature.",
            lambda g: g.temperature_celsius,
        ),
        ("trainguard_gpu_power_watts", "GPU power draw.", lambda g: g.power_watts),
        (
            "trainguard_gpu_utilization_ratio",
            "Fraction of time a kernel was running.",
            lambda g: (
                None if g.utilization_gpu_percent is None else g.utilization_gpu_percent / 100
            ),
        ),
        (
            "trainguard_gpu_memory_utilization_ratio",
            "Fraction of time memory was read/written.",
            lambda g: (
                None if g.utilization_memory_percent is None else g.utilization_memory_percent / 100
            ),
        ),
        ("trainguard_gpu_memory_used_bytes", "GPU memory in use.", lambda g: g.memory_used_bytes),
        (
            "trainguard_gpu_memory_total_bytes",
            "GPU memory installed.",
            lambda g: g.memory_total_bytes,
        ),
        (
            "trainguard_gpu_sm_clock_hertz",
            "Current SM clock.",
            lambda g: None if g.sm_clock_mhz is None else g.sm_clock_mhz * 1e6,
        ),
        (
            "trainguard_gpu_remap_pending",
            "1 if a row remapping is pending (needs a GPU reset).",
            lambda g: None if g.remapped_rows_pending is None else _b(g.remapped_rows_pending),
        ),
        (
            "trainguard_gpu_remap_failed",
            "1 if a row remapping failed (replace the GPU).",
            lambda g: None if g.remapped_rows_failure is None else _b(g.remapped_rows_failure),
        ),
        (
            "trainguard_gpu_retired_pages_pending",
            "1 if a page retirement is pending.",
            lambda g: None if g.retired_pages_pending is None else _b(g.retired_pages_pending),
        ),
    ]
    lost = _gauge("trainguard_gpu_lost", "1 if the GPU is lost (NVML GpuIsLost / off the bus).", gl)
    families = [(_gauge(n, d, gl), f) for n, d, f in simple]
    throttle = _gauge(
        "trainguard_gpu_throttle_active",
        "1 while the clock-event reason is active.",
        [*gl, "reason"],
    )
    ecc = _counter(
        "trainguard_gpu_ecc_errors_total",
        "ECC errors (volatile: since driver load).",
        [*gl, "type", "scope"],
    )
    remapped = _gauge("trainguard_gpu_remapped_rows", "Rows remapped, by kind.", [*gl, "kind"])
    retired = _gauge(
        "trainguard_gpu_retired_pages", "Retired memory pages, by cause.", [*gl, "cause"]
    )
    pcie = _counter("trainguard_gpu_pcie_replay_errors_total", "PCIe replay counter.", gl)
    for g in snap.gpus:
        labels = [node, str(g.index), g.uuid]
        lost.add_metric(labels, _b(g.lost))
        for fam, get in families:
            v = get(g)
            if v is not None:
                fam.add_metric(labels, v)
        for reason, on in (
            ("hw_slowdown", g.throttle_hw_slowdown),
            ("hw_thermal", g.throttle_hw_thermal),
            ("sw_thermal", g.throttle_sw_thermal),
            ("hw_power_brake", g.throttle_power_brake),
        ):
            if on is not None:
                throttle.add_metric([*labels, reason], _b(on))
        for kind, scope, v in (
            ("corrected", "volatile", g.ecc_corrected_volatile_total),
            ("uncorrected", "volatile", g.ecc_uncorrected_volatile_total),
            ("corrected", "aggregate", g.ecc_corrected_aggregate_total),
            ("uncorrected", "aggregate", g.ecc_uncorrected_aggregate_total),
        ):
            if v is not None:
                ecc.add_metric([*labels, kind, scope], v)
        for kind, v in (
            ("correctable", g.remapped_rows_correctable),
            ("uncorrectable", g.remapped_rows_uncorrectable),
        ):
            if v is not None:
                remapped.add_metric([*labels, kind], v)
        for cause, v in (("sbe", g.retired_pages_sbe), ("dbe", g.retired_pages_dbe)):
            if v is not None:
                retired.add_metric([*labels, cause], v)
        if g.pcie_replay_total is not None:
            pcie.add_metric(labels, g.pcie_replay_total)
    uuids = {g.index: g.uuid for g in snap.gpus}
    xl = [*gl, "xid"] + (["severity"] if xid_severity else [])
    xid = _counter("trainguard_gpu_xid_errors_total", "XID errors seen since agent start.", xl)
    for (gpu, code), n in sorted(snap.xid_total.items()):
        labels = [node, str(gpu), uuids.get(gpu, ""), str(code)]
        if xid_severity:
            labels.append(xid_severity(code))
        xid.add_metric(labels, n)
    yield lost
    for fam, _ in families:
        yield fam
    yield from (throttle, ecc, remapped, retired, pcie, xid)


def _nvlink_families(snap: AgentSnapshot, node: str) -> Iterator[Metric]:
    ll = ["node", "gpu", "uuid", "link"]
    up = _gauge("trainguard_nvlink_up", "1 if the NVLink is active.", ll)
    errors = _counter("trainguard_nvlink_errors_total", "NVLink error counters.", [*ll, "type"])
    for g in snap.gpus:
        for link in g.nvlinks:
            labels = [node, str(g.index), g.uuid, str(link.link)]
            if link.up is not None:
                up.add_metric(labels, _b(link.up))
            for kind, v in (
                ("crc_flit", link.crc_flit_errors_total),
                ("crc_data", link.crc_data_errors_total),
                ("replay", link.replay_errors_total),
                ("recovery", link.recovery_errors_total),
            ):
                if v is not None:
                    errors.add_metric([*labels, kind], v)
    yield from (up, errors)


def _ib_families(snap: AgentSnapshot, node: str) -> Iterator[Metric]:
    pl = ["node", "device", "port"]
    up = _gauge("trainguard_ib_port_up", "1 if the port state is ACTIVE.", pl)
    phys_up = _gauge("trainguard_ib_port_physical_up", "1 if the physical state is LinkUp.", pl)
    rate = _gauge(
        "trainguard_ib_port_rate_bytes_per_second", "Negotiated link rate (Gb/s x 1e9 / 8).", pl
    )
    data = _counter(
        "trainguard_ib_port_data_bytes_total", "Data bytes (sysfs words x 4).", [*pl, "direction"]
    )
    packets = _counter(
        "trainguard_ib_port_packets_total",
        "Packet counters from sysfs counters/.",
        [*pl, "counter"],
    )
    wait = _counter(
        "trainguard_ib_port_transmit_wait_ticks_total",
        "Ticks a port had data to send but no credits (congestion).",
        pl,
    )
    errors = _counter(
        "trainguard_ib_port_errors_total",
        "Error counters from sysfs counters/.",
        [*pl, "counter"],
    )
    hw = _counter(
        "trainguard_ib_port_hw_events_total",
        "Driver counters from sysfs hw_counters/.",
        [*pl, "counter"],
    )
    unreadable = _gauge(
        "trainguard_ib_port_unreadable_files", "sysfs files that could not be read.", pl
    )
    for p in snap.ib_ports:
        labels = [node, p.device, str(p.port)]
        if p.state is not None:
            up.add_metric(labels, _b(p.state == "ACTIVE"))
        if p.phys_state is not None:
            phys_up.add_metric(labels, _b(p.phys_state == "LinkUp"))
        if p.rate_gbps is not None:
            rate.add_metric(labels, p.rate_gbps * 1e9 / 8)
        for name, v in sorted(p.counters.items()):
            if name in IB_DATA_COUNTERS:
                data.add_metric([*labels, IB_DATA_COUNTERS[name]], v * 4)
            elif name.endswith("_packets"):
                packets.add_metric([*labels, name], v)
            elif name == "port_xmit_wait":
                wait.add_metric(labels, v)
            else:
                errors.add_metric([*labels, name], v)
        for name, v in sorted(p.hw_counters.items()):
            hw.add_metric([*labels, name], v)
        unreadable.add_metric(labels, len(p.unreadable))
    yield from (up, phys_up, rate, data, packets, wait, errors, hw, unreadable)


def _trainer_families(snap: AgentSnapshot, node: str) -> Iterator[Metric]:
    rl = ["node", "job", "rank"]
    spec: list[tuple[str, str, Callable[[RankState], float | None]]] = [
        ("trainguard_trainer_step", "Latest training step.", lambda r: r.step),
        ("trainguard_trainer_loss", "Latest loss (NaN stays NaN).", lambda r: r.loss),
        ("trainguard_trainer_grad_norm", "Latest gradient norm.", lambda r: r.grad_norm),
        ("trainguard_trainer_samples_per_second", "Throughput.", lambda r: r.samples_per_s),
        ("trainguard_trainer_tokens_per_second", "Throughput.", lambda r: r.tokens_per_s),
        (
            "trainguard_trainer_step_time_seconds",
            "Duration of the latest step.",
            lambda r: r.step_time_s,
        ),
        (
            "trainguard_trainer_compute_time_seconds",
            "The rank's own work in the latest step, without waits in collectives.",
            lambda r: r.compute_time_s,
        ),
        (
            "trainguard_trainer_heartbeat_age_seconds",
            "Since the rank's last heartbeat.",
            lambda r: r.heartbeat_age_s,
        ),
        (
            "trainguard_trainer_step_age_seconds",
            "Since the rank's step last changed.",
            lambda r: r.step_age_s,
        ),
        (
            "trainguard_trainer_checkpoint_step",
            "Newest committed checkpoint step.",
            lambda r: r.ckpt_step,
        ),
    ]
    fams = [(_gauge(n, d, rl), f) for n, d, f in spec]
    for r in snap.ranks:
        labels = [node, r.job, str(r.rank)]
        for fam, get in fams:
            v = get(r)
            if v is not None:
                fam.add_metric(labels, v)
    for fam, _ in fams:
        yield fam
    duration = _gauge(
        "trainguard_trainer_checkpoint_duration_seconds",
        "Save time of the rank's newest committed checkpoint (snapshot to commit).",
        rl,
    )
    stamp = _gauge(
        "trainguard_trainer_checkpoint_timestamp_seconds",
        "Unix time the agent saw the rank's newest checkpoint commit.",
        rl,
    )
    for (job, rank), (duration_s, committed_at) in sorted(snap.checkpoints.items()):
        labels = [node, job, str(rank)]
        if duration_s is not None:
            duration.add_metric(labels, duration_s)
        stamp.add_metric(labels, committed_at)
    yield from (duration, stamp)


def _agent_families(snap: AgentSnapshot, node: str) -> Iterator[Metric]:
    info = _gauge(
        "trainguard_agent_info", "Agent build information (always 1).", ["node", "version"]
    )
    info.add_metric([node, snap.version], 1.0)
    yield info
    dur = _gauge(
        "trainguard_agent_collect_duration_seconds",
        "Duration of the last collection.",
        ["node", "collector"],
    )
    for name, v in sorted(snap.collect_duration_s.items()):
        dur.add_metric([node, name], v)
    yield dur
    yield _labelled_counter(
        "trainguard_agent_collect_errors_total",
        "Collector failures.",
        node,
        "collector",
        snap.collect_errors_total,
    )
    yield _labelled_counter(
        "trainguard_agent_reports_total",
        "Reports to the controller, by result.",
        node,
        "result",
        snap.reports_total,
    )
    current = _gauge(
        "trainguard_agent_controller_current",
        "1 for the controller reports go to now, 0 for the other configured ones.",
        ["node", "url"],
    )
    for url in snap.controller_urls:  # the configured list: bounded (MAX_CONTROLLER_URLS)
        current.add_metric([node, url], _b(url == snap.controller_current))
    yield current
    yield _labelled_counter(
        "trainguard_agent_controller_switches_total",
        "Moves to another controller, by reason (leader_redirect: a standby named the "
        "leader; unreachable; unavailable: a 503 naming no leader to follow; "
        "leader_not_listed: it named one outside controller.urls).",
        node,
        "reason",
        snap.controller_switches_total,
    )
    received = _counter(
        "trainguard_agent_heartbeats_received_total", "Heartbeats accepted.", ["node"]
    )
    received.add_metric([node], snap.heartbeats_received_total)
    yield received
    yield _labelled_counter(
        "trainguard_agent_heartbeats_dropped_total",
        "Heartbeat datagrams dropped, by reason.",
        node,
        "reason",
        snap.heartbeats_dropped_total,
    )
    sent = _counter(
        "trainguard_agent_control_sent_total", "Control datagrams sent to ranks.", ["node"]
    )
    sent.add_metric([node], snap.control_sent_total)
    yield sent
    cerr = _counter(
        "trainguard_agent_control_errors_total",
        "Control datagrams that could not be sent.",
        ["node"],
    )
    cerr.add_metric([node], snap.control_errors_total)
    yield cerr
    spool = _gauge("trainguard_agent_spool_events", "Events waiting for acknowledgement.", ["node"])
    spool.add_metric([node], snap.spool_events)
    yield spool
    sdrop = _counter(
        "trainguard_agent_spool_dropped_events_total",
        "Events dropped because the spool was full.",
        ["node"],
    )
    sdrop.add_metric([node], snap.spool_dropped_total)
    yield sdrop
    yield _labelled_counter(
        "trainguard_agent_events_total",
        "Events spooled, by kind.",
        node,
        "kind",
        snap.events_total,
    )
    cmds = _counter(
        "trainguard_agent_commands_total",
        "Controller commands executed.",
        ["node", "kind", "result"],
    )
    for (kind, result), n in sorted(snap.commands_total.items()):
        cmds.add_metric([node, kind, result], n)
    yield cmds
    loops = _counter("trainguard_agent_loop_iterations_total", "Collect loop iterations.", ["node"])
    loops.add_metric([node], snap.loop_iterations_total)
    yield loops
    preempt = _gauge(
        "trainguard_agent_preemption_notice",
        "1 once the cloud announced this VM's preemption or termination.",
        ["node"],
    )
    preempt.add_metric([node], _b(snap.preemption_notice))
    yield preempt
    stale = _gauge(
        "trainguard_agent_source_stale",
        "1 while a collection source's call has overrun its deadline (its values are old).",
        ["node", "source"],
    )
    for name, is_stale in sorted(snap.source_stale.items()):
        stale.add_metric([node, name], _b(is_stale))
    yield stale
    success = _gauge(
        "trainguard_agent_source_last_success_timestamp_seconds",
        "Unix time a collection source's last call returned without error.",
        ["node", "source"],
    )
    for name, ts in sorted(snap.source_last_success_unix.items()):
        success.add_metric([node, name], ts)
    yield success


def _labelled_counter(
    name: str, doc: str, node: str, label: str, values: Mapping[str, int]
) -> CounterMetricFamily:
    fam = _counter(name, doc, ["node", label])
    for key, n in sorted(values.items()):
        fam.add_metric([node, key], n)
    return fam


class SnapshotCollector:
    """A prometheus_client collector over the latest snapshot (None before the first tick)."""

    def __init__(
        self,
        get_snapshot: Callable[[], AgentSnapshot | None],
        *,
        xid_severity: Callable[[int], str] | None = None,
    ) -> None:
        self._get = get_snapshot
        self._xid_severity = xid_severity

    def collect(self) -> Iterable[Metric]:
        snap = self._get()
        if snap is None:
            return []
        return metric_families(snap, xid_severity=self._xid_severity)

    def describe(self) -> Iterable[Metric]:
        return []  # families vary with hardware; describing would freeze them


def render(collector: SnapshotCollector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)


# --- HTTP ----------------------------------------------------------------------------------


FaultInjector = Callable[[FaultSpec], dict[str, Any]]


class AgentHttpServer:
    """/metrics, /healthz and (sim only, loopback only) POST /v1/faults, in a thread."""

    def __init__(
        self,
        *,
        address: str,
        port: int,
        collector: SnapshotCollector,
        health: Callable[[], tuple[bool, str]],
        inject: FaultInjector | None,
    ) -> None:
        self._collector = collector
        self._health = health
        self._inject = inject
        handler = _make_handler(self)
        self._httpd = ThreadingHTTPServer((address, port), handler)
        self._httpd.daemon_threads = True
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="http",
            daemon=True,
        )

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2.0)


def _is_loopback(host: str) -> bool:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


def _make_handler(server: AgentHttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "trainguard-agent"
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per scrape would drown the journal

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, status: int, obj: dict[str, Any]) -> None:
            self._send(status, json.dumps(obj).encode() + b"\n", "application/json")

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, render(server._collector), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                ok, why = server._health()
                self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
            else:
                self._json(404, {"detail": f"no such path {path!r}"})

        do_HEAD = do_GET

        def do_POST(self) -> None:
            path = self.path.split("?", 1)[0]
            if path != "/v1/faults":
                self._json(404, {"detail": f"no such path {path!r}"})
                return
            if not _is_loopback(self.client_address[0]):
                self._json(403, {"detail": "fault injection is accepted from loopback only"})
                return
            if server._inject is None:
                self._json(404, {"detail": "fault injection needs the sim GPU backend"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._json(411, {"detail": "Content-Length required"})
                return
            if length > FAULT_BODY_MAX_BYTES:
                self._json(413, {"detail": f"body larger than {FAULT_BODY_MAX_BYTES} bytes"})
                return
            raw = self.rfile.read(length)
            try:
                spec = from_wire(FaultSpec, json.loads(raw))
            except ValueError as e:  # ProtocolError and JSON errors alike
                detail = str(e) if isinstance(e, ProtocolError) else f"invalid JSON: {e}"
                self._json(400, {"detail": detail})
                return
            try:
                result = server._inject(spec)
            except ValueError as e:
                self._json(400, {"detail": str(e)})
                return
            self._json(200, {"ok": True, **result})

    return Handler
