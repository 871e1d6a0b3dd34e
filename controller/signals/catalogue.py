"""The signal catalogue: every signal name per scope, with its kind, whether it is a counter, and
its documentation (`SIGNALS`), plus the signals whose history is kept by default.

The rule loader checks names against `SIGNALS` and docs/rules.md documents it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from trainguard.model import GPU_VALUE_FIELDS, NVLINK_VALUE_FIELDS

__all__ = [
    "DEFAULT_TRACKED",
    "IB_COUNTERS",
    "IB_HW_COUNTERS",
    "SCOPES",
    "SIGNALS",
    "SignalSpec",
]

SCOPES: tuple[str, ...] = ("gpu", "nvlink", "ib_port", "node", "rank", "job")


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
        "agent_sources_stale": _n(
            "collection sources (gpu, ib, xid, preemption) the node's agent reports stale: a "
            "call overran its deadline, so their values are old (0 from an agent that does not "
            "say)"
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
