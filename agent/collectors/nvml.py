"""GPU and NVLink health read through NVML (the `pynvml` module of nvidia-ml-py).

Every NVML call may fail on its own: NotSupported / FunctionNotFound make that field absent
(None, never zero, and the call is not repeated until the next init); any other NVML error makes
it absent and adds a bounded line to `GpuCollection.errors`; GpuIsLost marks the GPU `lost`
(identity kept from the last good read) and emits one `gpu_lost` event on the edge. A failing
`nvmlInit` is retried with backoff and reported on every collect; nothing here raises.
`pynvml` is imported only when no module is injected, so `import agent` never needs it.
An NVML call can also hang (a GPU off the bus): the agent's source deadline covers that, and
nothing else here waits behind a hung `collect()` (the bus map answers from what it knows,
`close()` gives up after a moment).
"""

from __future__ import annotations

import logging
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.agent.collectors import normalize_bus_id
from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.model import GpuCollection, GpuSample, HardwareEvent, NvLinkSample
from trainguard.protocol import EventKind

__all__ = [
    "CLOCK_EVENT_HW_POWER_BRAKE",
    "CLOCK_EVENT_HW_SLOWDOWN",
    "CLOCK_EVENT_HW_THERMAL",
    "CLOCK_EVENT_SW_THERMAL",
    "NVML_FUNCTIONS_USED",
    "NvmlGpuCollector",
]

log = logging.getLogger("trainguard.agent.nvml")

# nvmlClocksEventReason* bits (identical in the older nvmlClocksThrottleReason* names)
CLOCK_EVENT_HW_SLOWDOWN = 0x8
CLOCK_EVENT_SW_THERMAL = 0x20
CLOCK_EVENT_HW_THERMAL = 0x40
CLOCK_EVENT_HW_POWER_BRAKE = 0x80

INIT_BACKOFF_INITIAL_S = 1.0
INIT_BACKOFF_MAX_S = 60.0  # a node without a driver retries once a minute, cheaply
ERROR_MAX_CHARS = 200
ERRORS_MAX_PER_COLLECT = 32  # a sick node must not turn one report into megabytes of text
# close() waits this long for a collect in progress before leaving NVML as it is (a hung
# call holds the lock for good; nvmlShutdown under it could hang the agent's stop too).
CLOSE_LOCK_WAIT_S = 1.0

# Every pynvml function this module may call; a test checks each exists in nvidia-ml-py.
NVML_FUNCTIONS_USED: tuple[str, ...] = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetName",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRetiredPagesPendingStatus",
    "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkErrorCounter",
)
# ... and every constant it passes.
NVML_CONSTANTS_USED: tuple[str, ...] = (
    "NVML_TEMPERATURE_GPU",
    "NVML_CLOCK_SM",
    "NVML_MEMORY_ERROR_TYPE_CORRECTED",
    "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
    "NVML_VOLATILE_ECC",
    "NVML_AGGREGATE_ECC",
    "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS",
    "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR",
    "NVML_NVLINK_ERROR_DL_REPLAY",
    "NVML_NVLINK_ERROR_DL_RECOVERY",
    "NVML_NVLINK_ERROR_DL_CRC_FLIT",
    "NVML_NVLINK_ERROR_DL_CRC_DATA",
    "NVML_FEATURE_ENABLED",
)

_ABSENT: Any = object()


class _GpuLost(Exception):
    """NVML said GpuIsLost while reading this GPU."""


class _Uninitialized(Exception):
    """NVML forgot its init (driver reloaded): re-init on the next collect."""


def _bounded(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= ERROR_MAX_CHARS else text[: ERROR_MAX_CHARS - 1] + "…"


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").rstrip("\x00")
    return str(value)


@dataclass
class _Gpu:
    """What the collector remembers about one GPU between collects (reset on re-init)."""

    index: int
    handle: Any = None
    uuid: str = ""
    pci_bus_id: str = ""
    name: str = ""
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)
    absent_links: set[int] = field(default_factory=set)


class NvmlGpuCollector:
    """Implements `trainguard.model.GpuCollector` over NVML.

    `nvml=None` imports the real `pynvml` on first use; tests pass a fake module that raises
    the real NVML error classes.
    """

    def __init__(
        self,
        *,
        nvml: types.ModuleType | None = None,
        clock: Clock = SYSTEM_CLOCK,
        nvlink_max_links: int = 18,
    ) -> None:
        if nvlink_max_links < 0:
            raise ValueError("nvlink_max_links must be >= 0")
        self._nvml: Any = nvml
        self._clock = clock
        self._nvlink_max_links = nvlink_max_links
        self._lock = threading.Lock()
        self._initialised = False
        self._init_error = ""
        self._next_init_mono: float | None = None
        self._init_backoff_s = INIT_BACKOFF_INITIAL_S
        self._gpus: list[_Gpu] = []
        # identity survives re-init so a GPU that vanished from the device list stays named
        self._known: dict[int, _Gpu] = {}
        # the last bus map built under the lock, replaced whole: read without the lock
        self._bus_cache: dict[str, int] = {}
        self.init_failures_total = 0

    # --- init ---------------------------------------------------------------------------------

    def _import(self) -> Any:
        if self._nvml is None:
            import pynvml  # noqa: PLC0415 - heavy/optional: only where NVML is really used

            self._nvml = pynvml
        return self._nvml

    def _ensure_init(self, errors: list[str]) -> bool:
        if self._initialised:
            return True
        mono = self._clock.monotonic()
        if self._next_init_mono is not None and mono < self._next_init_mono:
            wait_s = self._next_init_mono - mono
            errors.append(
                _bounded(f"nvml unavailable: {self._init_error} (retry in {wait_s:.0f}s)")
            )
            return False
        try:
            nvml = self._import()
        except ImportError as e:
            return self._init_failed(f"pynvml not importable: {e}", errors)
        try:
            nvml.nvmlInit()
        except Exception as e:  # any NVMLError (DriverNotLoaded, LibraryNotFound, Unknown, ...)
            return self._init_failed(f"nvmlInit: {_describe(e)}", errors)
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            self._shutdown_quietly()
            return self._init_failed(f"nvmlDeviceGetCount: {_describe(e)}", errors)
        self._gpus = [self._known.get(i) or _Gpu(index=i) for i in range(count)]
        for gpu in self._gpus:
            gpu.handle = None
            gpu.unsupported = set()
            gpu.absent_links = set()
            self._known[gpu.index] = gpu
        self._initialised = True
        self._init_backoff_s = INIT_BACKOFF_INITIAL_S
        self._next_init_mono = None
        log.info("event=nvml_init ok=true gpus=%d recovered_from=%r", count, self._init_error)
        self._init_error = ""
        return True

    def _init_failed(self, reason: str, errors: list[str]) -> bool:
        self.init_failures_total += 1
        first = not self._init_error
        self._init_error = _bounded(reason)
        self._next_init_mono = self._clock.monotonic() + self._init_backoff_s
        if first:
            log.warning("event=nvml_init ok=false reason=%r", self._init_error)
        errors.append(
            _bounded(f"nvml unavailable: {self._init_error} (retry in {self._init_backoff_s:.0f}s)")
        )
        self._init_backoff_s = min(self._init_backoff_s * 2, INIT_BACKOFF_MAX_S)
        return False

    def _shutdown_quietly(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception as e:
            log.warning("event=nvml_shutdown ok=false reason=%r", _describe(e))

    # --- public -------------------------------------------------------------------------------

    def collect(self) -> GpuCollection:
        with self._lock:
            errors: list[str] = []
            if not self._ensure_init(errors):
                return GpuCollection(errors=tuple(errors))
            now = self._clock.now()
            samples: list[GpuSample] = []
            events: list[HardwareEvent] = []
            for gpu in self._gpus:
                try:
                    sample = self._collect_gpu(gpu, errors)
                except _GpuLost:
                    sample = self._lost_sample(gpu)
                    if not gpu.lost:
                        gpu.lost = True
                        events.append(self._lost_event(gpu, now))
                except _Uninitialized:
                    errors.append("nvml uninitialized (driver reloaded?): re-initialising")
                    self._initialised = False
                    return GpuCollection(
                        gpus=tuple(samples), events=tuple(events), errors=_cap(errors)
                    )
                else:
                    if gpu.lost and not sample.lost:
                        log.info(
                            "event=gpu_recovered gpu=%d pci_bus_id=%s", gpu.index, gpu.pci_bus_id
                        )
                        gpu.lost = False
                samples.append(sample)
            self._bus_map()
            return GpuCollection(gpus=tuple(samples), events=tuple(events), errors=_cap(errors))

    def bus_id_to_index(self) -> dict[str, int]:
        """Normalised PCI bus id ("0000:18:00.0") -> GPU index, for mapping kernel XIDs.

        Never waits for a collect in progress: that collect may be hung in NVML exactly when
        the kernel logs the XID 79 that needs this map, so the last map built answers."""
        if not self._lock.acquire(blocking=False):
            return dict(self._bus_cache)
        try:
            if not self._initialised and not self._ensure_init([]):
                return self._bus_map()
            for gpu in self._gpus:
                if gpu.pci_bus_id or gpu.lost:
                    continue
                try:
                    self._identity(gpu, [])
                except (_GpuLost, _Uninitialized):
                    continue  # collect() reports it; the map just lacks this GPU for now
            return self._bus_map()
        finally:
            self._lock.release()

    def _bus_map(self) -> dict[str, int]:
        """The map from what is known (lock held); also kept for lock-free readers."""
        self._bus_cache = {g.pci_bus_id: g.index for g in self._known.values() if g.pci_bus_id}
        return dict(self._bus_cache)

    def close(self) -> None:
        if not self._lock.acquire(timeout=CLOSE_LOCK_WAIT_S):
            log.warning("event=nvml_shutdown ok=false reason='a collect is still in NVML'")
            return
        try:
            if self._initialised:
                self._shutdown_quietly()
                self._initialised = False
        finally:
            self._lock.release()

    # --- per GPU ------------------------------------------------------------------------------

    def _lost_sample(self, gpu: _Gpu) -> GpuSample:
        return GpuSample(
            index=gpu.index, uuid=gpu.uuid, pci_bus_id=gpu.pci_bus_id, name=gpu.name, lost=True
        )

    def _lost_event(self, gpu: _Gpu, now: float) -> HardwareEvent:
        log.warning(
            "event=gpu_lost gpu=%d uuid=%s pci_bus_id=%s", gpu.index, gpu.uuid, gpu.pci_bus_id
        )
        return HardwareEvent(
            kind=EventKind.GPU_LOST,
            ts=now,
            gpu=gpu.index,
            pci_bus_id=gpu.pci_bus_id or None,
            message="NVML: GPU is lost",
        )

    def _call(self, gpu: _Gpu, errors: list[str], key: str, fn_name: str, *args: Any) -> Any:
        """One NVML call on `gpu`: its value, or _ABSENT (recording why when it matters)."""
        if key in gpu.unsupported:
            return _ABSENT
        nvml = self._nvml
        fn: Callable[..., Any] | None = getattr(nvml, fn_name, None)
        if fn is None:  # an older nvidia-ml-py without this binding
            gpu.unsupported.add(key)
            return _ABSENT
        try:
            return fn(gpu.handle, *args)
        except Exception as e:
            return self._failed(gpu, errors, key, fn_name, e)

    def _failed(self, gpu: _Gpu, errors: list[str], key: str, fn_name: str, e: Exception) -> Any:
        nvml = self._nvml
        if _is(nvml, e, "NVMLError_GpuIsLost"):
            raise _GpuLost from None
        if _is(nvml, e, "NVMLError_NotSupported") or _is(nvml, e, "NVMLError_FunctionNotFound"):
            gpu.unsupported.add(key)
            return _ABSENT
        if _is(nvml, e, "NVMLError_Uninitialized"):
            raise _Uninitialized from None
        errors.append(_bounded(f"gpu={gpu.index} {fn_name}({key}): {_describe(e)}"))
        return _ABSENT

    def _identity(self, gpu: _Gpu, errors: list[str]) -> bool:
        """Handle, uuid, bus id and name: read once per init, kept when later reads fail.
        False when there is no handle to read values through (retried next collect)."""
        if gpu.handle is None:
            try:
                gpu.handle = self._nvml.nvmlDeviceGetHandleByIndex(gpu.index)
            except Exception as e:
                self._failed(gpu, errors, "handle", "nvmlDeviceGetHandleByIndex", e)
                gpu.unsupported.discard("handle")
                return False
        if not gpu.uuid:
            uuid = self._call(gpu, errors, "uuid", "nvmlDeviceGetUUID")
            if uuid is not _ABSENT:
                gpu.uuid = _text(uuid)
        if not gpu.pci_bus_id:
            pci = self._call(gpu, errors, "pci", "nvmlDeviceGetPciInfo")
            if pci is not _ABSENT:
                try:
                    gpu.pci_bus_id = normalize_bus_id(_text(pci.busId))
                except (AttributeError, ValueError) as e:
                    errors.append(_bounded(f"gpu={gpu.index} nvmlDeviceGetPciInfo: {e}"))
        if not gpu.name:
            name = self._call(gpu, errors, "name", "nvmlDeviceGetName")
            if name is not _ABSENT:
                gpu.name = _text(name)
        return True

    def _collect_gpu(self, gpu: _Gpu, errors: list[str]) -> GpuSample:
        nvml = self._nvml
        if not self._identity(gpu, errors):
            # no handle (an error other than GpuIsLost): identity only, loss state unchanged
            return GpuSample(
                index=gpu.index,
                uuid=gpu.uuid,
                pci_bus_id=gpu.pci_bus_id,
                name=gpu.name,
                lost=gpu.lost,
            )
        v: dict[str, Any] = {}

        def call(key: str, fn_name: str, *args: Any) -> Any:
            return self._call(gpu, errors, key, fn_name, *args)

        temp = call("temperature", "nvmlDeviceGetTemperature", nvml.NVML_TEMPERATURE_GPU)
        if temp is not _ABSENT:
            v["temperature_celsius"] = float(temp)
        power_mw = call("power", "nvmlDeviceGetPowerUsage")
        if power_mw is not _ABSENT:
            v["power_watts"] = float(power_mw) / 1000.0
        util = call("utilization", "nvmlDeviceGetUtilizationRates")
        if util is not _ABSENT:
            v["utilization_gpu_percent"] = float(util.gpu)
            v["utilization_memory_percent"] = float(util.memory)
        mem = call("memory", "nvmlDeviceGetMemoryInfo")
        if mem is not _ABSENT:
            v["memory_used_bytes"] = int(mem.used)
            v["memory_total_bytes"] = int(mem.total)
        sm = call("sm_clock", "nvmlDeviceGetClockInfo", nvml.NVML_CLOCK_SM)
        if sm is not _ABSENT:
            v["sm_clock_mhz"] = float(sm)
        reasons = self._clock_event_reasons(gpu, errors)
        if reasons is not _ABSENT:
            r = int(reasons)
            v["clock_event_reasons"] = r
            v["throttle_hw_slowdown"] = bool(r & CLOCK_EVENT_HW_SLOWDOWN)
            v["throttle_sw_thermal"] = bool(r & CLOCK_EVENT_SW_THERMAL)
            v["throttle_hw_thermal"] = bool(r & CLOCK_EVENT_HW_THERMAL)
            v["throttle_power_brake"] = bool(r & CLOCK_EVENT_HW_POWER_BRAKE)
        for field_name, err_type, counter_type in (
            ("ecc_corrected_volatile_total", "CORRECTED", "VOLATILE"),
            ("ecc_uncorrected_volatile_total", "UNCORRECTED", "VOLATILE"),
            ("ecc_corrected_aggregate_total", "CORRECTED", "AGGREGATE"),
            ("ecc_uncorrected_aggregate_total", "UNCORRECTED", "AGGREGATE"),
        ):
            count = call(
                field_name,
                "nvmlDeviceGetTotalEccErrors",
                getattr(nvml, f"NVML_MEMORY_ERROR_TYPE_{err_type}"),
                getattr(nvml, f"NVML_{counter_type}_ECC"),
            )
            if count is not _ABSENT:
                v[field_name] = int(count)
        remap = call("remapped_rows", "nvmlDeviceGetRemappedRows")
        if remap is not _ABSENT:
            corr, unc, pending, failure = remap
            v["remapped_rows_correctable"] = int(corr)
            v["remapped_rows_uncorrectable"] = int(unc)
            v["remapped_rows_pending"] = bool(pending)
            v["remapped_rows_failure"] = bool(failure)
        sbe = call(
            "retired_pages_sbe",
            "nvmlDeviceGetRetiredPages",
            nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
        )
        if sbe is not _ABSENT:
            v["retired_pages_sbe"] = len(sbe)
        dbe = call(
            "retired_pages_dbe",
            "nvmlDeviceGetRetiredPages",
            nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        )
        if dbe is not _ABSENT:
            v["retired_pages_dbe"] = len(dbe)
        pending_pages = call("retired_pages_pending", "nvmlDeviceGetRetiredPagesPendingStatus")
        if pending_pages is not _ABSENT:
            v["retired_pages_pending"] = int(pending_pages) == nvml.NVML_FEATURE_ENABLED
        replay = call("pcie_replay", "nvmlDeviceGetPcieReplayCounter")
        if replay is not _ABSENT:
            v["pcie_replay_total"] = int(replay)
        return GpuSample(
            index=gpu.index,
            uuid=gpu.uuid,
            pci_bus_id=gpu.pci_bus_id,
            name=gpu.name,
            nvlinks=self._nvlinks(gpu, errors),
            **v,
        )

    def _clock_event_reasons(self, gpu: _Gpu, errors: list[str]) -> Any:
        # Drivers before r535 lack ...ClocksEventReasons; the bits are the same in the old call.
        value = self._call(
            gpu, errors, "clock_event_reasons", "nvmlDeviceGetCurrentClocksEventReasons"
        )
        if value is _ABSENT and "clock_event_reasons" in gpu.unsupported:
            value = self._call(
                gpu, errors, "clock_throttle_reasons", "nvmlDeviceGetCurrentClocksThrottleReasons"
            )
        return value

    def _nvlinks(self, gpu: _Gpu, errors: list[str]) -> tuple[NvLinkSample, ...]:
        nvml = self._nvml
        links: list[NvLinkSample] = []
        counters = (
            ("replay_errors_total", nvml.NVML_NVLINK_ERROR_DL_REPLAY),
            ("recovery_errors_total", nvml.NVML_NVLINK_ERROR_DL_RECOVERY),
            ("crc_flit_errors_total", nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT),
            ("crc_data_errors_total", nvml.NVML_NVLINK_ERROR_DL_CRC_DATA),
        )
        for link in range(self._nvlink_max_links):
            if link in gpu.absent_links:
                continue
            try:
                state = nvml.nvmlDeviceGetNvLinkState(gpu.handle, link)
            except Exception as e:
                if (
                    _is(nvml, e, "NVMLError_NotSupported")
                    or _is(nvml, e, "NVMLError_FunctionNotFound")
                    or _is(nvml, e, "NVMLError_InvalidArgument")
                ):
                    # this link index does not exist on this GPU: skipped, never "down"
                    gpu.absent_links.add(link)
                    continue
                self._failed(gpu, errors, f"nvlink{link}.state", "nvmlDeviceGetNvLinkState", e)
                state = _ABSENT
            values: dict[str, Any] = {}
            if state is not _ABSENT:
                values["up"] = int(state) == nvml.NVML_FEATURE_ENABLED
            for field_name, counter in counters:
                count = self._call(
                    gpu,
                    errors,
                    f"nvlink{link}.{field_name}",
                    "nvmlDeviceGetNvLinkErrorCounter",
                    link,
                    counter,
                )
                if count is not _ABSENT:
                    values[field_name] = int(count)
            links.append(NvLinkSample(link=link, **values))
        return tuple(links)


def _is(nvml: Any, e: Exception, class_name: str) -> bool:
    cls = getattr(nvml, class_name, None)
    return isinstance(cls, type) and isinstance(e, cls)


def _describe(e: Exception) -> str:
    try:
        text = str(e)
    except Exception:  # NVMLError.__str__ calls into the library, which may be gone
        text = ""
    return _bounded(f"{type(e).__name__}: {text}" if text else type(e).__name__)


def _cap(errors: list[str]) -> tuple[str, ...]:
    if len(errors) <= ERRORS_MAX_PER_COLLECT:
        return tuple(errors)
    extra = len(errors) - ERRORS_MAX_PER_COLLECT
    return (*errors[:ERRORS_MAX_PER_COLLECT], f"... {extra} more NVML errors")
