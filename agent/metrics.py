"""Prometheus exposition of the agent's latest samples, and its small HTTP server.

`metric_families(snapshot)` is a pure function from an `AgentSnapshot` (what the collect loop
last saw) to metric families: the hardware and trainer families are built from the contract's
signal table (`trainguard.signals`), the agent's own from `OWN_METRICS`. `SnapshotCollector`
plugs it into a prometheus_client registry.
`AgentHttpServer` serves /metrics, /healthz and, for loopback clients of a sim-backend agent
only, POST /v1/faults (local fault injection). No value can break the exposition: one that
has no sample value (`trainguard.bounds.metric_value`) is skipped and counted.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import operator
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
from trainguard.signals import (
    IB_COUNTERS,
    IB_HW_COUNTERS,
    SIGNALS,
    Signal,
    by_key,
    ib_counter_prom,
)
from trainguard.xid_catalog import MAX_XID_CODE, XidCatalog

log = logging.getLogger("trainguard.agent.metrics")

FAULT_BODY_MAX_BYTES = 64 * 1024


@dataclass(frozen=True)
class AgentSnapshot:
    """Everything /metrics shows, as of the end of one collect tick (immutable)."""

    node: str
    version: str
    gpus: tuple[GpuSample, ...] = ()
    ib_ports: tuple[IbPortSample, ...] = ()
    ranks: tuple[RankState, ...] = ()
    # (gpu index, xid label, severity label) -> XIDs seen since the agent started; the labels
    # of one line come from `xid_labels`
    xid_total: Mapping[tuple[int, str, str], int] = field(default_factory=dict)
    # /dev/kmsg records a user process wrote (refused: only the kernel reports XIDs)
    kmsg_non_kernel_records_total: int = 0
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
    # the `sender_not_allowed` drops by refusal (agent.senders.REFUSALS)
    heartbeat_senders_refused_total: Mapping[str, int] = field(default_factory=dict)
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
    # the warm standby (agent.standby): one is ready; how many were started; start -> ready
    # of the newest ready one (None: none yet)
    standby_ready: bool = False
    standbys_started_total: int = 0
    standby_ready_s: float | None = None


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


# --- the agent's own families (not signals): name -> (type, help, labels) -------------------

OWN_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "trainguard_ib_port_unreadable_files": (
        "gauge",
        "sysfs files that could not be read.",
        ("node", "device", "port"),
    ),
    "trainguard_trainer_checkpoint_duration_seconds": (
        "gauge",
        "Save time of the rank's newest committed checkpoint (snapshot to commit).",
        ("node", "job", "rank"),
    ),
    "trainguard_trainer_checkpoint_timestamp_seconds": (
        "gauge",
        "Unix time the agent saw the rank's newest checkpoint commit.",
        ("node", "job", "rank"),
    ),
    "trainguard_agent_info": ("gauge", "Agent build information (always 1).", ("node", "version")),
    "trainguard_agent_collect_duration_seconds": (
        "gauge",
        "Duration of the last collection.",
        ("node", "collector"),
    ),
    "trainguard_agent_collect_errors_total": (
        "counter",
        "Collector failures.",
        ("node", "collector"),
    ),
    "trainguard_agent_reports_total": (
        "counter",
        "Reports to the controller, by result.",
        ("node", "result"),
    ),
    "trainguard_agent_controller_current": (
        "gauge",
        "1 for the controller reports go to now, 0 for the other configured ones.",
        ("node", "url"),
    ),
    "trainguard_agent_controller_switches_total": (
        "counter",
        "Moves to another controller, by reason (leader_redirect: a standby named the "
        "leader; unreachable; unavailable: a 503 naming no leader to follow; "
        "leader_not_listed: it named one outside controller.urls).",
        ("node", "reason"),
    ),
    "trainguard_agent_heartbeats_received_total": ("counter", "Heartbeats accepted.", ("node",)),
    "trainguard_agent_heartbeats_dropped_total": (
        "counter",
        "Heartbeat datagrams dropped, by reason.",
        ("node", "reason"),
    ),
    "trainguard_agent_heartbeat_senders_refused_total": (
        "counter",
        "Heartbeats refused because the sending process may not speak for that job or rank, "
        "by reason (other_job, not_the_jobs_process, owned_by_another_sender, rank_taken, "
        "too_many_jobs).",
        ("node", "reason"),
    ),
    "trainguard_agent_control_sent_total": (
        "counter",
        "Control datagrams sent to ranks.",
        ("node",),
    ),
    "trainguard_agent_control_errors_total": (
        "counter",
        "Control datagrams that could not be sent.",
        ("node",),
    ),
    "trainguard_agent_spool_events": ("gauge", "Events waiting for acknowledgement.", ("node",)),
    "trainguard_agent_spool_dropped_events_total": (
        "counter",
        "Events dropped because the spool was full.",
        ("node",),
    ),
    "trainguard_agent_events_total": ("counter", "Events spooled, by kind.", ("node", "kind")),
    "trainguard_agent_commands_total": (
        "counter",
        "Controller commands executed.",
        ("node", "kind", "result"),
    ),
    "trainguard_agent_loop_iterations_total": (
        "counter",
        "Collect loop iterations.",
        ("node",),
    ),
    "trainguard_agent_standby_ready": (
        "gauge",
        "1 while a warm standby process is ready on this spare node.",
        ("node",),
    ),
    "trainguard_agent_standbys_started_total": (
        "counter",
        "Warm standby processes started (first, replacements after use, restarts).",
        ("node",),
    ),
    "trainguard_agent_standby_ready_seconds": (
        "gauge",
        "Start to ready (torch and the job's module imported) of the newest ready standby.",
        ("node",),
    ),
    "trainguard_agent_preemption_notice": (
        "gauge",
        "1 once the cloud announced this VM's preemption or termination.",
        ("node",),
    ),
    "trainguard_agent_source_stale": (
        "gauge",
        "1 while a collection source's call has overrun its deadline (its values are old).",
        ("node", "source"),
    ),
    "trainguard_agent_source_last_success_timestamp_seconds": (
        "gauge",
        "Unix time a collection source's last call returned without error.",
        ("node", "source"),
    ),
    "trainguard_agent_kmsg_non_kernel_records_total": (
        "counter",
        "Kernel log records refused as XID sources because a user process wrote them.",
        ("node",),
    ),
    "trainguard_agent_metric_values_skipped_total": (
        "counter",
        "Samples left out of /metrics because their value could not be exported.",
        ("node",),
    ),
}


_MetricFamily = GaugeMetricFamily | CounterMetricFamily


def _own(name: str) -> _MetricFamily:
    kind, doc, labels = OWN_METRICS[name]
    make = _counter if kind == "counter" else _gauge
    return make(name, doc, list(labels))


# --- signal families, from the contract's signal table --------------------------------------

# the identity labels of a sample of each exported scope
SCOPE_LABELS: dict[str, tuple[str, ...]] = {
    "gpu": ("node", "gpu", "uuid"),
    "nvlink": ("node", "gpu", "uuid", "link"),
    "ib_port": ("node", "device", "port"),
    "rank": ("node", "job", "rank"),
}


@dataclass(frozen=True)
class _Family:
    """One exported family of a signal table: its type, help and label names."""

    name: str
    type: str
    help: str
    labels: tuple[str, ...]

    def new(self) -> _MetricFamily:
        make = _counter if self.type == "counter" else _gauge
        return make(self.name, self.help, list(self.labels))


@dataclass(frozen=True)
class _Row:
    """A signal read off a sample: the family it goes to, its fixed label values, its value."""

    family: int  # index into the plan's families
    read: Callable[[Any], Any]
    labels: tuple[str, ...]
    mul: float
    div: float


class _Plan:
    """How the sample signals of one scope become families, in table order."""

    def __init__(self, scope: str, signals: Iterable[Signal]) -> None:
        self.families: list[_Family] = []
        self.rows: list[_Row] = []
        index: dict[str, int] = {}
        for s in signals:
            p = s.prom
            if s.scope != scope or p is None or (p.read is None and not s.field):
                continue  # not read off a sample (XIDs, counter files: see below)
            labels = SCOPE_LABELS[scope] + tuple(k for k, _ in p.labels)
            if p.name not in index:
                index[p.name] = len(self.families)
                self.families.append(_Family(p.name, s.type, p.help, labels))
            read = p.read if p.read is not None else operator.attrgetter(s.name)
            self.rows.append(_Row(index[p.name], read, tuple(v for _, v in p.labels), p.mul, p.div))

    def build(self, samples: Iterable[tuple[list[str], Any]]) -> list[_MetricFamily]:
        fams = [f.new() for f in self.families]
        for labels, sample in samples:
            for row in self.rows:
                v = row.read(sample)
                if v is None:
                    continue
                if isinstance(v, bool):
                    v = _b(v)
                elif row.mul != 1 or row.div != 1:
                    v = v * row.mul / row.div
                fams[row.family].add_metric([*labels, *row.labels], v)
        return fams


class _Plans:
    """The plans of one signal table (computed once per table)."""

    def __init__(self, signals: tuple[Signal, ...]) -> None:
        self.signals = signals
        self.gpu = _Plan("gpu", signals)
        self.nvlink = _Plan("nvlink", signals)
        self.ib_port = _Plan("ib_port", signals)
        self.rank = _Plan("rank", signals)
        keyed = by_key(signals)
        self.xid = keyed["gpu", "xid_total"].prom
        # the families of the sysfs counter files, in the order of the table's counters
        ib: dict[str, _Family] = {}
        for hw, names in ((False, IB_COUNTERS), (True, IB_HW_COUNTERS)):
            for n in names:
                p = ib_counter_prom(n, hw=hw)
                labels = SCOPE_LABELS["ib_port"] + tuple(k for k, _ in p.labels)
                ib.setdefault(p.name, _Family(p.name, "counter", p.help, labels))
        self.ib_counters = ib


_PLANS: dict[int, _Plans] = {}


def _plans(signals: tuple[Signal, ...]) -> _Plans:
    found = _PLANS.get(id(signals))
    if found is None or found.signals is not signals:
        found = _PLANS[id(signals)] = _Plans(signals)
    return found


XID_OTHER = "other"  # the xid label of a code outside 1..MAX_XID_CODE (garbage, not an XID)
XID_UNKNOWN = "unknown"  # the severity label of a code the catalog does not list


def xid_labels(catalog: XidCatalog, code: int, message: str) -> tuple[str, str]:
    """The (xid, severity) labels of one XID line: the severity is the catalog's for this
    line (`classify`: NVLink5 by its Fatal/Nonfatal word, 154 by its recovery action),
    "unknown" for a code not in the catalog. Codes beyond 1..MAX_XID_CODE share the xid label
    "other", so a garbled kernel log cannot make a series per number."""
    if not 0 < code <= MAX_XID_CODE:
        return XID_OTHER, XID_UNKNOWN
    info = catalog.classify(code, message)
    return str(code), info.severity if info.known else XID_UNKNOWN


def metric_families(
    snap: AgentSnapshot,
    *,
    signals: tuple[Signal, ...] = SIGNALS,
) -> list[Metric]:
    """The metric families for one snapshot. Absent (None) fields give no sample. `signals`:
    the signal table the hardware and trainer families are built from."""
    node = snap.node
    plans = _plans(signals)
    out: list[Metric] = []
    groups: list[Callable[[], Iterable[Metric]]] = [
        lambda: _gpu_families(snap, node, plans),
        lambda: _nvlink_families(snap, node, plans),
        lambda: _ib_families(snap, node, plans),
        lambda: _trainer_families(snap, node, plans),
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
    skipped = _own("trainguard_agent_metric_values_skipped_total")
    skipped.add_metric([node], SKIPPED.total)
    out.append(skipped)
    return out


def _gpu_families(snap: AgentSnapshot, node: str, plans: _Plans) -> Iterator[Metric]:
    yield from plans.gpu.build(([node, str(g.index), g.uuid], g) for g in snap.gpus)
    if plans.xid is None:
        return
    uuids = {g.index: g.uuid for g in snap.gpus}
    xid = _counter(plans.xid.name, plans.xid.help, [*SCOPE_LABELS["gpu"], "xid", "severity"])
    for (gpu, code, severity), n in sorted(snap.xid_total.items()):
        xid.add_metric([node, str(gpu), uuids.get(gpu, ""), code, severity], n)
    yield xid


def _nvlink_families(snap: AgentSnapshot, node: str, plans: _Plans) -> Iterator[Metric]:
    yield from plans.nvlink.build(
        ([node, str(g.index), g.uuid, str(link.link)], link)
        for g in snap.gpus
        for link in g.nvlinks
    )


def _ib_families(snap: AgentSnapshot, node: str, plans: _Plans) -> Iterator[Metric]:
    yield from plans.ib_port.build(([node, p.device, str(p.port)], p) for p in snap.ib_ports)
    fams = {name: f.new() for name, f in plans.ib_counters.items()}
    unreadable = _own("trainguard_ib_port_unreadable_files")
    for p in snap.ib_ports:
        labels = [node, p.device, str(p.port)]
        for hw, counters in ((False, p.counters), (True, p.hw_counters)):
            for name, raw in sorted(counters.items()):
                prom = ib_counter_prom(name, hw=hw)
                v = raw * prom.mul / prom.div if prom.mul != 1 or prom.div != 1 else raw
                fams[prom.name].add_metric([*labels, *(lv for _, lv in prom.labels)], v)
        unreadable.add_metric(labels, len(p.unreadable))
    yield from fams.values()
    yield unreadable


def _trainer_families(snap: AgentSnapshot, node: str, plans: _Plans) -> Iterator[Metric]:
    yield from plans.rank.build(([node, r.job, str(r.rank)], r) for r in snap.ranks)
    duration = _own("trainguard_trainer_checkpoint_duration_seconds")
    stamp = _own("trainguard_trainer_checkpoint_timestamp_seconds")
    for (job, rank), (duration_s, committed_at) in sorted(snap.checkpoints.items()):
        labels = [node, job, str(rank)]
        if duration_s is not None:
            duration.add_metric(labels, duration_s)
        stamp.add_metric(labels, committed_at)
    yield from (duration, stamp)


def _agent_families(snap: AgentSnapshot, node: str) -> Iterator[Metric]:
    info = _own("trainguard_agent_info")
    info.add_metric([node, snap.version], 1.0)
    yield info
    dur = _own("trainguard_agent_collect_duration_seconds")
    for name, v in sorted(snap.collect_duration_s.items()):
        dur.add_metric([node, name], v)
    yield dur
    yield _labelled("trainguard_agent_collect_errors_total", node, snap.collect_errors_total)
    yield _labelled("trainguard_agent_reports_total", node, snap.reports_total)
    current = _own("trainguard_agent_controller_current")
    for url in snap.controller_urls:  # the configured list: bounded (MAX_CONTROLLER_URLS)
        current.add_metric([node, url], _b(url == snap.controller_current))
    yield current
    yield _labelled(
        "trainguard_agent_controller_switches_total", node, snap.controller_switches_total
    )
    yield _single(
        "trainguard_agent_heartbeats_received_total", node, snap.heartbeats_received_total
    )
    yield _labelled(
        "trainguard_agent_heartbeats_dropped_total", node, snap.heartbeats_dropped_total
    )
    yield _labelled(
        "trainguard_agent_heartbeat_senders_refused_total",
        node,
        snap.heartbeat_senders_refused_total,
    )
    yield _single("trainguard_agent_control_sent_total", node, snap.control_sent_total)
    yield _single("trainguard_agent_control_errors_total", node, snap.control_errors_total)
    yield _single("trainguard_agent_spool_events", node, snap.spool_events)
    yield _single("trainguard_agent_spool_dropped_events_total", node, snap.spool_dropped_total)
    yield _single(
        "trainguard_agent_kmsg_non_kernel_records_total", node, snap.kmsg_non_kernel_records_total
    )
    yield _labelled("trainguard_agent_events_total", node, snap.events_total)
    cmds = _own("trainguard_agent_commands_total")
    for (kind, result), n in sorted(snap.commands_total.items()):
        cmds.add_metric([node, kind, result], n)
    yield cmds
    yield _single("trainguard_agent_loop_iterations_total", node, snap.loop_iterations_total)
    yield _single("trainguard_agent_preemption_notice", node, _b(snap.preemption_notice))
    yield _single("trainguard_agent_standby_ready", node, _b(snap.standby_ready))
    yield _single("trainguard_agent_standbys_started_total", node, snap.standbys_started_total)
    if snap.standby_ready_s is not None:
        yield _single("trainguard_agent_standby_ready_seconds", node, snap.standby_ready_s)
    stale = _own("trainguard_agent_source_stale")
    for name, is_stale in sorted(snap.source_stale.items()):
        stale.add_metric([node, name], _b(is_stale))
    yield stale
    success = _own("trainguard_agent_source_last_success_timestamp_seconds")
    for name, ts in sorted(snap.source_last_success_unix.items()):
        success.add_metric([node, name], ts)
    yield success


def _single(name: str, node: str, value: float) -> _MetricFamily:
    fam = _own(name)
    fam.add_metric([node], value)
    return fam


def _labelled(name: str, node: str, values: Mapping[str, float]) -> _MetricFamily:
    fam = _own(name)
    for key, n in sorted(values.items()):
        fam.add_metric([node, key], n)
    return fam


class SnapshotCollector:
    """A prometheus_client collector over the latest snapshot (None before the first tick)."""

    def __init__(self, get_snapshot: Callable[[], AgentSnapshot | None]) -> None:
        self._get = get_snapshot

    def collect(self) -> Iterable[Metric]:
        snap = self._get()
        if snap is None:
            return []
        return metric_families(snap)

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
