"""The signal table: one row per health signal (name, scope, unit, gauge or counter, the
collector that fills it, and the Prometheus metric the agent exports it as).

Built from it: the agent's /metrics exposition (`trainguard.agent.metrics`), the controller's
signal catalogue (`trainguard.controller.signals.catalogue`), the rule export's PromQL names
(`trainguard.controller.rules.export`), the simulator's IB counters, and the metrics and signal
references in docs/ (tests hold the docs to the table). Adding a hardware signal is one row
here, its field in `trainguard.model`, and the collector code that reads it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "IB_COUNTERS",
    "IB_ERROR_COUNTERS",
    "IB_HW_COUNTERS",
    "SCOPES",
    "SIGNALS",
    "Collector",
    "Prom",
    "Scope",
    "Signal",
    "by_key",
    "ib_counter_prom",
]

Scope = Literal["gpu", "nvlink", "ib_port", "node", "rank", "job"]
SCOPES: tuple[Scope, ...] = ("gpu", "nvlink", "ib_port", "node", "rank", "job")

# Who fills a signal: an agent collector (nvml: agent/collectors/nvml.py and the simulator;
# infiniband: sysfs; xid: the kernel log's XID events), the trainer's heartbeats, the agent
# itself (ages it derives from heartbeats), or the controller (derived from reports and events).
Collector = Literal["nvml", "infiniband", "xid", "heartbeat", "agent", "controller"]


@dataclass(frozen=True)
class Prom:
    """How the agent exports a signal: a sample of family `name` (one `help` per family; rows
    sharing a family agree on it) with the fixed `labels` that tell this signal apart in the
    family, after the scope's identity labels. The metric value is `value * mul / div` (a
    percent becomes a ratio, MHz become Hz); `read` reads the value off the sample when it is
    not the sample's field of the signal's name. `born_on_event`: the agent creates a series
    at its first event, labelled by what it counts (the XID code), rather than per sample."""

    name: str
    help: str
    labels: tuple[tuple[str, str], ...] = ()
    mul: float = 1
    div: float = 1
    read: Callable[[Any], Any] | None = None
    born_on_event: bool = False

    @property
    def scale(self) -> float:
        """Signal units per metric unit (what PromQL multiplies the metric by)."""
        return self.div / self.mul

    @property
    def selector(self) -> str:
        """The PromQL instant-vector selector of this signal's series."""
        if not self.labels:
            return self.name
        inner = ",".join(f'{k}="{v}"' for k, v in self.labels)
        return f"{self.name}{{{inner}}}"


@dataclass(frozen=True)
class Signal:
    """One signal. `field`: its value is the sample's field of the same name (GpuSample,
    NvLinkSample, RankState); `value`: "number" or "string"; `prom`: None where only the
    controller has it."""

    scope: Scope
    name: str
    doc: str
    unit: str
    type: Literal["gauge", "counter"]
    collector: Collector
    value: Literal["number", "string"] = "number"
    field: bool = False
    prom: Prom | None = None


def _gpu(
    name: str,
    doc: str,
    unit: str,
    prom: Prom | None,
    *,
    counter: bool = False,
) -> Signal:
    kind: Literal["gauge", "counter"] = "counter" if counter else "gauge"
    return Signal("gpu", name, doc, unit, kind, "nvml", field=True, prom=prom)


_THROTTLE = "1 while the clock-event reason is active."
_ECC = "ECC errors (volatile: since driver load)."
_REMAPPED = "Rows remapped, by kind."
_RETIRED = "Retired memory pages, by cause."
_XID = "XID errors seen since agent start."
_NVLINK_ERRORS = "NVLink error counters."
_THROUGHPUT = "Throughput."


def _throttle(name: str, doc: str, reason: str) -> Signal:
    p = Prom("trainguard_gpu_throttle_active", _THROTTLE, (("reason", reason),))
    return _gpu(name, doc, "bool", p)


def _ecc(kind: str, scope: str, doc: str) -> Signal:
    p = Prom("trainguard_gpu_ecc_errors_total", _ECC, (("type", kind), ("scope", scope)))
    return _gpu(f"ecc_{kind}_{scope}_total", doc, "errors", p, counter=True)


def _nvlink_errors(kind: str, doc: str) -> Signal:
    p = Prom("trainguard_nvlink_errors_total", _NVLINK_ERRORS, (("type", kind),))
    return Signal(
        "nvlink", f"{kind}_errors_total", doc, "errors", "counter", "nvml", field=True, prom=p
    )


_GPU: tuple[Signal, ...] = (
    # in the order of the agent's exposition (families appear in the order of their first row)
    _gpu(
        "lost",
        "1 if NVML said GpuIsLost or the GPU fell off the bus (bool)",
        "bool",
        Prom("trainguard_gpu_lost", "1 if the GPU is lost (NVML GpuIsLost / off the bus)."),
    ),
    _gpu(
        "temperature_celsius",
        "GPU core temperature, degrees C",
        "celsius",
        Prom("trainguard_gpu_temperature_celsius", "GPU core temperature."),
    ),
    _gpu(
        "power_watts",
        "power draw, W",
        "watts",
        Prom("trainguard_gpu_power_watts", "GPU power draw."),
    ),
    _gpu(
        "utilization_gpu_percent",
        "percent of time a kernel was running",
        "percent",
        Prom("trainguard_gpu_utilization_ratio", "Fraction of time a kernel was running.", div=100),
    ),
    _gpu(
        "utilization_memory_percent",
        "percent of time memory was read or written",
        "percent",
        Prom(
            "trainguard_gpu_memory_utilization_ratio",
            "Fraction of time memory was read/written.",
            div=100,
        ),
    ),
    _gpu(
        "memory_used_bytes",
        "GPU memory in use, bytes",
        "bytes",
        Prom("trainguard_gpu_memory_used_bytes", "GPU memory in use."),
    ),
    _gpu(
        "memory_total_bytes",
        "GPU memory installed, bytes",
        "bytes",
        Prom("trainguard_gpu_memory_total_bytes", "GPU memory installed."),
    ),
    _gpu(
        "sm_clock_mhz",
        "current SM clock, MHz",
        "megahertz",
        Prom("trainguard_gpu_sm_clock_hertz", "Current SM clock.", mul=1e6),
    ),
    _gpu(
        "remapped_rows_pending",
        "1 if a row remapping waits for a GPU reset (bool)",
        "bool",
        Prom(
            "trainguard_gpu_remap_pending", "1 if a row remapping is pending (needs a GPU reset)."
        ),
    ),
    _gpu(
        "remapped_rows_failure",
        "1 if a row remapping failed (bool)",
        "bool",
        Prom("trainguard_gpu_remap_failed", "1 if a row remapping failed (replace the GPU)."),
    ),
    _gpu(
        "retired_pages_pending",
        "1 if a page retirement waits for a reboot (bool)",
        "bool",
        Prom("trainguard_gpu_retired_pages_pending", "1 if a page retirement is pending."),
    ),
    _throttle("throttle_hw_slowdown", "1 while HW slowdown is active (bool)", "hw_slowdown"),
    _throttle("throttle_hw_thermal", "1 while HW thermal slowdown is active (bool)", "hw_thermal"),
    _throttle("throttle_sw_thermal", "1 while SW thermal slowdown is active (bool)", "sw_thermal"),
    _throttle(
        "throttle_power_brake",
        "1 while the external power brake is asserted (bool)",
        "hw_power_brake",
    ),
    _ecc("corrected", "volatile", "corrected ECC errors since driver load (counter)"),
    _ecc("uncorrected", "volatile", "uncorrected ECC errors since driver load (counter)"),
    _ecc("corrected", "aggregate", "corrected ECC errors, lifetime (counter)"),
    _ecc("uncorrected", "aggregate", "uncorrected ECC errors, lifetime (counter)"),
    _gpu(
        "remapped_rows_correctable",
        "rows remapped for correctable errors",
        "rows",
        Prom("trainguard_gpu_remapped_rows", _REMAPPED, (("kind", "correctable"),)),
    ),
    _gpu(
        "remapped_rows_uncorrectable",
        "rows remapped for uncorrectable errors",
        "rows",
        Prom("trainguard_gpu_remapped_rows", _REMAPPED, (("kind", "uncorrectable"),)),
    ),
    _gpu(
        "retired_pages_sbe",
        "pages retired for single-bit errors",
        "pages",
        Prom("trainguard_gpu_retired_pages", _RETIRED, (("cause", "sbe"),)),
    ),
    _gpu(
        "retired_pages_dbe",
        "pages retired for double-bit errors",
        "pages",
        Prom("trainguard_gpu_retired_pages", _RETIRED, (("cause", "dbe"),)),
    ),
    _gpu(
        "pcie_replay_total",
        "PCIe replay counter (counter)",
        "replays",
        Prom("trainguard_gpu_pcie_replay_errors_total", "PCIe replay counter."),
        counter=True,
    ),
    _gpu("clock_event_reasons", "raw NVML clock-event (throttle) reason bitmask", "bitmask", None),
    Signal(
        "gpu",
        "xid_total",
        "XID events on this GPU seen by the controller (counter)",
        "events",
        "counter",
        "xid",
        prom=Prom("trainguard_gpu_xid_errors_total", _XID, born_on_event=True),
    ),
    Signal(
        "gpu",
        "xid_fatal_total",
        "XID events whose catalog severity is fatal (counter)",
        "events",
        "counter",
        "controller",
    ),
    Signal(
        "gpu", "xid_last_code", "code of the most recent XID on this GPU", "", "gauge", "controller"
    ),
    Signal(
        "gpu",
        "gpu_lost_total",
        "gpu_lost / fallen_off_bus events (counter)",
        "events",
        "counter",
        "controller",
    ),
)

_NVLINK: tuple[Signal, ...] = (
    Signal(
        "nvlink",
        "up",
        "1 if the link is active (bool)",
        "bool",
        "gauge",
        "nvml",
        field=True,
        prom=Prom("trainguard_nvlink_up", "1 if the NVLink is active."),
    ),
    _nvlink_errors("crc_flit", "CRC flit errors (counter)"),
    _nvlink_errors("crc_data", "CRC data errors (counter)"),
    _nvlink_errors("replay", "replay errors (counter)"),
    _nvlink_errors("recovery", "recovery errors (counter)"),
)

# Standard sysfs counters/ files (IB PMA) and common mlx5 hw_counters/ files. A rule may name
# any of them; the loader rejects other names so a typo cannot silently never fire. The agent
# exports every file it finds, listed here or not (`ib_counter_prom`). Traffic first: the
# families of the exposition follow the order of their first counter.
IB_COUNTERS: tuple[str, ...] = (
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "unicast_xmit_packets",
    "unicast_rcv_packets",
    "multicast_xmit_packets",
    "multicast_rcv_packets",
    "port_xmit_wait",
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

_IB_DATA = "Data bytes (sysfs words x 4)."
_IB_PACKETS = "Packet counters from sysfs counters/."
_IB_ERRORS = "Error counters from sysfs counters/."
_IB_HW = "Driver counters from sysfs hw_counters/."
_IB_ERRORS_FAMILY = "trainguard_ib_port_errors_total"


@functools.lru_cache(maxsize=4096)  # the names are a host's sysfs files: few, read every scrape
def ib_counter_prom(name: str, *, hw: bool) -> Prom:
    """How the agent exports the sysfs counter file `name` (of hw_counters/ when `hw`): data in
    bytes (the kernel counts 4-byte words), packets, transmit wait, the rest as errors."""
    if hw:
        return Prom("trainguard_ib_port_hw_events_total", _IB_HW, (("counter", name),))
    if name == "port_xmit_data":
        return Prom(
            "trainguard_ib_port_data_bytes_total", _IB_DATA, (("direction", "transmit"),), mul=4
        )
    if name == "port_rcv_data":
        return Prom(
            "trainguard_ib_port_data_bytes_total", _IB_DATA, (("direction", "receive"),), mul=4
        )
    if name == "port_xmit_wait":
        return Prom(
            "trainguard_ib_port_transmit_wait_ticks_total",
            "Ticks a port had data to send but no credits (congestion).",
        )
    if name.endswith("_packets"):
        return Prom("trainguard_ib_port_packets_total", _IB_PACKETS, (("counter", name),))
    return Prom(_IB_ERRORS_FAMILY, _IB_ERRORS, (("counter", name),))


# The counters/ files that count errors (what a flapping or noisy link moves)
IB_ERROR_COUNTERS: tuple[str, ...] = tuple(
    n for n in IB_COUNTERS if ib_counter_prom(n, hw=False).name == _IB_ERRORS_FAMILY
)


def _ib_state_up(p: Any) -> bool | None:
    return None if p.state is None else p.state == "ACTIVE"


def _ib_phys_up(p: Any) -> bool | None:
    return None if p.phys_state is None else p.phys_state == "LinkUp"


_IB_PORT: tuple[Signal, ...] = (
    Signal(
        "ib_port",
        "up",
        "1 if the port state is ACTIVE (state_code 4)",
        "bool",
        "gauge",
        "infiniband",
        prom=Prom("trainguard_ib_port_up", "1 if the port state is ACTIVE.", read=_ib_state_up),
    ),
    Signal(
        "ib_port",
        "phys_up",
        "1 if the physical state is LinkUp (phys_state_code 5)",
        "bool",
        "gauge",
        "infiniband",
        prom=Prom(
            "trainguard_ib_port_physical_up", "1 if the physical state is LinkUp.", read=_ib_phys_up
        ),
    ),
    Signal(
        "ib_port",
        "rate_gbps",
        "negotiated rate, Gb/s",
        "gigabits_per_second",
        "gauge",
        "infiniband",
        field=True,
        prom=Prom(
            "trainguard_ib_port_rate_bytes_per_second",
            "Negotiated link rate (Gb/s x 1e9 / 8).",
            mul=1e9,
            div=8,
        ),
    ),
    *(
        Signal(
            "ib_port",
            n,
            f"sysfs counters/{n} (counter)",
            "",
            "counter",
            "infiniband",
            prom=ib_counter_prom(n, hw=False),
        )
        for n in IB_COUNTERS
    ),
    *(
        Signal(
            "ib_port",
            n,
            f"sysfs hw_counters/{n} (counter)",
            "",
            "counter",
            "infiniband",
            prom=ib_counter_prom(n, hw=True),
        )
        for n in IB_HW_COUNTERS
        if n not in IB_COUNTERS
    ),
)


def _node(
    name: str, doc: str, *, counter: bool = False, value: Literal["number", "string"] = "number"
) -> Signal:
    kind: Literal["gauge", "counter"] = "counter" if counter else "gauge"
    return Signal("node", name, doc, "", kind, "controller", value)


_NODE: tuple[Signal, ...] = (
    _node("report_age_s", "s since the controller last received a report from the node"),
    _node("gpus", "GPUs in the node's latest report"),
    _node("gpus_lost", "GPUs marked lost in the latest report, plus GPUs that disappeared"),
    _node("ib_ports", "IB ports in the node's latest report"),
    _node("ib_ports_down", "IB ports whose state is not ACTIVE"),
    _node("xid_total", "XID events on the node, any GPU (counter)", counter=True),
    _node("xid_fatal_total", "fatal XID events on the node, any GPU (counter)", counter=True),
    _node(
        "preemption_total", "preemption_notice events from the node's agent (counter)", counter=True
    ),
    _node(
        "agent_sources_stale",
        "collection sources (gpu, ib, xid, preemption) the node's agent reports stale: a "
        "call overran its deadline, so their values are old (0 from an agent that does not "
        "say)",
    ),
    _node(
        "role",
        '"active" or "spare" (controller inventory, else the agent\'s hint)',
        value="string",
    ),
    _node("state", '"active", "draining" or "drained" (controller inventory)', value="string"),
    _node("job", "the job the node is assigned to (absent when none)", value="string"),
)


def _rank(
    name: str, doc: str, unit: str, prom: Prom, *, collector: Collector = "heartbeat"
) -> Signal:
    return Signal("rank", name, doc, unit, "gauge", collector, field=True, prom=prom)


_RANK: tuple[Signal, ...] = (
    _rank(
        "step",
        "latest training step",
        "step",
        Prom("trainguard_trainer_step", "Latest training step."),
    ),
    _rank(
        "loss",
        "latest loss (may be NaN/Inf)",
        "",
        Prom("trainguard_trainer_loss", "Latest loss (NaN stays NaN)."),
    ),
    _rank(
        "grad_norm",
        "latest gradient norm",
        "",
        Prom("trainguard_trainer_grad_norm", "Latest gradient norm."),
    ),
    _rank(
        "samples_per_s",
        "rank throughput, samples/s",
        "samples_per_second",
        Prom("trainguard_trainer_samples_per_second", _THROUGHPUT),
    ),
    _rank(
        "tokens_per_s",
        "rank throughput, tokens/s",
        "tokens_per_second",
        Prom("trainguard_trainer_tokens_per_second", _THROUGHPUT),
    ),
    _rank(
        "step_time_s",
        "duration of the latest step, s",
        "seconds",
        Prom("trainguard_trainer_step_time_seconds", "Duration of the latest step."),
    ),
    _rank(
        "compute_time_s",
        "the rank's own work in the latest step (no collective waits), s",
        "seconds",
        Prom(
            "trainguard_trainer_compute_time_seconds",
            "The rank's own work in the latest step, without waits in collectives.",
        ),
    ),
    _rank(
        "heartbeat_age_s",
        "s since the rank's last heartbeat, plus the age of the node's report",
        "seconds",
        Prom("trainguard_trainer_heartbeat_age_seconds", "Since the rank's last heartbeat."),
        collector="agent",
    ),
    _rank(
        "step_age_s",
        "s since the rank's step last changed, plus the age of the node's report",
        "seconds",
        Prom("trainguard_trainer_step_age_seconds", "Since the rank's step last changed."),
        collector="agent",
    ),
    _rank(
        "ckpt_step",
        "newest committed checkpoint step",
        "step",
        Prom("trainguard_trainer_checkpoint_step", "Newest committed checkpoint step."),
    ),
    _rank(
        "ckpt_failures",
        "checkpoint saves failed in a row since the newest commit",
        "saves",
        Prom(
            "trainguard_trainer_checkpoint_failures",
            "Checkpoint saves failed in a row since the newest commit.",
        ),
    ),
    _rank(
        "ckpt_age_s",
        "s since the newest checkpoint commit (since the run began while none committed in "
        "it), as of the rank's latest heartbeat",
        "seconds",
        Prom(
            "trainguard_trainer_checkpoint_age_seconds",
            "Since the newest checkpoint commit (or the run's start while none committed).",
        ),
    ),
    _rank(
        "ckpt_interval_s",
        "periodic checkpoint interval, s (checkpoint_every x the mean step time; absent "
        "without periodic checkpoints)",
        "seconds",
        Prom(
            "trainguard_trainer_checkpoint_interval_seconds",
            "Periodic checkpoint interval (checkpoint_every x the mean step time).",
        ),
    ),
    _rank(
        "ckpt_replica_step",
        "newest checkpoint step copied to the second-region replica and verified there (rank "
        "0, with a replica configured)",
        "step",
        Prom(
            "trainguard_trainer_checkpoint_replica_step",
            "Newest checkpoint step replicated to the second region and verified there.",
        ),
    ),
    _rank(
        "ckpt_replica_lag_s",
        "s since the oldest commit not yet replicated to the second region (0: caught up; "
        "rank 0, with a replica configured)",
        "seconds",
        Prom(
            "trainguard_trainer_checkpoint_replica_lag_seconds",
            "Since the oldest checkpoint commit not yet in the second region (0: caught up).",
        ),
    ),
    Signal(
        "rank",
        "nan_total",
        "nan_loss events from this rank (counter)",
        "events",
        "counter",
        "controller",
    ),
    Signal(
        "rank",
        "phase",
        '"init", "train", "checkpoint", "eval", "stopping" or "exit"',
        "",
        "gauge",
        "heartbeat",
        "string",
        field=True,
    ),
)


def _job(
    name: str, doc: str, *, counter: bool = False, value: Literal["number", "string"] = "number"
) -> Signal:
    kind: Literal["gauge", "counter"] = "counter" if counter else "gauge"
    return Signal("job", name, doc, "", kind, "controller", value)


_JOB: tuple[Signal, ...] = (
    _job("ranks", "ranks the controller knows for the job"),
    _job(
        "ranks_reporting", "ranks whose heartbeat (plus report age) is fresher than stale_after_s"
    ),
    _job("world_size", "largest world_size any rank reports"),
    _job("step", "highest step over the job's ranks"),
    _job("samples_per_s", "sum of the ranks' samples_per_s"),
    _job(
        "step_age_s",
        "lowest step_age_s over the ranks (incl. report age): time since any progress",
    ),
    _job("heartbeat_age_s", "lowest heartbeat_age_s over the ranks (incl. report age)"),
    _job("nan_total", "nan_loss events from any rank of the job (counter)", counter=True),
    _job("ckpt_step", "lowest newest-committed checkpoint step over the ranks"),
    _job("ckpt_failures", "highest ckpt_failures over the ranks: saves failed in a row"),
    _job("ckpt_age_s", "highest ckpt_age_s over the ranks: time since the job's newest commit"),
    _job(
        "ckpt_interval_s",
        "highest ckpt_interval_s over the ranks (absent without periodic checkpoints)",
    ),
    _job("ckpt_replica_step", "newest checkpoint step replicated to the second region"),
    _job("ckpt_replica_lag_s", "highest ckpt_replica_lag_s over the ranks: replication lag"),
    _job("state", "job state from the controller's job table", value="string"),
)

SIGNALS: tuple[Signal, ...] = (*_GPU, *_NVLINK, *_IB_PORT, *_NODE, *_RANK, *_JOB)


def by_key(signals: Iterable[Signal] = SIGNALS) -> Mapping[tuple[str, str], Signal]:
    """The rows keyed by (scope, name)."""
    return {(s.scope, s.name): s for s in signals}
