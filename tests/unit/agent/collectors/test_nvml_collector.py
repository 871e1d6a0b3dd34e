"""NvmlGpuCollector against the fake pynvml (real NVML error classes, recorded H100 values)."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from trainguard.agent.collectors import nvml as nvml_mod
from trainguard.agent.collectors.nvml import (
    ERRORS_MAX_PER_COLLECT,
    NVML_CONSTANTS_USED,
    NVML_FUNCTIONS_USED,
    NvmlGpuCollector,
)
from trainguard.clock import FakeClock

REPO = Path(__file__).resolve().parents[4]


def _collector(fake: types.ModuleType, clock: FakeClock | None = None) -> NvmlGpuCollector:
    return NvmlGpuCollector(nvml=fake, clock=clock or FakeClock())


def _calls(fake: types.ModuleType, fn: str, gpu: int | None = None) -> int:
    return sum(1 for name, idx, _ in fake.calls if name == fn and (gpu is None or idx == gpu))


# --- healthy node ----------------------------------------------------------------------------


def test_healthy_h100_node_reports_every_gpu_with_identity_and_values(fake_nvml):
    out = _collector(fake_nvml).collect()

    assert out.errors == ()
    assert out.events == ()
    assert [g.index for g in out.gpus] == list(range(8))
    g0, g1 = out.gpus[0], out.gpus[1]
    assert g0.uuid == "GPU-6f1c2d3e-4a5b-8c7d-9e0f-1a2b3c4d5e6f"
    assert g0.pci_bus_id == "0000:18:00.0"
    assert g1.pci_bus_id == "0000:2a:00.0"  # NVML's "00000000:2A:00.0", normalised
    assert g0.name == "NVIDIA H100 80GB HBM3"
    assert g0.lost is False
    assert g0.temperature_celsius == 34.0
    assert g0.power_watts == pytest.approx(118.432)  # NVML reports milliwatts
    assert g0.utilization_gpu_percent == 0.0
    assert g0.memory_total_bytes == 85520809984
    assert g0.memory_used_bytes == 593035264
    assert g0.sm_clock_mhz == 1980.0
    assert g0.clock_event_reasons == 0
    assert g0.throttle_hw_slowdown is False
    assert g0.ecc_uncorrected_volatile_total == 0
    assert out.gpus[2].ecc_corrected_aggregate_total == 3
    assert out.gpus[5].remapped_rows_correctable == 2
    assert g0.remapped_rows_pending is False
    assert g0.remapped_rows_failure is False
    assert out.gpus[3].pcie_replay_total == 1
    assert len(g0.nvlinks) == 18
    assert all(link.up is True for link in g0.nvlinks)
    assert g0.nvlinks[17].crc_flit_errors_total == 0


def test_h100_retired_pages_are_absent_not_zero(fake_nvml):
    # Hopper replaced page retirement by row remapping: NVML says NotSupported
    g0 = _collector(fake_nvml).collect().gpus[0]

    assert g0.retired_pages_sbe is None
    assert g0.retired_pages_dbe is None
    assert g0.retired_pages_pending is None


def test_retired_pages_are_counted_where_supported(fake_nvml):
    fake_nvml.gpus[0]["not_supported"] = []
    fake_nvml.gpus[0]["retired_pages"] = {
        str(fake_nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS): [4096, 8192],
        str(fake_nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR): [12288],
    }
    fake_nvml.gpus[0]["retired_pages_pending"] = fake_nvml.NVML_FEATURE_ENABLED

    g0 = _collector(fake_nvml).collect().gpus[0]

    assert (g0.retired_pages_sbe, g0.retired_pages_dbe, g0.retired_pages_pending) == (2, 1, True)


@pytest.mark.parametrize(
    ("reasons", "expected"),
    [
        pytest.param(0x0, (False, False, False, False), id="none"),
        pytest.param(0x1, (False, False, False, False), id="gpu-idle-is-no-throttle"),
        pytest.param(0x8, (True, False, False, False), id="hw-slowdown"),
        pytest.param(0x20, (False, True, False, False), id="sw-thermal"),
        pytest.param(0x40, (False, False, True, False), id="hw-thermal"),
        pytest.param(0x80, (False, False, False, True), id="hw-power-brake"),
        pytest.param(0x48, (True, False, True, False), id="hw-slowdown-and-thermal"),
    ],
)
def test_clock_event_reason_bits_are_decoded(fake_nvml, reasons, expected):
    fake_nvml.set_value(0, "clocks_event_reasons", reasons)

    g0 = _collector(fake_nvml).collect().gpus[0]

    assert g0.clock_event_reasons == reasons
    got = (
        g0.throttle_hw_slowdown,
        g0.throttle_sw_thermal,
        g0.throttle_hw_thermal,
        g0.throttle_power_brake,
    )
    assert got == expected


def test_old_driver_without_clocks_event_reasons_falls_back_to_throttle_reasons(fake_nvml):
    fake_nvml.remove_function("nvmlDeviceGetCurrentClocksEventReasons")
    fake_nvml.set_value(0, "clocks_event_reasons", 0x40)
    collector = _collector(fake_nvml)

    first = collector.collect()
    second = collector.collect()

    assert first.errors == ()
    assert first.gpus[0].throttle_hw_thermal is True
    assert second.gpus[0].throttle_hw_thermal is True
    # the missing entry point is remembered, not retried every second
    assert _calls(fake_nvml, "nvmlDeviceGetCurrentClocksEventReasons", gpu=0) == 1
    assert _calls(fake_nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", gpu=0) == 2


# --- one failing field never drops the others ------------------------------------------------


def test_not_supported_field_is_absent_without_error_and_not_asked_again(fake_nvml):
    fake_nvml.script_error(0, "nvmlDeviceGetPowerUsage", fake_nvml.NVML_ERROR_NOT_SUPPORTED)
    collector = _collector(fake_nvml)

    out = collector.collect()
    collector.collect()

    g0 = out.gpus[0]
    assert g0.power_watts is None
    assert g0.temperature_celsius == 34.0
    assert g0.memory_total_bytes == 85520809984
    assert out.gpus[1].power_watts == pytest.approx(124.871)
    assert out.errors == ()
    assert _calls(fake_nvml, "nvmlDeviceGetPowerUsage", gpu=0) == 1


def test_unknown_error_makes_field_absent_with_a_bounded_error_then_recovers(fake_nvml):
    fake_nvml.script_error(2, "nvmlDeviceGetTemperature", fake_nvml.NVML_ERROR_UNKNOWN, times=1)
    collector = _collector(fake_nvml)

    first = collector.collect()
    second = collector.collect()

    assert first.gpus[2].temperature_celsius is None
    assert first.gpus[2].power_watts is not None
    assert first.gpus[2].lost is False
    assert len(first.errors) == 1
    assert "gpu=2" in first.errors[0]
    assert "nvmlDeviceGetTemperature" in first.errors[0]
    assert "NVMLError_Unknown" in first.errors[0]
    assert len(first.errors[0]) <= nvml_mod.ERROR_MAX_CHARS
    assert second.gpus[2].temperature_celsius == 33.0
    assert second.errors == ()


def test_errors_per_collect_are_capped(fake_nvml):
    for gpu in range(8):
        fake_nvml.script_error(gpu, "nvmlDeviceGetNvLinkErrorCounter", fake_nvml.NVML_ERROR_UNKNOWN)

    out = _collector(fake_nvml).collect()

    assert len(out.errors) == ERRORS_MAX_PER_COLLECT + 1
    assert out.errors[-1].endswith("more NVML errors")
    assert all(link.up is True for link in out.gpus[7].nvlinks)


# --- GPU lost --------------------------------------------------------------------------------


def test_gpu_lost_keeps_identity_and_emits_one_event_on_the_edge(fake_nvml):
    clock = FakeClock()
    collector = _collector(fake_nvml, clock)
    collector.collect()
    fake_nvml.set_lost(3)

    clock.advance(1)
    first = collector.collect()
    clock.advance(1)
    second = collector.collect()

    g3 = first.gpus[3]
    assert g3.lost is True
    assert (g3.uuid, g3.pci_bus_id, g3.name) == (
        "GPU-9e8d7c6b-5a4f-4e3d-b2c1-a0f9e8d7c6b5",
        "0000:5d:00.0",
        "NVIDIA H100 80GB HBM3",
    )
    assert g3.temperature_celsius is None  # no stale values on a lost GPU
    assert [(e.kind, e.gpu, e.pci_bus_id) for e in first.events] == [
        ("gpu_lost", 3, "0000:5d:00.0")
    ]
    assert first.events[0].ts == clock.now() - 1
    assert second.gpus[3].lost is True
    assert second.events == ()
    assert [g.lost for g in second.gpus] == [False, False, False, True, False, False, False, False]
    assert second.gpus[4].temperature_celsius == 35.0


def test_gpu_lost_mid_read_marks_lost(fake_nvml):
    collector = _collector(fake_nvml)
    collector.collect()
    fake_nvml.script_error(6, "nvmlDeviceGetRemappedRows", fake_nvml.NVML_ERROR_GPU_IS_LOST)

    out = collector.collect()

    assert out.gpus[6].lost is True
    assert out.gpus[6].pci_bus_id == "0000:ba:00.0"
    assert [e.kind for e in out.events] == ["gpu_lost"]


def test_gpu_lost_at_first_sight_still_reports_the_index(fake_nvml):
    fake_nvml.set_lost(0)

    out = _collector(fake_nvml).collect()

    assert out.gpus[0].lost is True
    assert out.gpus[0].index == 0
    assert out.events[0].gpu == 0
    assert out.gpus[1].lost is False


def test_lost_gpu_that_comes_back_can_be_lost_again(fake_nvml):
    collector = _collector(fake_nvml)
    fake_nvml.set_lost(1)
    assert [e.kind for e in collector.collect().events] == ["gpu_lost"]
    fake_nvml.set_lost(1, False)
    back = collector.collect()
    fake_nvml.set_lost(1)
    again = collector.collect()

    assert back.gpus[1].lost is False
    assert back.gpus[1].temperature_celsius == 36.0
    assert [e.kind for e in again.events] == ["gpu_lost"]


def test_unknown_error_on_device_handle_is_not_lost(fake_nvml):
    fake_nvml.script_error(4, "nvmlDeviceGetHandleByIndex", fake_nvml.NVML_ERROR_UNKNOWN, times=1)
    collector = _collector(fake_nvml)

    first = collector.collect()
    second = collector.collect()

    assert first.gpus[4].lost is False
    assert first.gpus[4].temperature_celsius is None
    assert first.events == ()
    assert any("gpu=4" in e and "nvmlDeviceGetHandleByIndex" in e for e in first.errors)
    assert second.gpus[4].temperature_celsius == 35.0
    assert second.gpus[4].uuid == "GPU-a1b2c3d4-e5f6-4a7b-8c9d-0e1f2a3b4c5d"


# --- init ------------------------------------------------------------------------------------


def test_init_failure_is_reported_every_collect_and_retried_with_backoff(fake_nvml):
    clock = FakeClock()
    fake_nvml.fail_init(times=3, code=fake_nvml.NVML_ERROR_DRIVER_NOT_LOADED)
    collector = _collector(fake_nvml, clock)

    attempts = []
    for step_s in (0, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0):
        clock.advance(step_s)
        out = collector.collect()
        attempts.append((_calls(fake_nvml, "nvmlInit"), len(out.gpus), bool(out.errors)))

    # t=0 fails (retry after 1 s), t=1 fails (after 2 s), t=3 fails (after 4 s), t=7 succeeds
    assert attempts == [
        (1, 0, True),
        (1, 0, True),
        (2, 0, True),
        (2, 0, True),
        (3, 0, True),
        (3, 0, True),
        (4, 8, False),
    ]
    assert collector.init_failures_total == 3


def test_init_failure_error_names_the_nvml_error(fake_nvml):
    fake_nvml.fail_init(times=1, code=fake_nvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    out = _collector(fake_nvml).collect()

    assert out.gpus == ()
    assert "nvmlInit" in out.errors[0]
    assert "NVMLError_LibraryNotFound" in out.errors[0]


def test_nvml_forgetting_its_init_triggers_reinit_on_next_collect(fake_nvml):
    collector = _collector(fake_nvml)
    collector.collect()
    fake_nvml.nvmlShutdown()  # the driver was reloaded underneath us

    broken = collector.collect()
    healed = collector.collect()

    assert any("re-initialising" in e for e in broken.errors)
    assert len(healed.gpus) == 8
    assert healed.errors == ()
    assert _calls(fake_nvml, "nvmlInit") == 2


def test_real_pynvml_without_a_driver_reports_an_error_and_never_raises():
    pynvml = pytest.importorskip("pynvml")
    collector = NvmlGpuCollector(nvml=pynvml, clock=FakeClock())
    out = collector.collect()
    if out.gpus:
        pytest.skip("this machine has an NVIDIA driver")

    assert out.gpus == ()
    assert out.errors and "nvmlInit" in out.errors[0]
    assert collector.bus_id_to_index() == {}


# --- NVLink ----------------------------------------------------------------------------------


def test_link_that_does_not_exist_is_skipped_not_reported_down(fake_nvml):
    for link in range(12, 18):
        fake_nvml.gpus[0]["nvlinks"][link] = None  # NotSupported on nvmlDeviceGetNvLinkState
    collector = _collector(fake_nvml)

    out = collector.collect()
    collector.collect()

    assert [link.link for link in out.gpus[0].nvlinks] == list(range(12))
    assert len(out.gpus[1].nvlinks) == 18
    assert out.errors == ()
    asked = [
        a for name, idx, a in fake_nvml.calls if name == "nvmlDeviceGetNvLinkState" and idx == 0
    ]
    assert asked.count((13,)) == 1


def test_link_down_with_climbing_errors_is_reported(fake_nvml):
    fake_nvml.set_nvlink(2, 5, state=0, crc_flit=12, crc_data=3, replay=40, recovery=2)

    link = _collector(fake_nvml).collect().gpus[2].nvlinks[5]

    assert link.up is False
    assert (
        link.crc_flit_errors_total,
        link.crc_data_errors_total,
        link.replay_errors_total,
        link.recovery_errors_total,
    ) == (12, 3, 40, 2)


def test_link_state_unknown_error_keeps_the_link_with_state_absent(fake_nvml):
    fake_nvml.script_error(0, "nvmlDeviceGetNvLinkState", fake_nvml.NVML_ERROR_UNKNOWN, args=(4,))

    out = _collector(fake_nvml).collect()

    link = out.gpus[0].nvlinks[4]
    assert link.up is None
    assert link.crc_flit_errors_total == 0
    assert len(out.gpus[0].nvlinks) == 18
    assert any("nvlink4.state" in e for e in out.errors)


def test_nvlink_max_links_limits_the_links_read(fake_nvml):
    out = NvmlGpuCollector(nvml=fake_nvml, clock=FakeClock(), nvlink_max_links=4).collect()

    assert [link.link for link in out.gpus[0].nvlinks] == [0, 1, 2, 3]


# --- bus ids and lifecycle -------------------------------------------------------------------


def test_bus_id_to_index_maps_normalised_bus_ids(fake_nvml):
    collector = _collector(fake_nvml)

    mapping = collector.bus_id_to_index()
    collector.collect()

    assert mapping == {
        "0000:18:00.0": 0,
        "0000:2a:00.0": 1,
        "0000:3a:00.0": 2,
        "0000:5d:00.0": 3,
        "0000:9a:00.0": 4,
        "0000:ab:00.0": 5,
        "0000:ba:00.0": 6,
        "0000:db:00.0": 7,
    }
    assert collector.bus_id_to_index() == mapping


def test_close_shuts_nvml_down(fake_nvml):
    collector = _collector(fake_nvml)
    collector.collect()

    collector.close()

    assert fake_nvml.initialised() is False
    assert _calls(fake_nvml, "nvmlShutdown") == 1


# --- the fake and the collector agree with the real nvidia-ml-py ------------------------------


def test_every_pynvml_name_the_collector_uses_exists_in_nvidia_ml_py(fake_nvml):
    real = sys.modules.get("pynvml") or importlib.import_module("pynvml")
    assert Path(real.__file__).resolve() == Path(fake_nvml.REAL_MODULE_FILE).resolve()

    missing_fns = [n for n in NVML_FUNCTIONS_USED if not callable(getattr(real, n, None))]
    missing_consts = [n for n in NVML_CONSTANTS_USED if not hasattr(real, n)]
    missing_errors = [
        n
        for n in (
            "NVMLError_GpuIsLost",
            "NVMLError_NotSupported",
            "NVMLError_FunctionNotFound",
            "NVMLError_Unknown",
            "NVMLError_Uninitialized",
            "NVMLError_InvalidArgument",
        )
        if not hasattr(real, n)
    ]

    assert missing_fns == []
    assert missing_consts == []
    assert missing_errors == []


def test_collector_source_calls_only_names_it_declares():
    source = inspect.getsource(nvml_mod)
    called = set(__import__("re").findall(r'"(nvml[A-Z]\w+)"', source))
    called |= set(__import__("re").findall(r"\.(nvml[A-Z]\w+)\(", source))

    assert called <= set(NVML_FUNCTIONS_USED)


def test_fake_matches_real_signatures_for_every_function_used(fake_nvml):
    real = importlib.import_module("pynvml")
    for name in NVML_FUNCTIONS_USED:
        fake_params = list(inspect.signature(getattr(fake_nvml, name)).parameters)
        real_params = list(inspect.signature(getattr(real, name)).parameters)
        assert fake_params == real_params, name


def test_fake_raises_the_real_error_classes(fake_nvml):
    real = importlib.import_module("pynvml")
    fake_nvml.set_lost(0)
    handle = None
    fake_nvml.nvmlInit()
    with pytest.raises(real.NVMLError_GpuIsLost):
        handle = fake_nvml.nvmlDeviceGetHandleByIndex(0)
    assert handle is None
    assert type(real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)) is real.NVMLError_NotSupported


def test_importing_the_collectors_does_not_import_pynvml():
    code = (
        "import sys\n"
        "for m in ('pynvml', 'torch', 'boto3'):\n"
        "    sys.modules[m] = None\n"
        "import agent, agent.collectors.nvml, agent.collectors.xid, agent.collectors.infiniband\n"
        "import trainguard.xid_catalog\n"
        "from agent.collectors.nvml import NvmlGpuCollector\n"
        "out = NvmlGpuCollector().collect()\n"
        "assert out.gpus == () and 'pynvml not importable' in out.errors[0], out\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_lost_gpu_without_a_handle_after_reinit_stays_lost_without_a_new_event(fake_nvml):
    collector = _collector(fake_nvml)
    fake_nvml.set_lost(1)
    assert [e.kind for e in collector.collect().events] == ["gpu_lost"]
    fake_nvml.nvmlShutdown()  # driver reload: the collector re-initialises
    collector.collect()
    fake_nvml.set_lost(1, False)
    fake_nvml.script_error(1, "nvmlDeviceGetHandleByIndex", fake_nvml.NVML_ERROR_UNKNOWN)

    out = collector.collect()

    assert out.gpus[1].lost is True
    assert out.gpus[1].pci_bus_id == ""  # never read: it was lost from the first collect
    assert out.events == ()


def test_a_collect_hung_in_nvml_holds_up_neither_the_bus_map_nor_close(fake_nvml, monkeypatch):
    # a GPU off the bus: an NVML call never returns, and the kernel logs XID 79 meanwhile
    collector = _collector(fake_nvml)
    collector.collect()
    mapping = collector.bus_id_to_index()
    entered, release = threading.Event(), threading.Event()
    real = fake_nvml.nvmlDeviceGetTemperature

    def hung(handle, sensor):
        entered.set()
        release.wait(30.0)
        return real(handle, sensor)

    monkeypatch.setattr(fake_nvml, "nvmlDeviceGetTemperature", hung)
    worker = threading.Thread(target=collector.collect, daemon=True)
    worker.start()
    assert entered.wait(5.0)

    assert collector.bus_id_to_index() == mapping  # answered from the last map built
    collector.close()  # gives up on the lock instead of hanging the agent's stop
    assert _calls(fake_nvml, "nvmlShutdown") == 0 and worker.is_alive()

    release.set()
    worker.join(5.0)
    assert not worker.is_alive()
    collector.close()
    assert _calls(fake_nvml, "nvmlShutdown") == 1
