"""What collectors return: plain frozen dataclasses, and the collector protocols.

No Prometheus, HTTP or NVML in here. A field that is `None` was not supported or not readable
on this device: absent, never zero. Fields carry the bounds (`trainguard.bounds`) the decoder
holds a report's samples to: counters non-negative within int64, readings finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Protocol

from trainguard.bounds import (
    MAX_IB_COUNTERS,
    MAX_NVLINKS_PER_GPU,
    Count,
    FiniteFloat,
    LabelValue,
    Name,
    UnixTime,
)
from trainguard.decode import Bound
from trainguard.kinds import EventKind


@dataclass(frozen=True)
class NvLinkSample:
    link: Count
    up: bool | None = None
    crc_flit_errors_total: Count | None = None
    crc_data_errors_total: Count | None = None
    replay_errors_total: Count | None = None
    recovery_errors_total: Count | None = None


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant. Identity fields are always set; the rest may be absent."""

    index: Count
    uuid: LabelValue
    pci_bus_id: LabelValue  # normalised: "0000:18:00.0" (4-digit domain, lower-case hex)
    name: LabelValue
    lost: bool = False  # NVML said GpuIsLost (or the GPU fell off the bus)
    temperature_celsius: FiniteFloat | None = None
    power_watts: FiniteFloat | None = None
    utilization_gpu_percent: FiniteFloat | None = None
    utilization_memory_percent: FiniteFloat | None = None
    memory_used_bytes: Count | None = None
    memory_total_bytes: Count | None = None
    sm_clock_mhz: FiniteFloat | None = None
    clock_event_reasons: Count | None = None  # raw NVML bitmask
    throttle_hw_slowdown: bool | None = None
    throttle_hw_thermal: bool | None = None
    throttle_sw_thermal: bool | None = None
    throttle_power_brake: bool | None = None
    ecc_corrected_volatile_total: Count | None = None
    ecc_uncorrected_volatile_total: Count | None = None
    ecc_corrected_aggregate_total: Count | None = None
    ecc_uncorrected_aggregate_total: Count | None = None
    remapped_rows_correctable: Count | None = None
    remapped_rows_uncorrectable: Count | None = None
    remapped_rows_pending: bool | None = None
    remapped_rows_failure: bool | None = None
    retired_pages_sbe: Count | None = None
    retired_pages_dbe: Count | None = None
    retired_pages_pending: bool | None = None
    pcie_replay_total: Count | None = None
    nvlinks: Annotated[tuple[NvLinkSample, ...], Bound(max_items=MAX_NVLINKS_PER_GPU)] = ()


GPU_IDENTITY_FIELDS = ("index", "uuid", "pci_bus_id", "name")
GPU_VALUE_FIELDS: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(GpuSample)
    if f.name not in GPU_IDENTITY_FIELDS and f.name != "nvlinks"
)
NVLINK_VALUE_FIELDS: tuple[str, ...] = tuple(
    f.name for f in dataclasses.fields(NvLinkSample) if f.name != "link"
)


# sysfs counters are unsigned 64-bit; one beyond int64 is reported unreadable by the collector
_Counters = Annotated[Mapping[LabelValue, Count], Bound(max_items=MAX_IB_COUNTERS)]


@dataclass(frozen=True)
class IbPortSample:
    """One InfiniBand/RoCE port read from sysfs. Counters are raw sysfs values (data counters
    `port_xmit_data`/`port_rcv_data` are in 4-byte words, as the kernel reports them)."""

    device: Name  # e.g. "mlx5_0"
    port: Count
    state: LabelValue | None = None  # "ACTIVE", "DOWN", "INIT", "ARMED", "ACTIVE_DEFER"
    state_code: int | None = None  # 4 = ACTIVE
    phys_state: LabelValue | None = None  # "LinkUp", "Polling", "Disabled", ...
    phys_state_code: int | None = None  # 5 = LinkUp
    rate_gbps: FiniteFloat | None = None
    link_layer: LabelValue | None = None  # "InfiniBand" or "Ethernet"
    counters: _Counters = field(default_factory=dict)
    hw_counters: _Counters = field(default_factory=dict)
    # relative paths that could not be read or parsed
    unreadable: Annotated[tuple[LabelValue, ...], Bound(max_items=2 * MAX_IB_COUNTERS)] = ()


@dataclass(frozen=True)
class HardwareEvent:
    """An edge event seen on the hardware: an XID, a lost GPU, a GPU off the bus."""

    kind: EventKind  # XID, GPU_LOST, FALLEN_OFF_BUS or NVML_ERROR
    ts: UnixTime  # unix seconds when the agent saw it (or the kernel's timestamp mapped to it)
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
