"""Simulated node hardware: H100-like GPUs with NVLinks, InfiniBand ports, XID events, faults.

`SimHardware` is driven only by its injected clock and seed, so a run is reproducible; it
returns the same dataclasses as the NVML/sysfs/kmsg collectors, so everything downstream of
it is the production path. `inject(FaultSpec)` applies every FaultKind of the wire protocol;
`nvml_hang` makes the GPU collect block (as NVML does when a GPU falls off the bus) while
the IB and XID sides keep answering. For the preflight and repair it also stands in for what
only a GPU can do: the figures a compute burn and an all-reduce reach (lower under its faults),
silent data corruption and a failing reset (the `sdc` and `reset_fail` faults, which last
until the GPU's reset, a reboot or `clear`), and a GPU reset or node reboot that clears its
fault state.
"""

from __future__ import annotations

import math
import random
import threading
import uuid
from dataclasses import dataclass, field

from trainguard.clock import Clock
from trainguard.model import GpuCollection, GpuSample, HardwareEvent, IbPortSample, NvLinkSample
from trainguard.protocol import EventKind, FaultSpec
from trainguard.signals import IB_ERROR_COUNTERS

GPU_NAME = "NVIDIA H100 80GB HBM3"
GPU_MEMORY_BYTES = 80 * 1024**3
NVLINKS_PER_GPU = 18
IB_RATE_GBPS = 400.0
SM_CLOCK_MAX_MHZ = 1980.0
SM_CLOCK_SLOW_MHZ = 345.0
# What a healthy simulated H100 reaches in the preflight: the FP32 burn (TFLOP/s, TF32 off)
# and an 8-GPU NVLink all-reduce's bus bandwidth (GB/s), both as real H100 SXM nodes measure.
SIM_BURN_TFLOPS = 51.0
SIM_BUSBW_GBPS = 360.0
# A hung GPU collect re-checks its fault this often (real seconds): a timed hang on a fake
# clock ends within this long of the clock passing its end.
HANG_RECHECK_S = 0.05

# NVML clock-event reason bits (nvmlClocksEventReason*), as the real collector sees them.
REASON_HW_SLOWDOWN = 0x8
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40
REASON_HW_POWER_BRAKE = 0x80

# Bus ids of the eight GPUs of a typical HGX H100 board; further GPUs get synthetic ids.
_HGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)

# Per-port data rate, 4-byte words per second: ~2 GB/s each way, a busy but not saturated
# 400 Gb/s link, so counters climb visibly without wrapping for centuries.
_IB_WORDS_PER_S = 500_000_000
_IB_PACKETS_PER_S = 500_000

# a few of the signal table's hw_counters/ files, as an mlx5 port shows them
_IB_HW_COUNTERS = (
    "duplicate_request",
    "out_of_sequence",
    "packet_seq_err",
    "local_ack_timeout_err",
)

_IB_STATES = {"ACTIVE": 4, "DOWN": 1}
_IB_PHYS = {"LinkUp": 5, "Polling": 2, "Disabled": 3}


# Faults a GPU keeps until it is reset (or the node reboots, or `clear`): a GPU whose products
# are silently wrong, and one whose reset fails. No `duration_s`: a reset is what ends them.
_UNTIL_RESET = ("sdc", "reset_fail")


class SimResetError(RuntimeError):
    """A simulated GPU reset that failed (the `reset_fail` fault)."""


@dataclass
class _Fault:
    spec: FaultSpec
    until_mono: float | None  # None = until cleared


@dataclass
class _GpuState:
    index: int
    uuid: str
    pci_bus_id: str
    base_temp_c: float
    base_power_w: float
    ecc_corrected_volatile: float = 0.0  # float: a storm accumulates fractional errors
    ecc_uncorrected_volatile: int = 0
    ecc_corrected_aggregate_base: int = 0
    ecc_uncorrected_aggregate_base: int = 0
    remapped_correctable: int = 0
    remapped_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    pcie_replay: int = 0
    nvlink_crc_flit: list[int] = field(default_factory=list)
    nvlink_crc_data: list[int] = field(default_factory=list)
    nvlink_replay: list[float] = field(default_factory=list)
    nvlink_recovery: list[float] = field(default_factory=list)
    lost: bool = False


@dataclass
class _IbState:
    device: str
    port: int
    counters: dict[str, float]
    hw_counters: dict[str, int]
    flap_down: bool = False


def sim_bus_id(index: int) -> str:
    """The PCI bus id of simulated GPU `index` (normalised form)."""
    if index < len(_HGX_BUSES):
        return f"0000:{_HGX_BUSES[index]:02x}:00.0"
    return f"0001:{index:02x}:00.0"


class SimHardware:
    """N simulated GPUs and M IB ports.

    GpuCollector: `collect()`; IbCollector: `collect_ib()` (or the `ib` view, whose
    `collect()` is that); EventSource: `poll()`. Thread-safe: the fault endpoint and the
    collect loop call it from different threads.
    """

    def __init__(
        self, *, gpus: int, ib_ports: int, node_name: str, seed: int, clock: Clock
    ) -> None:
        if gpus < 0 or ib_ports < 0:
            raise ValueError("gpus and ib_ports must be >= 0")
        self._clock = clock
        self._node = node_name
        self._rng = random.Random(f"{seed}:{node_name}")
        self._lock = threading.Lock()
        # a hung collect waits here with the lock released, so IB, XIDs and inject go on
        self._unhung = threading.Condition(self._lock)
        self._closed = False
        self.hung_collects_total = 0
        self._faults: list[_Fault] = []
        self._events: list[HardwareEvent] = []
        self._last_mono = clock.monotonic()
        self._start_mono = self._last_mono
        self._gpus = [self._new_gpu(i) for i in range(gpus)]
        self._sim_faults: set[tuple[str, int]] = set()
        self.resets: list[int] = []  # every GPU reset done, in order
        self.reboots_total = 0
        self._ib = [self._new_ib(i) for i in range(ib_ports)]
        self.ib = _IbView(self)

    # -- construction ----------------------------------------------------------------------

    def _new_gpu(self, index: int) -> _GpuState:
        rng = self._rng
        return _GpuState(
            index=index,
            uuid=f"GPU-{uuid.UUID(int=rng.getrandbits(128), version=4)}",
            pci_bus_id=sim_bus_id(index),
            base_temp_c=rng.uniform(48.0, 62.0),
            base_power_w=rng.uniform(520.0, 640.0),
            ecc_corrected_aggregate_base=rng.choice((0, 0, 0, 2, 17)),
            remapped_correctable=rng.choice((0, 0, 1)),
            nvlink_crc_flit=[0] * NVLINKS_PER_GPU,
            nvlink_crc_data=[0] * NVLINKS_PER_GPU,
            nvlink_replay=[0.0] * NVLINKS_PER_GPU,
            nvlink_recovery=[0.0] * NVLINKS_PER_GPU,
        )

    def _new_ib(self, index: int) -> _IbState:
        counters: dict[str, float] = {name: 0.0 for name in IB_ERROR_COUNTERS}
        counters.update(
            port_xmit_data=float(self._rng.randrange(10**9, 10**12)),
            port_rcv_data=float(self._rng.randrange(10**9, 10**12)),
            port_xmit_packets=float(self._rng.randrange(10**6, 10**9)),
            port_rcv_packets=float(self._rng.randrange(10**6, 10**9)),
            port_xmit_wait=0.0,
        )
        return _IbState(
            device=f"mlx5_{index}",
            port=1,
            counters=counters,
            hw_counters={name: 0 for name in _IB_HW_COUNTERS},
        )

    # -- faults ----------------------------------------------------------------------------

    def inject(self, spec: FaultSpec) -> None:
        """Apply a fault now. Raises ValueError naming the bad field for an unknown target."""
        now_mono = self._clock.monotonic()
        now = self._clock.now()
        with self._lock:
            self._advance(now_mono)
            if spec.kind == "clear":
                self._faults.clear()
                self._sim_faults.clear()
                for gpu in self._gpus:
                    gpu.lost = False
                    gpu.remap_pending = False
                    gpu.remap_failure = False
                for ib in self._ib:
                    ib.flap_down = False
                self._unhung.notify_all()
                return
            if spec.kind == "nvml_hang":
                pass  # the whole NVML library hangs, not one GPU
            elif spec.kind in ("ib_flap", "ib_down"):
                ib = self._find_ib(spec.device, spec.port)
                if spec.kind == "ib_down":
                    ib.counters["link_downed"] += 1
            elif spec.kind in _UNTIL_RESET:
                self._find_gpu(spec.gpu)
                if spec.duration_s is not None:
                    raise ValueError(f"duration_s: {spec.kind} lasts until the GPU is reset")
                self._sim_faults.add((spec.kind, spec.gpu))
                return
            else:
                gpu = self._find_gpu(spec.gpu)
                if spec.kind == "nvlink_down" and not 0 <= spec.link < NVLINKS_PER_GPU:
                    raise ValueError(f"link: no NVLink {spec.link} (0..{NVLINKS_PER_GPU - 1})")
                self._apply_edge(spec, gpu, now)
            until = None if spec.duration_s is None else now_mono + spec.duration_s
            if spec.kind not in ("dbe", "xid", "remap_pending", "remap_failure"):
                self._faults.append(_Fault(spec=spec, until_mono=until))

    def _apply_edge(self, spec: FaultSpec, gpu: _GpuState, now: float) -> None:
        """The one-off part of a fault: counters that jump and events that fire once."""
        if spec.kind == "dbe":
            gpu.ecc_uncorrected_volatile += 1
            gpu.ecc_uncorrected_aggregate_base += 1
            gpu.remap_pending = True
            self._xid(gpu, 48, now, "An uncorrectable double bit error (DBE) has been detected")
        elif spec.kind == "xid":
            self._xid(gpu, spec.code, now, "simulated XID")
        elif spec.kind == "remap_pending":
            gpu.remap_pending = True
        elif spec.kind == "remap_failure":
            gpu.remap_failure = True
        elif spec.kind == "gpu_lost":
            gpu.lost = True
            self._events.append(
                HardwareEvent(
                    kind=EventKind.GPU_LOST,
                    ts=now,
                    gpu=gpu.index,
                    pci_bus_id=gpu.pci_bus_id,
                    message="GPU is lost",
                )
            )
            self._xid(gpu, 79, now, "GPU has fallen off the bus.")

    def _xid(self, gpu: _GpuState, code: int, now: float, text: str) -> None:
        bus = gpu.pci_bus_id[5:12]  # "18:00.0" -> kernel prints "PCI:0000:18:00"
        self._events.append(
            HardwareEvent(
                kind=EventKind.XID,
                ts=now,
                gpu=gpu.index,
                pci_bus_id=gpu.pci_bus_id,
                code=code,
                message=f"NVRM: Xid (PCI:0000:{bus[:5]}): {code}, pid=0, {text}",
            )
        )

    def _find_gpu(self, index: int) -> _GpuState:
        if not 0 <= index < len(self._gpus):
            raise ValueError(f"gpu: no GPU {index} on this node (0..{len(self._gpus) - 1})")
        return self._gpus[index]

    def _find_ib(self, device: str, port: int) -> _IbState:
        for ib in self._ib:
            if ib.device == device and ib.port == port:
                return ib
        raise ValueError(f"device: no IB port {device}/{port} on this node")

    def _active(self, kind: str, *, gpu: int | None = None) -> list[FaultSpec]:
        return [
            f.spec
            for f in self._faults
            if f.spec.kind == kind and (gpu is None or f.spec.gpu == gpu)
        ]

    # -- time ------------------------------------------------------------------------------

    def _advance(self, now_mono: float) -> None:
        """Move counters forward to `now_mono` and expire timed faults (lock held)."""
        dt = max(0.0, now_mono - self._last_mono)
        self._last_mono = max(self._last_mono, now_mono)
        for fault in self._faults:
            spec = fault.spec
            span = dt
            if fault.until_mono is not None:
                span = max(0.0, min(dt, fault.until_mono - (now_mono - dt)))
            if span <= 0:
                continue
            if spec.kind == "ecc_storm":
                self._gpus[spec.gpu].ecc_corrected_volatile += spec.rate_per_s * span
            elif spec.kind == "nvlink_down":
                g = self._gpus[spec.gpu]
                g.nvlink_replay[spec.link] += spec.rate_per_s * span
                g.nvlink_recovery[spec.link] += spec.rate_per_s * span / 10.0
        expired = [f for f in self._faults if f.until_mono is not None and f.until_mono <= now_mono]
        for fault in expired:
            if fault.spec.kind == "gpu_lost":
                self._gpus[fault.spec.gpu].lost = False
        self._faults = [f for f in self._faults if f not in expired]
        for ib in self._ib:
            if self._ib_down(ib):
                continue
            for name, per_s in (
                ("port_xmit_data", _IB_WORDS_PER_S),
                ("port_rcv_data", _IB_WORDS_PER_S),
                ("port_xmit_packets", _IB_PACKETS_PER_S),
                ("port_rcv_packets", _IB_PACKETS_PER_S),
            ):
                ib.counters[name] += per_s * dt * self._rng.uniform(0.9, 1.1)

    def _ib_faults(self, ib: _IbState, kind: str) -> bool:
        return any(
            f.spec.kind == kind and f.spec.device == ib.device and f.spec.port == ib.port
            for f in self._faults
        )

    def _ib_down(self, ib: _IbState) -> bool:
        return self._ib_faults(ib, "ib_down") or (self._ib_faults(ib, "ib_flap") and ib.flap_down)

    # -- collectors ------------------------------------------------------------------------

    def collect(self) -> GpuCollection:
        """GpuCollector: one sample per GPU at the clock's current time. Blocks while an
        `nvml_hang` fault lasts (until cleared, expired, or the sim is closed)."""
        now_mono = self._clock.monotonic()
        with self._lock:
            self._advance(now_mono)
            if self._active("nvml_hang") and not self._closed:
                self.hung_collects_total += 1
                while self._active("nvml_hang") and not self._closed:
                    self._unhung.wait(HANG_RECHECK_S)
                    now_mono = self._clock.monotonic()
                    self._advance(now_mono)
            t = now_mono - self._start_mono
            return GpuCollection(gpus=tuple(self._gpu_sample(g, t) for g in self._gpus))

    def _gpu_sample(self, g: _GpuState, t: float) -> GpuSample:
        if g.lost:
            # NVML answers GpuIsLost for every query: only identity and the lost flag remain.
            return GpuSample(
                index=g.index, uuid=g.uuid, pci_bus_id=g.pci_bus_id, name=GPU_NAME, lost=True
            )
        rng = self._rng
        thermal = bool(self._active("thermal", gpu=g.index))
        slowdown = bool(self._active("slowdown", gpu=g.index))
        # a slow sine (10 min period) on top of noise: looks like a real training load
        wave = math.sin(2 * math.pi * t / 600.0 + g.index)
        temp = g.base_temp_c + 6.0 * wave + rng.uniform(-0.5, 0.5)
        power = g.base_power_w + 40.0 * wave + rng.uniform(-15.0, 15.0)
        sm_mhz = SM_CLOCK_MAX_MHZ - rng.choice((0.0, 0.0, 15.0, 30.0))
        util = min(100.0, 92.0 + 4.0 * wave + rng.uniform(-2.0, 2.0))
        reasons = 0
        if thermal:
            temp = 91.0 + rng.uniform(0.0, 2.0)
            reasons |= REASON_HW_THERMAL | REASON_HW_SLOWDOWN
            sm_mhz = 900.0
        if slowdown:
            reasons |= REASON_HW_SLOWDOWN
            sm_mhz = SM_CLOCK_SLOW_MHZ
            power = 180.0 + rng.uniform(-10.0, 10.0)
        if thermal or slowdown:
            util = min(util, 60.0)
        corrected = int(g.ecc_corrected_volatile)
        links = tuple(self._nvlink_sample(g, link) for link in range(NVLINKS_PER_GPU))
        return GpuSample(
            index=g.index,
            uuid=g.uuid,
            pci_bus_id=g.pci_bus_id,
            name=GPU_NAME,
            temperature_celsius=round(temp, 1),
            power_watts=round(power, 1),
            utilization_gpu_percent=round(util, 1),
            utilization_memory_percent=round(util * 0.55, 1),
            memory_used_bytes=int(GPU_MEMORY_BYTES * 0.86),
            memory_total_bytes=GPU_MEMORY_BYTES,
            sm_clock_mhz=sm_mhz,
            clock_event_reasons=reasons,
            throttle_hw_slowdown=bool(reasons & REASON_HW_SLOWDOWN),
            throttle_hw_thermal=bool(reasons & REASON_HW_THERMAL),
            throttle_sw_thermal=bool(reasons & REASON_SW_THERMAL),
            throttle_power_brake=bool(reasons & REASON_HW_POWER_BRAKE),
            ecc_corrected_volatile_total=corrected,
            ecc_uncorrected_volatile_total=g.ecc_uncorrected_volatile,
            ecc_corrected_aggregate_total=g.ecc_corrected_aggregate_base + corrected,
            ecc_uncorrected_aggregate_total=g.ecc_uncorrected_aggregate_base,
            remapped_rows_correctable=g.remapped_correctable,
            remapped_rows_uncorrectable=g.remapped_uncorrectable,
            remapped_rows_pending=g.remap_pending,
            remapped_rows_failure=g.remap_failure,
            retired_pages_sbe=None,  # H100 uses row remapping; page retirement is unsupported
            retired_pages_dbe=None,
            retired_pages_pending=None,
            pcie_replay_total=g.pcie_replay,
            nvlinks=links,
        )

    def _nvlink_sample(self, g: _GpuState, link: int) -> NvLinkSample:
        down = any(f.link == link for f in self._active("nvlink_down", gpu=g.index))
        return NvLinkSample(
            link=link,
            up=not down,
            crc_flit_errors_total=g.nvlink_crc_flit[link],
            crc_data_errors_total=g.nvlink_crc_data[link],
            replay_errors_total=int(g.nvlink_replay[link]),
            recovery_errors_total=int(g.nvlink_recovery[link]),
        )

    def collect_ib(self) -> tuple[IbPortSample, ...]:
        """IbCollector: one sample per port, counters as sysfs gives them (data in words)."""
        now_mono = self._clock.monotonic()
        with self._lock:
            self._advance(now_mono)
            for ib in self._ib:
                if self._ib_faults(ib, "ib_flap"):
                    # a flapping port changes state at every read; each fall counts
                    ib.flap_down = not ib.flap_down
                    if ib.flap_down:
                        ib.counters["link_downed"] += 1
                        ib.counters["link_error_recovery"] += 1
                        ib.counters["symbol_error"] += 3
            return tuple(self._ib_sample(ib) for ib in self._ib)

    def _ib_sample(self, ib: _IbState) -> IbPortSample:
        hard_down = self._ib_faults(ib, "ib_down")
        down = self._ib_down(ib)
        state = "DOWN" if down else "ACTIVE"
        phys = "Disabled" if hard_down else ("Polling" if down else "LinkUp")
        return IbPortSample(
            device=ib.device,
            port=ib.port,
            state=state,
            state_code=_IB_STATES[state],
            phys_state=phys,
            phys_state_code=_IB_PHYS[phys],
            rate_gbps=IB_RATE_GBPS,
            link_layer="InfiniBand",
            counters={k: int(v) for k, v in ib.counters.items()},
            hw_counters=dict(ib.hw_counters),
        )

    def poll(self) -> list[HardwareEvent]:
        """EventSource: the XID / gpu_lost events fired since the last poll."""
        with self._lock:
            events, self._events = self._events, []
            return events

    def bus_id_to_index(self) -> dict[str, int]:
        return {g.pci_bus_id: g.index for g in self._gpus}

    def active_faults(self) -> list[FaultSpec]:
        with self._lock:
            self._advance(self._clock.monotonic())
            return [f.spec for f in self._faults]

    # -- preflight and repair ---------------------------------------------------------------

    def sdc_gpus(self) -> frozenset[int]:
        """The GPUs whose compute burn must come out wrong."""
        with self._lock:
            return frozenset(g for kind, g in self._sim_faults if kind == "sdc")

    def burn_tflops(self, gpu: int) -> float | None:
        """What GPU `gpu`'s burn reaches now: its nominal rate at its current SM clock (a
        slowdown or thermal fault lowers it); None for a lost GPU."""
        with self._lock:
            self._advance(self._clock.monotonic())
            g = self._find_gpu(gpu)
            if g.lost:
                return None
            if self._active("slowdown", gpu=gpu):
                return SIM_BURN_TFLOPS * SM_CLOCK_SLOW_MHZ / SM_CLOCK_MAX_MHZ
            if self._active("thermal", gpu=gpu):
                return SIM_BURN_TFLOPS * 900.0 / SM_CLOCK_MAX_MHZ
            return SIM_BURN_TFLOPS

    def collective_gbps(self) -> float | None:
        """The node's all-reduce bus bandwidth now: the nominal figure times the NVLink share
        of the GPU with the fewest links up (a ring runs at its slowest hop); None while a GPU
        is lost (the collective cannot form)."""
        with self._lock:
            self._advance(self._clock.monotonic())
            if any(g.lost for g in self._gpus):
                return None
            worst = NVLINKS_PER_GPU
            for g in self._gpus:
                down = {f.link for f in self._active("nvlink_down", gpu=g.index)}
                worst = min(worst, NVLINKS_PER_GPU - len(down))
            return SIM_BUSBW_GBPS * worst / NVLINKS_PER_GPU

    def reset_gpu(self, gpu: int) -> None:
        """A GPU reset: as on the hardware, pending row remaps are applied (and count as
        remapped), volatile ECC counts start again at 0, a lost GPU answers again, and the
        faults on it end. Raises SimResetError under a `reset_fail` fault (nothing changes)."""
        with self._lock:
            g = self._find_gpu(gpu)
            if ("reset_fail", gpu) in self._sim_faults:
                raise SimResetError(f"GPU {gpu}: reset failed (simulated)")
            self._reset(g)
            self.resets.append(gpu)
            self._unhung.notify_all()

    def reboot(self) -> None:
        """A node reboot: every GPU reset, every fault gone (counters of the past stay)."""
        with self._lock:
            for g in self._gpus:
                self._reset(g)
            self._faults.clear()
            self._sim_faults.clear()
            for ib in self._ib:
                ib.flap_down = False
            self.reboots_total += 1
            self._unhung.notify_all()

    def _reset(self, g: _GpuState) -> None:
        """One GPU back to a fresh state (lock held)."""
        if g.remap_pending:
            g.remapped_uncorrectable += 1
            g.remap_pending = False
        g.ecc_corrected_aggregate_base += int(g.ecc_corrected_volatile)
        g.ecc_corrected_volatile = 0.0
        g.ecc_uncorrected_volatile = 0
        g.lost = False
        self._faults = [
            f for f in self._faults if f.spec.gpu != g.index or f.spec.kind in _NODE_FAULTS
        ]
        self._sim_faults = {(k, i) for k, i in self._sim_faults if i != g.index}

    def close(self) -> None:
        """Release any collect hung by `nvml_hang` (nothing else to release)."""
        with self._lock:
            self._closed = True
            self._unhung.notify_all()


# faults that are not one GPU's (their `gpu` field is unused): a GPU reset leaves them
_NODE_FAULTS = frozenset({"nvml_hang", "ib_flap", "ib_down"})


class _IbView:
    """SimHardware seen as an IbCollector (its `collect()` returns IB ports)."""

    def __init__(self, sim: SimHardware) -> None:
        self._sim = sim

    def collect(self) -> tuple[IbPortSample, ...]:
        return self._sim.collect_ib()
