"""Per-target signal values and bounded history, fed by agent reports; read by the rules engine.

`SignalState` keeps the latest sample of every GPU, NVLink, IB port, node, rank and job, plus
event-derived counters (XIDs, lost GPUs, NaN losses) and a bounded change history for the
signals that windowed functions (`rate`, `increase`, `changes`, `*_over_time`) and `age()` read.
`SIGNALS` is the catalogue of every signal name per scope: the rule loader checks names
against it and docs/rules.md documents it.

History is stored on change only: a series is created the first time a tracked value changes,
and a new point is appended at most every `min_spacing_s` (changes in between are merged into
the last point, which keeps cumulative increase and change counts exact). A series therefore
holds at most `history_s / min_spacing_s + 2` points, and a value that never changes costs
nothing beyond the latest sample.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trainguard.model import (
    GPU_VALUE_FIELDS,
    NVLINK_VALUE_FIELDS,
    GpuSample,
    IbPortSample,
    NvLinkSample,
)
from trainguard.protocol import Event, RankState, Report

__all__ = [
    "DEFAULT_TRACKED",
    "FALLBACK_FATAL_XIDS",
    "IB_COUNTERS",
    "IB_HW_COUNTERS",
    "SCOPES",
    "SIGNALS",
    "EvalContext",
    "Series",
    "SignalSpec",
    "SignalState",
    "XidCatalog",
]

SCOPES: tuple[str, ...] = ("gpu", "nvlink", "ib_port", "node", "rank", "job")

# Used only while trainguard.xid_catalog cannot be imported: the XIDs NVIDIA documents as needing a
# GPU reset, node reboot or replacement (DBE, NVLink, off the bus, row-remap failures, ...).
FALLBACK_FATAL_XIDS: frozenset[int] = frozenset({48, 74, 79, 92, 94, 95, 119, 120})


_INTERN_MAX = 200_000  # distinct GPU/link value tuples remembered for the quiet-target memo
_EVENT_ATTRS = frozenset({"xid_total", "xid_fatal_total", "xid_last_code", "gpu_lost_total"})


class XidCatalog(Protocol):
    """The part of `trainguard.xid_catalog.XidCatalog` this module needs."""

    def fatal_codes(self) -> frozenset[int]: ...


@dataclass(frozen=True)
class SignalSpec:
    """One signal: its value type ("number" or "string"), whether it is a counter (only ever
    increases, except on a reset), and a line of documentation."""

    kind: str
    counter: bool
    doc: str


def _n(doc: str, *, counter: bool = False) -> SignalSpec:
    return SignalSpec("number", counter, doc)


def _s(doc: str) -> SignalSpec:
    return SignalSpec("string", False, doc)


_GPU_DOCS: dict[str, str] = {
    "lost": "1 if NVML said GpuIsLost or the GPU fell off the bus (bool)",
    "temperature_celsius": "GPU core temperature, degrees C",
    "power_watts": "power draw, W",
    "utilization_gpu_percent": "percent of time a kernel was running",
    "utilization_memory_percent": "percent of time memory was read or written",
    "memory_used_bytes": "GPU memory in use, bytes",
    "memory_total_bytes": "GPU memory installed, bytes",
    "sm_clock_mhz": "current SM clock, MHz",
    "clock_event_reasons": "raw NVML clock-event (throttle) reason bitmask",
    "throttle_hw_slowdown": "1 while HW slowdown is active (bool)",
    "throttle_hw_thermal": "1 while HW thermal slowdown is active (bool)",
    "throttle_sw_thermal": "1 while SW thermal slowdown is active (bool)",
    "throttle_power_brake": "1 while the external power brake is asserted (bool)",
    "ecc_corrected_volatile_total": "corrected ECC errors since driver load (counter)",
    "ecc_uncorrected_volatile_total": "uncorrected ECC errors since driver load (counter)",
    "ecc_corrected_aggregate_total": "corrected ECC errors, lifetime (counter)",
    "ecc_uncorrected_aggregate_total": "uncorrected ECC errors, lifetime (counter)",
    "remapped_rows_correctable": "rows remapped for correctable errors",
    "remapped_rows_uncorrectable": "rows remapped for uncorrectable errors",
    "remapped_rows_pending": "1 if a row remapping waits for a GPU reset (bool)",
    "remapped_rows_failure": "1 if a row remapping failed (bool)",
    "retired_pages_sbe": "pages retired for single-bit errors",
    "retired_pages_dbe": "pages retired for double-bit errors",
    "retired_pages_pending": "1 if a page retirement waits for a reboot (bool)",
    "pcie_replay_total": "PCIe replay counter (counter)",
}

# Standard sysfs counters/ files (IB PMA) and common mlx5 hw_counters/ files. A rule may name
# any of them; the loader rejects other names so a typo cannot silently never fire.
IB_COUNTERS: tuple[str, ...] = (
    "symbol_error",
    "link_error_recovery",
    "link_downed",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_discards",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
    "port_xmit_wait",
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "unicast_xmit_packets",
    "unicast_rcv_packets",
    "multicast_xmit_packets",
    "multicast_rcv_packets",
)
IB_HW_COUNTERS: tuple[str, ...] = (
    "duplicate_request",
    "implied_nak_seq_err",
    "lifespan",
    "local_ack_timeout_err",
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "req_cqe_error",
    "req_cqe_flush_error",
    "req_remote_access_errors",
    "req_remote_invalid_request",
    "resp_cqe_error",
    "resp_cqe_flush_error",
    "resp_local_length_error",
    "resp_remote_access_errors",
    "rnr_nak_retry_err",
    "roce_adp_retrans",
    "roce_adp_retrans_to",
    "roce_slow_restart",
    "roce_slow_restart_cnps",
    "roce_slow_restart_trans",
    "rp_cnp_handled",
    "rp_cnp_ignored",
    "rx_atomic_requests",
    "rx_icrc_encapsulated",
    "rx_read_requests",
    "rx_write_requests",
)
# Counters whose values move on every healthy second (traffic): never tracked by default.
_IB_TRAFFIC = frozenset(
    {
        "port_xmit_data",
        "port_rcv_data",
        "port_xmit_packets",
        "port_rcv_packets",
        "unicast_xmit_packets",
        "unicast_rcv_packets",
        "multicast_xmit_packets",
        "multicast_rcv_packets",
        "port_xmit_wait",
        "rx_atomic_requests",
        "rx_read_requests",
        "rx_write_requests",
        "lifespan",
    }
)

_RANK_DOCS: dict[str, str] = {
    "step": "latest training step",
    "loss": "latest loss (may be NaN/Inf)",
    "grad_norm": "latest gradient norm",
    "samples_per_s": "rank throughput, samples/s",
    "tokens_per_s": "rank throughput, tokens/s",
    "step_time_s": "duration of the latest step, s",
    "compute_time_s": "the rank's own work in the latest step (no collective waits), s",
    "heartbeat_age_s": "s since the rank's last heartbeat, plus the age of the node's report",
    "step_age_s": "s since the rank's step last changed, plus the age of the node's report",
    "ckpt_step": "newest committed checkpoint step",
}


def _build_catalogue() -> dict[str, dict[str, SignalSpec]]:
    gpu: dict[str, SignalSpec] = {
        name: _n(_GPU_DOCS.get(name, name), counter=name.endswith("_total"))
        for name in GPU_VALUE_FIELDS
    }
    gpu["xid_total"] = _n("XID events on this GPU seen by the controller (counter)", counter=True)
    gpu["xid_fatal_total"] = _n(
        "XID events whose catalog severity is fatal (counter)", counter=True
    )
    gpu["xid_last_code"] = _n("code of the most recent XID on this GPU")
    gpu["gpu_lost_total"] = _n("gpu_lost / fallen_off_bus events (counter)", counter=True)
    nvlink: dict[str, SignalSpec] = {
        "up": _n("1 if the link is active (bool)"),
        "crc_flit_errors_total": _n("CRC flit errors (counter)", counter=True),
        "crc_data_errors_total": _n("CRC data errors (counter)", counter=True),
        "replay_errors_total": _n("replay errors (counter)", counter=True),
        "recovery_errors_total": _n("recovery errors (counter)", counter=True),
    }
    assert set(nvlink) == set(NVLINK_VALUE_FIELDS), "NvLinkSample changed: update SIGNALS"
    ib: dict[str, SignalSpec] = {
        "up": _n("1 if the port state is ACTIVE (state_code 4)"),
        "phys_up": _n("1 if the physical state is LinkUp (phys_state_code 5)"),
        "rate_gbps": _n("negotiated rate, Gb/s"),
    }
    for name in IB_COUNTERS:
        ib[name] = _n(f"sysfs counters/{name} (counter)", counter=True)
    for name in IB_HW_COUNTERS:
        ib.setdefault(name, _n(f"sysfs hw_counters/{name} (counter)", counter=True))
    node: dict[str, SignalSpec] = {
        "report_age_s": _n("s since the controller last received a report from the node"),
        "gpus": _n("GPUs in the node's latest report"),
        "gpus_lost": _n("GPUs marked lost in the latest report, plus GPUs that disappeared"),
        "ib_ports": _n("IB ports in the node's latest report"),
        "ib_ports_down": _n("IB ports whose state is not ACTIVE"),
        "xid_total": _n("XID events on the node, any GPU (counter)", counter=True),
        "xid_fatal_total": _n("fatal XID events on the node, any GPU (counter)", counter=True),
        "preemption_total": _n(
            "preemption_notice events from the node's agent (counter)", counter=True
        ),
        "role": _s('"active" or "spare" (controller inventory, else the agent\'s hint)'),
        "state": _s('"active", "draining" or "drained" (controller inventory)'),
        "job": _s("the job the node is assigned to (absent when none)"),
    }
    rank: dict[str, SignalSpec] = {name: _n(doc) for name, doc in _RANK_DOCS.items()}
    rank["nan_total"] = _n("nan_loss events from this rank (counter)", counter=True)
    rank["phase"] = _s('"init", "train", "checkpoint", "eval", "stopping" or "exit"')
    job: dict[str, SignalSpec] = {
        "ranks": _n("ranks the controller knows for the job"),
        "ranks_reporting": _n(
            "ranks whose heartbeat (plus report age) is fresher than stale_after_s"
        ),
        "world_size": _n("largest world_size any rank reports"),
        "step": _n("highest step over the job's ranks"),
        "samples_per_s": _n("sum of the ranks' samples_per_s"),
        "step_age_s": _n(
            "lowest step_age_s over the ranks (incl. report age): time since any progress"
        ),
        "heartbeat_age_s": _n("lowest heartbeat_age_s over the ranks (incl. report age)"),
        "nan_total": _n("nan_loss events from any rank of the job (counter)", counter=True),
        "state": _s("job state from the controller's job table"),
    }
    return {"gpu": gpu, "nvlink": nvlink, "ib_port": ib, "node": node, "rank": rank, "job": job}


SIGNALS: Mapping[str, Mapping[str, SignalSpec]] = _build_catalogue()

# Signals whose history is kept without being asked: counters, booleans and link states (they
# change rarely, so store-on-change keeps them cheap), plus job throughput for the default
# throughput-drop rule. Gauges that move every second (temperatures, per-rank step, traffic)
# are kept only when a loaded rule needs them: see `SignalState.track`.
DEFAULT_TRACKED: Mapping[str, frozenset[str]] = {
    "gpu": frozenset(
        n
        for n in SIGNALS["gpu"]
        if n.endswith("_total")
        or n.startswith(("remapped_rows", "retired_pages", "throttle_"))
        or n in ("lost", "xid_last_code")
    ),
    "nvlink": frozenset(SIGNALS["nvlink"]),
    "ib_port": frozenset(n for n in SIGNALS["ib_port"] if n not in _IB_TRAFFIC),
    "node": frozenset(
        {
            "gpus",
            "gpus_lost",
            "ib_ports",
            "ib_ports_down",
            "xid_total",
            "xid_fatal_total",
            "preemption_total",
        }
    ),
    "rank": frozenset({"nan_total", "ckpt_step"}),
    "job": frozenset({"ranks", "ranks_reporting", "step", "samples_per_s", "nan_total"}),
}


class Series:
    """Bounded change history of one numeric signal.

    Each point is [t_first, t_last, value, acc, changes, hi, lo]: the value at t_last, `acc` the
    cumulative increase since the series began (a decrease counts as a counter reset, as in
    Prometheus), `changes` the cumulative number of value changes, hi/lo the extremes merged
    into the point.
    """

    __slots__ = ("points",)

    def __init__(self, t: float, value: float) -> None:
        self.points: deque[list[float]] = deque([[t, t, value, 0.0, 0.0, value, value]])

    @property
    def value(self) -> float:
        return self.points[-1][2]

    @property
    def last_change_t(self) -> float:
        return self.points[-1][1]

    def update(self, t: float, value: float, *, min_spacing_s: float, horizon_s: float) -> None:
        pts = self.points
        last = pts[-1]
        prev = last[2]
        if value == prev or (math.isnan(value) and math.isnan(prev)):  # NaN: unchanged
            return
        acc = last[3]
        if math.isfinite(value) and math.isfinite(prev):
            acc += value - prev if value >= prev else value
        changes = last[4] + 1
        # Never merge into the first point: it is the baseline older windows are measured from.
        if len(pts) > 1 and t - last[0] < min_spacing_s:
            last[1] = t
            last[2] = value
            last[3] = acc
            last[4] = changes
            last[5] = max(last[5], value)
            last[6] = min(last[6], value)
            return
        pts.append([t, t, value, acc, changes, value, value])
        cutoff = t - horizon_s
        while len(pts) > 2 and pts[1][1] <= cutoff:
            pts.popleft()

    def _base(self, start: float) -> list[float]:
        """The point in effect at time `start` (or the first point if the series began later)."""
        pts = self.points
        for i in range(len(pts) - 1, -1, -1):
            if pts[i][1] <= start:
                return pts[i]
        return pts[0]

    def increase(self, now: float, window_s: float) -> float:
        return self.points[-1][3] - self._base(now - window_s)[3]

    def changes(self, now: float, window_s: float) -> float:
        return self.points[-1][4] - self._base(now - window_s)[4]

    def extreme(self, now: float, window_s: float, *, highest: bool) -> float:
        start = now - window_s
        base = self._base(start)
        best = base[2]
        for p in self.points:
            if p[1] > start and p is not base:
                v = p[5] if highest else p[6]
                best = max(best, v) if highest else min(best, v)
        return best

    def __len__(self) -> int:
        return len(self.points)


class _GpuRec:
    __slots__ = (
        "first_seen",
        "gpu_lost_total",
        "index",
        "link_series",
        "link_sig",
        "links_id",
        "sample",
        "series",
        "sig",
        "sig_id",
        "xid_fatal_total",
        "xid_last_code",
        "xid_total",
    )

    def __init__(self, index: int, sample: GpuSample | None, now: float) -> None:
        self.index = index
        self.sample = sample
        self.first_seen = now
        self.series: dict[str, Series] = {}
        self.link_series: dict[tuple[int, str], Series] = {}
        self.sig: Any = None  # tracked GPU values, as last seen
        self.link_sig: Any = None  # tracked NVLink values per link, as last seen
        self.sig_id: int | None = None  # interned (sig, event counters): see SignalState.walk
        self.links_id: int | None = None  # interned link_sig
        self.xid_total = 0
        self.xid_fatal_total = 0
        self.xid_last_code: int | None = None
        self.gpu_lost_total = 0


class _PortRec:
    __slots__ = ("first_seen", "sample", "series", "sig_id")

    def __init__(self, sample: IbPortSample, now: float) -> None:
        self.sample = sample
        self.first_seen = now
        self.series: dict[str, Series] = {}
        # Interned tracked values, for the quiet-target memo. Only read while `series` is
        # empty, i.e. while no tracked value has changed since the port was first seen.
        self.sig_id: int | None = None


class _NodeRec:
    __slots__ = (
        "first_seen",
        "gpus",
        "job",
        "last_report_at",
        "name",
        "ports",
        "preemption_total",
        "rank_keys",
        "role",
        "role_hint",
        "series",
        "state",
        "xid_fatal_total",
        "xid_total",
    )

    def __init__(self, name: str, now: float | None) -> None:
        self.name = name
        self.first_seen = now
        self.last_report_at: float | None = None
        self.gpus: dict[int, _GpuRec] = {}
        self.ports: dict[tuple[str, int], _PortRec] = {}
        self.rank_keys: set[tuple[str, int]] = set()
        self.role: str | None = None
        self.role_hint: str | None = None
        self.state: str | None = None
        self.job: str | None = None
        self.series: dict[str, Series] = {}
        self.xid_total = 0
        self.xid_fatal_total = 0
        self.preemption_total = 0


class _RankRec:
    __slots__ = ("first_seen", "job", "nan_total", "node", "rank", "received_at", "series", "state")

    def __init__(self, job: str, rank: int, node: str, now: float) -> None:
        self.job = job
        self.rank = rank
        self.node = node
        self.state: RankState | None = None
        self.received_at = now
        self.first_seen = now
        self.nan_total = 0
        self.series: dict[str, Series] = {}


class _JobRec:
    __slots__ = (
        "first_seen",
        "meta_nodes",
        "meta_state",
        "name",
        "nan_total",
        "ranks",
        "sampled_at",
        "series",
    )

    def __init__(self, name: str, now: float | None) -> None:
        self.name = name
        self.first_seen = now
        self.ranks: dict[int, _RankRec] = {}
        self.meta_nodes: tuple[str, ...] = ()
        self.meta_state: str | None = None
        self.nan_total = 0
        self.series: dict[str, Series] = {}
        self.sampled_at = -math.inf


class EvalContext:
    """What a compiled condition reads for one target (filled in by the engine per target)."""

    __slots__ = (
        "cache",
        "gpu",
        "job",
        "link",
        "node",
        "now",
        "port",
        "rank",
        "signals",
        "stale_after_s",
    )

    def __init__(self, signals: SignalState, *, now: float, stale_after_s: float) -> None:
        self.signals = signals
        self.now = now
        self.stale_after_s = stale_after_s
        self.node: Any = None
        self.gpu: Any = None
        self.link: Any = None
        self.port: Any = None
        self.rank: Any = None
        self.job: Any = None
        self.cache: dict[Any, Any] = {}  # per-tick aggregates (job_median, ...)


Getter = Callable[[EvalContext], Any]


class SignalState:
    """In-memory, per-target signal values and bounded history, fed by agent reports.

    Not thread-safe: the controller calls `ingest`/`set_*` and the engine's `evaluate` from one
    thread (or under one lock).
    """

    def __init__(
        self,
        *,
        xid_catalog: XidCatalog | None = None,
        history_s: float = 900.0,
        min_spacing_s: float = 5.0,
    ) -> None:
        if history_s <= 0:
            raise ValueError("history_s must be positive")
        if min_spacing_s < 0:
            raise ValueError("min_spacing_s must not be negative")
        self.history_s = history_s
        self.min_spacing_s = min_spacing_s
        self.fatal_xids = _fatal_codes(xid_catalog)
        self._nodes: dict[str, _NodeRec] = {}
        self._ranks: dict[tuple[str, int], _RankRec] = {}
        self._jobs: dict[str, _JobRec] = {}
        self._tracked: dict[str, set[str]] = {s: set(DEFAULT_TRACKED[s]) for s in SCOPES}
        self._interned: dict[Any, int] = {}
        self._next_id = 0
        # (rule name, condition text) -> ids of GPU/link states its condition is false for;
        # a transparent memo that lets a tick skip the thousands of quiet, identical targets.
        self._memo: dict[tuple[str, str], set[int]] = {}
        self._refresh_tracked()

    # --- configuration -------------------------------------------------------------------

    def track(self, needs: Mapping[str, Iterable[str]]) -> None:
        """Also keep history for these signals (scope -> names), e.g. `RuleSet.history_needs()`.
        History starts from the next change; unknown names raise ValueError."""
        for scope, names in needs.items():
            if scope not in SIGNALS:
                raise ValueError(f"unknown scope {scope!r}")
            for name in names:
                if name not in SIGNALS[scope]:
                    raise ValueError(f"unknown signal {name!r} for scope {scope}")
                self._tracked[scope].add(name)
        self._refresh_tracked()
        self._rekey()

    def is_tracked(self, scope: str, name: str) -> bool:
        return name in self._tracked[scope]

    def _refresh_tracked(self) -> None:
        t = self._tracked
        self._memo.clear()  # a newly tracked signal changes what windowed functions return
        self._gpu_fields = tuple(n for n in GPU_VALUE_FIELDS if n in t["gpu"])
        self._link_fields = tuple(n for n in NVLINK_VALUE_FIELDS if n in t["nvlink"])
        self._gpu_sig = _tuple_getter(self._gpu_fields)
        self._link_sig = _tuple_getter(("link", *self._link_fields))
        self._ib_sig_names = tuple(sorted(t["ib_port"]))
        self._ib_derived = tuple(n for n in ("up", "phys_up", "rate_gbps") if n in t["ib_port"])
        self._rank_fields = tuple(n for n in _RANK_DOCS if n in t["rank"])
        self._node_fields = tuple(
            n for n in ("gpus", "gpus_lost", "ib_ports", "ib_ports_down") if n in t["node"]
        )
        self._job_fields = tuple(
            n for n in ("ranks", "step", "samples_per_s", "world_size") if n in t["job"]
        )

    # --- feeding -------------------------------------------------------------------------

    def ingest(self, report: Report, *, now: float, new_events: Sequence[Event]) -> None:
        """Take one agent report received at `now` (controller's unix time). `new_events` are
        the report's events not seen before (the caller dedupes resends).

        A delta report (`full` is False) lists only changed GPUs, NVLinks and IB ports: they
        are merged into what is held, and nothing it leaves out is dropped."""
        node = self._nodes.get(report.node)
        if node is None:
            node = self._nodes[report.node] = _NodeRec(report.node, now)
        elif node.first_seen is None:
            node.first_seen = now
        node.last_report_at = now
        node.role_hint = report.role_hint
        delta = report.full is False
        self._ingest_gpus(node, report.gpus, now, delta=delta)
        self._ingest_ports(node, report.ib_ports, now, delta=delta)
        jobs_touched = self._ingest_ranks(node, report.ranks, now)
        for event in new_events:
            self._ingest_event(node, event, now, jobs_touched)
        if self._node_fields:
            for name in self._node_fields:
                v = _NODE_NUMERIC[name](node)
                self._record(node.series, name, node.first_seen or now, v, now)
        for job in jobs_touched:
            self._sample_job(job, now)

    def _record(
        self, series: dict[str, Series], name: str, since: float, value: Any, now: float
    ) -> None:
        """Note the current value of a tracked signal (appends only on change)."""
        if value is None:
            return
        s = series.get(name)
        if s is None:
            series[name] = Series(now, float(value))
            return
        s.update(now, float(value), min_spacing_s=self.min_spacing_s, horizon_s=self.history_s)

    def _change(
        self,
        series: dict[Any, Series],
        key: Any,
        *,
        since: float,
        old: Any,
        new: Any,
        now: float,
    ) -> None:
        """A tracked value went from `old` (held since `since` or the last change) to `new`."""
        s = series.get(key)
        if s is None:
            if old is None:
                series[key] = Series(now, float(new))
                return
            s = series[key] = Series(since, float(old))
        s.update(now, float(new), min_spacing_s=self.min_spacing_s, horizon_s=self.history_s)

    def _ingest_gpus(
        self, node: _NodeRec, gpus: Sequence[GpuSample], now: float, *, delta: bool = False
    ) -> None:
        seen: set[int] = set()
        fields = self._gpu_fields
        link_fields = self._link_fields
        gpu_sig = self._gpu_sig
        link_sig = self._link_sig
        for entry in gpus:
            g = entry
            seen.add(g.index)
            rec = node.gpus.get(g.index)
            sig = gpu_sig(g)
            if delta and rec is not None and rec.sample is not None:
                held_links = rec.sample.nvlinks
                if not entry.nvlinks:
                    # The usual delta entry: GPU values moved, its links did not. The sample
                    # was decoded for this ingest and is held by nothing else yet, so it takes
                    # the held links in place (dataclasses.replace cost 25 us a GPU).
                    object.__setattr__(entry, "nvlinks", held_links)
                    lsig = rec.link_sig
                else:
                    g = _merge_links(entry, held_links)
                    lsig = [link_sig(ln) for ln in g.nvlinks] if link_fields else None
            else:
                # One C-level getter call per GPU and per link gives comparable tuples of just
                # the tracked values; the field-by-field diff runs only when one of them moved.
                lsig = [link_sig(ln) for ln in g.nvlinks] if link_fields else None
            if rec is None:
                rec = node.gpus[g.index] = _GpuRec(g.index, g, now)
                rec.sig, rec.link_sig = sig, lsig
                self._reintern(rec)
                continue
            old = rec.sample
            rec.sample = g
            old_sig, old_lsig = rec.sig, rec.link_sig
            rec.sig, rec.link_sig = sig, lsig
            if old is None or sig != old_sig or lsig != old_lsig:
                self._reintern(rec)
            if old is None:
                for name in fields:
                    nv = getattr(g, name)
                    if nv is not None and name in rec.series:
                        self._change(rec.series, name, since=now, old=None, new=nv, now=now)
                continue
            if sig != old_sig:
                for name in fields:
                    nv = getattr(g, name)
                    ov = getattr(old, name)
                    if nv is not None and nv != ov:
                        self._change(
                            rec.series, name, since=rec.first_seen, old=ov, new=nv, now=now
                        )
            if lsig is not None and lsig != old_lsig:
                old_links = {ln.link: ln for ln in old.nvlinks}
                for ln in g.nvlinks:
                    ol = old_links.get(ln.link)
                    if ol is None:
                        continue
                    for name in link_fields:
                        nv = getattr(ln, name)
                        ov = getattr(ol, name)
                        if nv is not None and nv != ov:
                            self._change(
                                rec.link_series,
                                (ln.link, name),
                                since=rec.first_seen,
                                old=ov,
                                new=nv,
                                now=now,
                            )
        if delta:
            return  # an absent GPU is unchanged, never gone
        # A GPU that vanished from the report (off the bus) keeps its event counters and
        # history, but its sample-derived signals become absent.
        for index, rec in node.gpus.items():
            if index not in seen:
                rec.sample = None
                rec.sig = rec.link_sig = None
                rec.sig_id = rec.links_id = None

    def _ingest_ports(
        self, node: _NodeRec, ports: Sequence[IbPortSample], now: float, *, delta: bool = False
    ) -> None:
        seen: set[tuple[str, int]] = set()
        tracked = self._tracked["ib_port"]
        derived = self._ib_derived
        for p in ports:
            key = (p.device, p.port)
            seen.add(key)
            rec = node.ports.get(key)
            if rec is None:
                rec = node.ports[key] = _PortRec(p, now)
                rec.sig_id = self._port_id(p)
                continue
            old = rec.sample
            rec.sample = p
            rekey = False
            # the derived values come from these three fields, which rarely move
            if (p.state_code, p.phys_state_code, p.rate_gbps) != (
                old.state_code,
                old.phys_state_code,
                old.rate_gbps,
            ):
                for name in derived:
                    nv = _ib_value(p, name)
                    ov = _ib_value(old, name)
                    if nv is None:
                        rekey = rekey or ov is not None
                    elif nv != ov:
                        self._change(
                            rec.series, name, since=rec.first_seen, old=ov, new=nv, now=now
                        )
            # Counters dominate the cost: walk only the values that moved and are tracked.
            for new_map, old_map in ((p.counters, old.counters), (p.hw_counters, old.hw_counters)):
                if new_map == old_map:
                    continue
                if new_map.keys() != old_map.keys():
                    rekey = True  # a counter appeared or vanished: present() may change
                for counter, nv in new_map.items():
                    if counter in tracked:
                        ov = old_map.get(counter)
                        if nv != ov:
                            self._change(
                                rec.series, counter, since=rec.first_seen, old=ov, new=nv, now=now
                            )
            if rekey:
                rec.sig_id = self._port_id(p)
        if delta:
            return  # an absent port is unchanged, never gone
        for key in [k for k in node.ports if k not in seen]:
            del node.ports[key]

    def _ingest_ranks(self, node: _NodeRec, ranks: Sequence[RankState], now: float) -> set[_JobRec]:
        touched: set[_JobRec] = set()
        keys: set[tuple[str, int]] = set()
        fields = self._rank_fields
        for r in ranks:
            key = (r.job, r.rank)
            keys.add(key)
            rec = self._ranks.get(key)
            job = self._job(r.job, now)
            touched.add(job)
            if rec is None:
                rec = self._ranks[key] = _RankRec(r.job, r.rank, node.name, now)
                job.ranks[r.rank] = rec
            elif rec.node != node.name:
                prev = self._nodes.get(rec.node)
                if prev is not None:
                    prev.rank_keys.discard(key)
                rec.node = node.name
            old = rec.state
            rec.state = r
            rec.received_at = now
            if old is not None:
                for name in fields:
                    nv = getattr(r, name)
                    ov = getattr(old, name)
                    if nv is not None and nv != ov:
                        self._change(
                            rec.series, name, since=rec.first_seen, old=ov, new=nv, now=now
                        )
        # Ranks this node no longer reports have exited or moved: forget them.
        for key in node.rank_keys - keys:
            rec = self._ranks.get(key)
            if rec is not None and rec.node == node.name:
                self._drop_rank(rec)
                remaining = self._jobs.get(key[0])
                if remaining is not None:
                    touched.add(remaining)
        node.rank_keys = keys
        return touched

    def _ingest_event(
        self, node: _NodeRec, e: Event, now: float, jobs_touched: set[_JobRec]
    ) -> None:
        if e.kind == "xid" or e.kind in ("gpu_lost", "fallen_off_bus"):
            rec = None
            if e.gpu is not None:
                rec = node.gpus.get(e.gpu)
                if rec is None:
                    rec = node.gpus[e.gpu] = _GpuRec(e.gpu, None, now)
            if e.kind == "xid":
                fatal = e.code is not None and e.code in self.fatal_xids
                self._bump(node.series, "xid_total", node, now, "node")
                if fatal:
                    self._bump(node.series, "xid_fatal_total", node, now, "node")
                if rec is not None:
                    self._bump(rec.series, "xid_total", rec, now, "gpu")
                    if fatal:
                        self._bump(rec.series, "xid_fatal_total", rec, now, "gpu")
                    if e.code is not None:
                        old = rec.xid_last_code
                        rec.xid_last_code = e.code
                        if "xid_last_code" in self._tracked["gpu"] and old != e.code:
                            self._change(
                                rec.series,
                                "xid_last_code",
                                since=rec.first_seen,
                                old=old,
                                new=e.code,
                                now=now,
                            )
            elif rec is not None:
                self._bump(rec.series, "gpu_lost_total", rec, now, "gpu")
            if rec is not None and rec.sample is not None:
                self._reintern(rec)
        elif e.kind == "preemption_notice":
            self._bump(node.series, "preemption_total", node, now, "node")
        elif e.kind == "nan_loss" and e.job is not None:
            job = self._job(e.job, now)
            jobs_touched.add(job)
            self._bump(job.series, "nan_total", job, now, "job")
            if e.rank is not None:
                rank = self._ranks.get((e.job, e.rank))
                if rank is None:
                    rank = self._ranks[(e.job, e.rank)] = _RankRec(e.job, e.rank, node.name, now)
                    job.ranks[e.rank] = rank
                    node.rank_keys.add((e.job, e.rank))
                self._bump(rank.series, "nan_total", rank, now, "rank")

    def _bump(self, series: dict[str, Series], name: str, rec: Any, now: float, scope: str) -> None:
        old = getattr(rec, name)
        setattr(rec, name, old + 1)
        if name in self._tracked[scope]:
            since = rec.first_seen if rec.first_seen is not None else now
            self._change(series, name, since=since, old=old, new=old + 1, now=now)

    def _reintern(self, rec: _GpuRec) -> None:
        counters = (rec.xid_total, rec.xid_fatal_total, rec.xid_last_code, rec.gpu_lost_total)
        rec.sig_id = self._intern((rec.sig, counters))
        rec.links_id = self._intern(tuple(rec.link_sig)) if rec.link_sig is not None else None

    def _port_id(self, p: IbPortSample) -> int:
        return self._intern(tuple(_ib_value(p, n) for n in self._ib_sig_names))

    def _rekey(self) -> None:
        """Tracked sets changed: recompute every interned key (rare: rule reloads)."""
        for node in self._nodes.values():
            for g in node.gpus.values():
                if g.sample is not None:
                    g.sig = self._gpu_sig(g.sample)
                    g.link_sig = (
                        [self._link_sig(ln) for ln in g.sample.nvlinks]
                        if self._link_fields
                        else None
                    )
                    self._reintern(g)
            for p in node.ports.values():
                p.sig_id = self._port_id(p.sample)

    def _intern(self, key: Any) -> int:
        """A small int per distinct value tuple. Ids are never reused, so dropping the table
        when it grows only costs cache misses."""
        ident = self._interned.get(key)
        if ident is None:
            if len(self._interned) >= _INTERN_MAX:
                self._interned.clear()
                self._memo.clear()
            self._next_id += 1
            ident = self._interned[key] = self._next_id
        return ident

    def _sample_job(self, job: _JobRec, now: float) -> None:
        # One sample per min_spacing_s: summing a 16k-rank job on every report would cost more
        # than the report itself.
        if now - job.sampled_at < self.min_spacing_s:
            return
        job.sampled_at = now
        for name in self._job_fields:
            v = _JOB_NUMERIC[name](job)
            self._record(job.series, name, now, v, now)

    def _job(self, name: str, now: float | None) -> _JobRec:
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = _JobRec(name, now)
        elif job.first_seen is None:
            job.first_seen = now
        return job

    def _drop_rank(self, rec: _RankRec) -> None:
        self._ranks.pop((rec.job, rec.rank), None)
        job = self._jobs.get(rec.job)
        if job is not None and job.ranks.get(rec.rank) is rec:
            del job.ranks[rec.rank]
            if not job.ranks and job.meta_state is None:
                del self._jobs[rec.job]

    def set_node_meta(self, node: str, *, role: str, state: str, job: str | None) -> None:
        """The controller's inventory view of a node (role, drain state, assigned job)."""
        rec = self._nodes.get(node)
        if rec is None:
            rec = self._nodes[node] = _NodeRec(node, None)
        rec.role = role
        rec.state = state
        rec.job = job

    def set_job_meta(self, job: str, *, nodes: Sequence[str], state: str) -> None:
        """The controller's job table entry: the job's node set and state."""
        rec = self._job(job, None)
        rec.meta_nodes = tuple(nodes)
        rec.meta_state = state

    def forget_job(self, job: str) -> None:
        """Drop a job and its ranks (the job was deleted from the controller)."""
        rec = self._jobs.pop(job, None)
        if rec is None:
            return
        for r in list(rec.ranks.values()):
            self._ranks.pop((r.job, r.rank), None)
            node = self._nodes.get(r.node)
            if node is not None:
                node.rank_keys.discard((r.job, r.rank))

    def forget_node(self, node: str) -> None:
        """Drop everything known about a node (removed from the cluster)."""
        rec = self._nodes.pop(node, None)
        if rec is None:
            return
        for key in rec.rank_keys:
            r = self._ranks.get(key)
            if r is not None and r.node == node:
                self._drop_rank(r)

    # --- reading -------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def last_report_at(self, node: str) -> float | None:
        rec = self._nodes.get(node)
        return None if rec is None else rec.last_report_at

    def series_points(self) -> int:
        """Total history points held (for memory figures in benchmarks and docs)."""
        total = 0
        for node in self._nodes.values():
            total += sum(len(s) for s in node.series.values())
            for g in node.gpus.values():
                total += sum(len(s) for s in g.series.values())
                total += sum(len(s) for s in g.link_series.values())
            for p in node.ports.values():
                total += sum(len(s) for s in p.series.values())
        for r in self._ranks.values():
            total += sum(len(s) for s in r.series.values())
        for j in self._jobs.values():
            total += sum(len(s) for s in j.series.values())
        return total

    def matches(
        self,
        scope: str,
        ctx: EvalContext,
        *,
        fresh_after: float | None,
        test: Callable[[EvalContext], bool],
        memo_key: tuple[str, str] | None = None,
        reads: Collection[str] = (),
    ) -> Iterator[None]:
        """Like `walk`, but yields only where `test(ctx)` holds.

        For gpu, nvlink and ib_port scopes with a `memo_key`, a condition that reads only
        tracked values and event counters (`reads`, no `age()`) is a pure function of a GPU's
        or port's interned values while it has no history yet (windowed functions over an
        unchanged value are constant), so a False result is remembered per value tuple and
        identical quiet targets are skipped without evaluating anything.
        """
        memo: set[int] | None = None
        if memo_key is not None and scope in ("gpu", "nvlink", "ib_port"):
            keyed = self._tracked[scope] | (_EVENT_ATTRS if scope == "gpu" else frozenset())
            if all(name in keyed for name in reads):
                memo = self._memo.setdefault(memo_key, set())
                if len(memo) > _INTERN_MAX:
                    memo.clear()
        if memo is None:
            for _ in self.walk(scope, ctx, fresh_after=fresh_after):
                if test(ctx):
                    yield
            return
        for node in list(self._nodes.values()):
            if fresh_after is not None and not _fresh(node, fresh_after):
                continue
            ctx.node = node
            if scope == "ib_port":
                for p in node.ports.values():
                    ident = p.sig_id if not p.series else None
                    if ident is not None and ident in memo:
                        continue
                    ctx.port = p
                    if test(ctx):
                        yield
                    elif ident is not None:
                        memo.add(ident)
                continue
            for g in node.gpus.values():
                if scope == "gpu":
                    ident = g.sig_id if not g.series else None
                    if ident is not None and ident in memo:
                        continue
                    ctx.gpu = g
                    if test(ctx):
                        yield
                    elif ident is not None:
                        memo.add(ident)
                    continue
                if g.sample is None:
                    continue
                ident = g.links_id if not g.link_series else None
                if ident is not None and ident in memo:
                    continue
                ctx.gpu = g
                hit = False
                for ln in g.sample.nvlinks:
                    ctx.link = ln
                    if test(ctx):
                        hit = True
                        yield
                if not hit and ident is not None:
                    memo.add(ident)

    def walk(self, scope: str, ctx: EvalContext, *, fresh_after: float | None) -> Iterator[None]:
        """Point `ctx` at each target of `scope` in turn (yielding after each). With
        `fresh_after`, targets on nodes whose last report is older are skipped (node and job
        scopes are never skipped)."""
        if scope == "node":
            for node in list(self._nodes.values()):
                ctx.node = node
                yield
            return
        if scope == "job":
            for job in list(self._jobs.values()):
                ctx.job = job
                yield
            return
        if scope == "rank":
            for r in list(self._ranks.values()):
                owner = self._nodes.get(r.node)
                if fresh_after is not None and not _fresh(owner, fresh_after):
                    continue
                ctx.rank = r
                ctx.node = owner
                ctx.job = self._jobs.get(r.job)
                yield
            return
        for node in list(self._nodes.values()):
            if fresh_after is not None and not _fresh(node, fresh_after):
                continue
            ctx.node = node
            if scope == "gpu":
                for g in node.gpus.values():
                    ctx.gpu = g
                    yield
            elif scope == "nvlink":
                for g in node.gpus.values():
                    if g.sample is None:
                        continue
                    ctx.gpu = g
                    for ln in g.sample.nvlinks:
                        ctx.link = ln
                        yield
            elif scope == "ib_port":
                for p in node.ports.values():
                    ctx.port = p
                    yield

    def rank_node(self, job: str, rank: int) -> str | None:
        r = self._ranks.get((job, rank))
        return None if r is None else r.node

    def value(self, target: Any, name: str, *, now: float, stale_after_s: float = 10.0) -> Any:
        """The current value of signal `name` for a `model.Target` (None if absent);
        for tools and tests, the engine uses compiled getters instead."""
        ctx = self.context_for(target, now=now, stale_after_s=stale_after_s)
        if ctx is None:
            return None
        return getter(target.scope, name)(ctx)

    def context_for(
        self, target: Any, *, now: float, stale_after_s: float = 10.0
    ) -> EvalContext | None:
        ctx = EvalContext(self, now=now, stale_after_s=stale_after_s)
        scope = target.scope
        if scope in ("rank", "job"):
            job = self._jobs.get(target.job)
            if job is None:
                return None
            ctx.job = job
            if scope == "rank":
                ctx.rank = job.ranks.get(target.rank)
                if ctx.rank is None:
                    return None
                ctx.node = self._nodes.get(ctx.rank.node)
            return ctx
        ctx.node = self._nodes.get(target.node)
        if ctx.node is None:
            return None
        if scope in ("gpu", "nvlink"):
            ctx.gpu = ctx.node.gpus.get(target.gpu)
            if ctx.gpu is None:
                return None
            if scope == "nvlink":
                links = ctx.gpu.sample.nvlinks if ctx.gpu.sample is not None else ()
                ctx.link = next((ln for ln in links if ln.link == target.link), None)
                if ctx.link is None:
                    return None
        elif scope == "ib_port":
            ctx.port = ctx.node.ports.get((target.device, target.port))
            if ctx.port is None:
                return None
        return ctx


def _merge_links(g: GpuSample, old_links: tuple[NvLinkSample, ...]) -> GpuSample:
    """A delta GPU entry with its changed links laid over the links held (order kept)."""
    changed = {ln.link: ln for ln in g.nvlinks}
    merged = tuple(changed.pop(ln.link, ln) for ln in old_links)
    if changed:  # a link not held before: appended (the next full report settles the set)
        merged += tuple(changed.values())
    return dataclasses.replace(g, nvlinks=merged)


def _fatal_codes(catalog: XidCatalog | None) -> frozenset[int]:
    if catalog is not None:
        return frozenset(catalog.fatal_codes())
    try:
        from trainguard.xid_catalog import XidCatalog as _Catalog  # noqa: PLC0415 - optional module
    except ImportError:
        return FALLBACK_FATAL_XIDS
    return frozenset(_Catalog.load().fatal_codes())


def _tuple_getter(names: Sequence[str]) -> Callable[[Any], Any]:
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda obj: (one(obj),)
    return operator.attrgetter(*names)


def _fresh(node: _NodeRec | None, fresh_after: float) -> bool:
    return (
        node is not None and node.last_report_at is not None and node.last_report_at >= fresh_after
    )


def target_of(scope: str, ctx: EvalContext) -> tuple[Any, ...]:
    """(scope, node, gpu, link, device, port, job, rank) of the target `ctx` points at, in
    `trainguard.controller.model.Target` field order."""
    if scope == "gpu":
        return (scope, ctx.node.name, ctx.gpu.index, None, None, None, None, None)
    if scope == "nvlink":
        return (scope, ctx.node.name, ctx.gpu.index, ctx.link.link, None, None, None, None)
    if scope == "ib_port":
        s = ctx.port.sample
        return (scope, ctx.node.name, None, None, s.device, s.port, None, None)
    if scope == "node":
        return (scope, ctx.node.name, None, None, None, None, None, None)
    if scope == "rank":
        r = ctx.rank
        return (scope, r.node, None, None, None, None, r.job, r.rank)
    return (scope, None, None, None, None, None, ctx.job.name, None)


def _ib_value(p: IbPortSample, name: str) -> Any:
    if name == "up":
        return None if p.state_code is None else int(p.state_code == 4)
    if name == "phys_up":
        return None if p.phys_state_code is None else int(p.phys_state_code == 5)
    if name == "rate_gbps":
        return p.rate_gbps
    v = p.counters.get(name)
    if v is None:
        v = p.hw_counters.get(name)
    return v


def _gpus_lost(node: _NodeRec) -> int:
    return sum(1 for g in node.gpus.values() if g.sample is None or g.sample.lost)


_NODE_NUMERIC: dict[str, Callable[[_NodeRec], Any]] = {
    "gpus": lambda n: sum(1 for g in n.gpus.values() if g.sample is not None),
    "gpus_lost": _gpus_lost,
    "ib_ports": lambda n: len(n.ports),
    "ib_ports_down": lambda n: sum(1 for p in n.ports.values() if p.sample.state_code != 4),
}


def _job_sum(job: _JobRec, name: str) -> Any:
    vals = [getattr(r.state, name) for r in job.ranks.values() if r.state is not None]
    vals = [v for v in vals if v is not None]
    return sum(vals) if vals else None


def _job_max(job: _JobRec, name: str) -> Any:
    vals = [getattr(r.state, name) for r in job.ranks.values() if r.state is not None]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


_JOB_NUMERIC: dict[str, Callable[[_JobRec], Any]] = {
    "ranks": lambda j: len(j.ranks),
    "step": lambda j: _job_max(j, "step"),
    "samples_per_s": lambda j: _job_sum(j, "samples_per_s"),
    "world_size": lambda j: _job_max(j, "world_size"),
}


# --- getters: (scope, signal) -> function of an EvalContext ---------------------------------


def _gpu_field(name: str) -> Getter:
    def get(c: EvalContext) -> Any:
        s = c.gpu.sample
        return None if s is None else getattr(s, name)

    return get


def _gpu_attr(name: str) -> Getter:
    return lambda c: getattr(c.gpu, name)


def _link_field(name: str) -> Getter:
    return lambda c: getattr(c.link, name)


def _ib_getter(name: str) -> Getter:
    return lambda c: _ib_value(c.port.sample, name)


def _report_age(c: EvalContext) -> Any:
    t = c.node.last_report_at
    return None if t is None else c.now - t


def _role(c: EvalContext) -> Any:
    n = c.node
    return n.role if n.role is not None else n.role_hint


def _rank_field(name: str) -> Getter:
    def get(c: EvalContext) -> Any:
        s = c.rank.state
        return None if s is None else getattr(s, name)

    return get


def _rank_aged(name: str) -> Getter:
    def get(c: EvalContext) -> Any:
        r = c.rank
        s = r.state
        return None if s is None else getattr(s, name) + (c.now - r.received_at)

    return get


def _ranks_reporting(c: EvalContext) -> Any:
    limit = c.stale_after_s
    now = c.now
    return sum(
        1
        for r in c.job.ranks.values()
        if r.state is not None and r.state.heartbeat_age_s + (now - r.received_at) <= limit
    )


def _job_min_aged(name: str) -> Getter:
    def get(c: EvalContext) -> Any:
        now = c.now
        vals = [
            getattr(r.state, name) + (now - r.received_at)
            for r in c.job.ranks.values()
            if r.state is not None
        ]
        return min(vals) if vals else None

    return get


def _build_getters() -> dict[tuple[str, str], Getter]:
    g: dict[tuple[str, str], Getter] = {}
    for name in GPU_VALUE_FIELDS:
        g["gpu", name] = _gpu_field(name)
    for name in ("xid_total", "xid_fatal_total", "xid_last_code", "gpu_lost_total"):
        g["gpu", name] = _gpu_attr(name)
    for name in NVLINK_VALUE_FIELDS:
        g["nvlink", name] = _link_field(name)
    for name in SIGNALS["ib_port"]:
        g["ib_port", name] = _ib_getter(name)
    g["node", "report_age_s"] = _report_age
    for name, fn in _NODE_NUMERIC.items():
        g["node", name] = lambda c, fn=fn: fn(c.node)  # type: ignore[misc]
    g["node", "xid_total"] = lambda c: c.node.xid_total
    g["node", "xid_fatal_total"] = lambda c: c.node.xid_fatal_total
    g["node", "preemption_total"] = lambda c: c.node.preemption_total
    g["node", "role"] = _role
    g["node", "state"] = lambda c: c.node.state
    g["node", "job"] = lambda c: c.node.job
    for name in _RANK_DOCS:
        aged = name in ("heartbeat_age_s", "step_age_s")
        g["rank", name] = _rank_aged(name) if aged else _rank_field(name)
    g["rank", "nan_total"] = lambda c: c.rank.nan_total
    g["rank", "phase"] = _rank_field("phase")
    g["job", "step_age_s"] = _job_min_aged("step_age_s")
    g["job", "heartbeat_age_s"] = _job_min_aged("heartbeat_age_s")
    for name, jfn in _JOB_NUMERIC.items():
        g["job", name] = lambda c, jfn=jfn: jfn(c.job)  # type: ignore[misc]
    g["job", "ranks_reporting"] = _ranks_reporting
    g["job", "nan_total"] = lambda c: c.job.nan_total
    g["job", "state"] = lambda c: c.job.meta_state
    missing = {(s, n) for s in SIGNALS for n in SIGNALS[s]} - set(g)
    assert not missing, f"signals without a getter: {sorted(missing)}"
    return g


_GETTERS = _build_getters()


def getter(scope: str, name: str) -> Getter:
    """The function reading signal `name` of `scope` from an EvalContext."""
    return _GETTERS[scope, name]


def _series_of(scope: str, name: str) -> Callable[[EvalContext], tuple[Series | None, float]]:
    """(series, time the value was first seen) for a signal of a target."""
    if scope == "nvlink":
        return lambda c: (c.gpu.link_series.get((c.link.link, name)), c.gpu.first_seen)
    attr = {"gpu": "gpu", "ib_port": "port", "node": "node", "rank": "rank", "job": "job"}[scope]

    def get(c: EvalContext) -> tuple[Series | None, float]:
        rec = getattr(c, attr)
        first = rec.first_seen
        return rec.series.get(name), (c.now if first is None else first)

    return get


def series_getter(scope: str, name: str) -> Callable[[EvalContext], tuple[Series | None, float]]:
    return _series_of(scope, name)
