"""What collectors return: plain frozen dataclasses, and the collector protocols.

No Prometheus, HTTP or NVML in here. A field that is `None` was not supported or not readable
on this device: absent, never zero.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class NvLinkSample:
    link: int
    up: bool | None = None
    crc_flit_errors_total: int | None = None
    crc_data_errors_total: int | None = None
    replay_errors_total: int | None = None
    recovery_errors_total: int | None = None


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant. Identity fields are always set; the rest may be absent."""

    index: int
    uuid: str
    pci_bus_id: str  # normalised: "0000:18:00.0" (4-digit domain, lower-case hex)
    name: str
    lost: bool = False  # NVML said GpuIsLost (or the GPU fell off the bus)
    temperature_celsius: float | None = None
    power_watts: float | None = None
    utilization_gpu_percent: float | None = None
    utilization_memory_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    sm_clock_mhz: float | None = None
    clock_event_reasons: int | None = None  # raw NVML bitmask
    throttle_hw_slowdown: bool | None = None
    throttle_hw_thermal: bool | None = None
    throttle_sw_thermal: bool | None = None
    throttle_power_brake: bool | None = None
    ecc_corrected_volatile_total: int | None = None
    ecc_uncorrected_volatile_total: int | None = None
    ecc_corrected_aggregate_total: int | None = None
    ecc_uncorrected_aggregate_total: int | None = None
    remapped_rows_correctable: int | None = None
    remapped_rows_uncorrectable: int | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    retired_pages_sbe: int | None = None
    retired_pages_dbe: int | None = None
    retired_pages_pending: bool | None = None
    pcie_replay_total: int | None = None
    nvlinks: tuple[NvLinkSample, ...] = ()


GPU_IDENTITY_FIELDS = ("index", "uuid", "pci_bus_id", "name")
GPU_VALUE_FIELDS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(GpuSample)
    if f.name not in GPU_IDENTITY_FIELDS and f.name != "nvlinks"
)
NVLINK_VALUE_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(NvLinkSample) if f.name != "link"
)


@dataclass(frozen=True)
class IbPortSample:
    """One InfiniBand/RoCE port read from sysfs. Counters are raw sysfs values (data counters
    `port_xmit_data`/`port_rcv_data` are in 4-byte words, as the kernel reports them)."""

    device: str  # e.g. "mlx5_0"
    port: int
    state: str | None = None  # "ACTIVE", "DOWN", "INIT", "ARMED", "ACTIVE_DEFER"
    state_code: int | None = None  # 4 = ACTIVE
    phys_state: str | None = None  # "LinkUp", "Polling", "Disabled", ...
    phys_state_code: int | None = None  # 5 = LinkUp
    rate_gbps: float | None = None
    link_layer: str | None = None  # "InfiniBand" or "Ethernet"
    counters: Mapping[str, int] = field(default_factory=dict)
    hw_counters: Mapping[str, int] = field(default_factory=dict)
    unreadable: tuple[str, ...] = ()  # relative paths that could not be read or parsed


@dataclass(frozen=True)
class HardwareEvent:
    """An edge event seen on the hardware: an XID, a lost GPU, a GPU off the bus."""

    kind: str  # "xid" | "gpu_lost" | "fallen_off_bus" | "nvml_error"
    ts: float  # unix seconds when the agent saw it (or the kernel's timestamp mapped to it)
    gpu: int | None = None  # GPU index on this node, when known
    pci_bus_id: str | None = None
    code: int | None = None  # XID number for kind == "xid"
    message: str = ""  # bounded human text; never a metric label


@dataclass(frozen=True)
class GpuCollection:
    gpus: tuple[GpuSample, ...] = ()
    events: tuple[HardwareEvent, ...] = ()
    errors: tuple[str, ...] = ()  # collector-level problems (bounded text, for logs/metrics)


class GpuCollector(Protocol):
    def collect(self) -> GpuCollection: ...


class IbCollector(Protocol):
    def collect(self) -> tuple[IbPortSample, ...]: ...


class EventSource(Protocol):
    """A source of hardware events (the kernel log for XIDs); `poll` never blocks."""

    def poll(self) -> list[HardwareEvent]: ...
