"""Each preflight check passing and failing: the NVML checks on the sim and on the fake pynvml
(real NVML error classes, recorded H100 values), the burn and collective checks on recording
fakes, checkpoint storage on real directories; the runner's order and one-at-a-time."""

from __future__ import annotations

import threading
import types
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.unit.agent.collectors.conftest import load_fake_pynvml
from trainguard.agent.burn import DeviceBurn
from trainguard.agent.collectors.nvml import NvmlGpuCollector
from trainguard.agent.preflight import PreflightBusy, PreflightRunner
from trainguard.agent.preflight_checks import (
    CollectiveResult,
    WorkerError,
    check_ckpt_storage,
    check_collective,
    check_compute_burn,
    check_ecc,
    check_nvml_health,
    check_row_remaps,
)
from trainguard.agent.sim import SimHardware
from trainguard.clock import FakeClock
from trainguard.command_args import PREFLIGHT_CHECKS, PreflightArgs
from trainguard.protocol import FaultSpec


def sim(gpus: int = 4) -> SimHardware:
    return SimHardware(gpus=gpus, ib_ports=0, node_name="n1", seed=0, clock=FakeClock())


@pytest.fixture
def fake_nvml() -> types.ModuleType:
    return load_fake_pynvml()


def nvml(fake: types.ModuleType) -> NvmlGpuCollector:
    return NvmlGpuCollector(nvml=fake, clock=FakeClock())


# --- nvml_health ------------------------------------------------------------------------------


def test_nvml_health_passes_when_every_gpu_answers() -> None:
    r = check_nvml_health(sim().collect(), expected_gpus=4)
    assert (r.passed, r.value) == (True, 4.0)


def test_nvml_health_fails_on_a_lost_sim_gpu() -> None:
    hw = sim()
    hw.inject(FaultSpec(kind="gpu_lost", gpu=2))
    r = check_nvml_health(hw.collect(), expected_gpus=4)
    assert not r.passed
    assert "GPU 2 lost" in r.detail


def test_nvml_health_fails_on_a_gpu_lost_in_nvml(fake_nvml: types.ModuleType) -> None:
    collector = nvml(fake_nvml)
    collector.collect()
    fake_nvml.set_lost(5)
    r = check_nvml_health(collector.collect(), expected_gpus=8)
    assert not r.passed
    assert "GPU 5 lost" in r.detail


def test_nvml_health_fails_when_fewer_gpus_answer_than_the_node_had(
    fake_nvml: types.ModuleType,
) -> None:
    r = check_nvml_health(nvml(fake_nvml).collect(), expected_gpus=9)
    assert not r.passed
    assert "8 GPU(s) answer NVML, the node had 9" in r.detail


def test_nvml_health_fails_with_no_gpu_at_all() -> None:
    assert not check_nvml_health(sim(0).collect(), expected_gpus=0).passed


# --- row_remaps -------------------------------------------------------------------------------


def test_row_remaps_pass_on_a_healthy_node(fake_nvml: types.ModuleType) -> None:
    # GPU 5 of the recording has 2 correctable remaps done: healthy, nothing pending
    assert check_row_remaps(nvml(fake_nvml).collect()).passed


@pytest.mark.parametrize(
    ("value", "words"),
    [((0, 1, 1, 0), "row remap pending"), ((0, 1, 0, 1), "row remapping failed")],
    ids=["pending", "failed"],
)
def test_row_remaps_fail_on_nvml_pending_or_failed(
    fake_nvml: types.ModuleType, value: tuple[int, ...], words: str
) -> None:
    fake_nvml.set_value(3, "remapped_rows", list(value))
    r = check_row_remaps(nvml(fake_nvml).collect())
    assert not r.passed
    assert f"GPU 3: {words}" in r.detail


@pytest.mark.parametrize("kind", ["remap_pending", "remap_failure", "dbe"])
def test_row_remaps_fail_on_the_sims_remap_faults(kind: str) -> None:
    hw = sim()
    hw.inject(FaultSpec(kind=kind, gpu=1))  # type: ignore[arg-type]
    r = check_row_remaps(hw.collect())
    assert not r.passed
    assert r.detail.startswith("GPU 1:")


def test_row_remaps_unsupported_is_said_not_failed(fake_nvml: types.ModuleType) -> None:
    fake_nvml.script_error(0, "nvmlDeviceGetRemappedRows", fake_nvml.NVML_ERROR_NOT_SUPPORTED)
    r = check_row_remaps(nvml(fake_nvml).collect())
    assert r.passed
    assert "GPU 0: row remapping not supported" in r.detail


# --- ecc --------------------------------------------------------------------------------------


def test_ecc_passes_with_only_corrected_errors() -> None:
    hw = sim()
    hw.inject(FaultSpec(kind="ecc_storm", gpu=0, rate_per_s=100.0))
    assert check_ecc(hw.collect()).passed


def test_ecc_fails_on_a_volatile_uncorrectable_error_in_the_sim() -> None:
    hw = sim()
    hw.inject(FaultSpec(kind="dbe", gpu=3))
    r = check_ecc(hw.collect())
    assert (r.passed, r.value) == (False, 1.0)
    assert "GPU 3: 1 uncorrectable" in r.detail


def test_ecc_fails_on_a_volatile_uncorrectable_error_in_nvml(fake_nvml: types.ModuleType) -> None:
    ecc = dict(fake_nvml.gpus[6]["ecc"])
    ecc["uncorrected_volatile"] = 2
    fake_nvml.set_value(6, "ecc", ecc)
    r = check_ecc(nvml(fake_nvml).collect())
    assert not r.passed
    assert "GPU 6: 2 uncorrectable" in r.detail


# --- compute_burn -----------------------------------------------------------------------------


class FakeBurner:
    def __init__(self, results: dict[int, DeviceBurn] | None = None, fail: str = "") -> None:
        self.results = results or {}
        self.fail = fail
        self.calls: list[tuple[list[int], float]] = []

    def burn(self, *, gpus: Sequence[int], seconds: float) -> list[DeviceBurn]:
        self.calls.append((list(gpus), seconds))
        if self.fail:
            raise WorkerError(self.fail)
        return [
            self.results.get(
                g, DeviceBurn(gpu=g, iterations=10, mismatches=0, seconds=seconds, tflops=50.0)
            )
            for g in gpus
        ]


def test_compute_burn_passes_within_tolerance_of_the_reference() -> None:
    burner = FakeBurner(
        {1: DeviceBurn(gpu=1, iterations=9, mismatches=0, seconds=2.0, tflops=46.0)}
    )
    r = check_compute_burn(burner, gpus=[0, 1], burn_s=2.0, reference=50.0, tolerance=0.1)
    assert (r.passed, r.value, r.reference) == (True, 46.0, 50.0)
    assert burner.calls == [([0, 1], 2.0)]


def test_compute_burn_fails_a_slow_gpu() -> None:
    burner = FakeBurner({1: DeviceBurn(gpu=1, iterations=2, mismatches=0, seconds=2.0, tflops=8.9)})
    r = check_compute_burn(burner, gpus=[0, 1], burn_s=2.0, reference=50.0, tolerance=0.1)
    assert not r.passed
    assert "GPU 1: 8.9 TFLOP/s, below 50 - 10%" in r.detail


def test_compute_burn_without_reference_judges_correctness_only() -> None:
    burner = FakeBurner({0: DeviceBurn(gpu=0, iterations=2, mismatches=0, seconds=2.0, tflops=0.1)})
    r = check_compute_burn(burner, gpus=[0], burn_s=2.0, reference=None, tolerance=0.1)
    assert r.passed
    assert "speed not judged" in r.detail


def test_compute_burn_fails_on_a_wrong_product_whatever_its_speed() -> None:
    burner = FakeBurner(
        {2: DeviceBurn(gpu=2, iterations=40, mismatches=1, seconds=2.0, tflops=60.0)}
    )
    r = check_compute_burn(burner, gpus=[0, 1, 2], burn_s=2.0, reference=None, tolerance=0.1)
    assert not r.passed
    assert "GPU 2: 1 of 40 products wrong (silent data corruption)" in r.detail


def test_compute_burn_fails_when_its_worker_fails_or_a_gpu_errs() -> None:
    assert not check_compute_burn(
        FakeBurner(fail="burn: no answer within 122 s (killed)"),
        gpus=[0],
        burn_s=2.0,
        reference=None,
        tolerance=0.1,
    ).passed
    err = DeviceBurn(gpu=0, iterations=0, mismatches=0, seconds=0.0, tflops=0.0, error="CUDA error")
    r = check_compute_burn(
        FakeBurner({0: err}), gpus=[0], burn_s=1.0, reference=None, tolerance=0.1
    )
    assert not r.passed
    assert "GPU 0: CUDA error" in r.detail


# --- collective_bandwidth ---------------------------------------------------------------------


class FakeCollective:
    def __init__(self, result: CollectiveResult) -> None:
        self.result = result
        self.calls: list[list[int]] = []

    def all_reduce(self, *, gpus: Sequence[int], seconds: float) -> CollectiveResult:
        self.calls.append(list(gpus))
        return self.result


def test_collective_passes_within_tolerance_and_fails_below() -> None:
    good = FakeCollective(CollectiveResult(busbw_gbps=340.0, world=8, backend="nccl"))
    r = check_collective(good, gpus=list(range(8)), seconds=2.0, reference=360.0, tolerance=0.1)
    assert (r.passed, r.value) == (True, 340.0)
    slow = FakeCollective(CollectiveResult(busbw_gbps=200.0, world=8, backend="nccl"))
    r = check_collective(slow, gpus=list(range(8)), seconds=2.0, reference=360.0, tolerance=0.1)
    assert not r.passed
    assert "below 360 - 10%" in r.detail


def test_collective_fails_on_wrong_sums_or_an_error() -> None:
    wrong = FakeCollective(CollectiveResult(busbw_gbps=360.0, world=8, wrong=1, backend="nccl"))
    assert not check_collective(
        wrong, gpus=[0, 1], seconds=1.0, reference=None, tolerance=0.1
    ).passed
    err = FakeCollective(CollectiveResult(error="a GPU is lost"))
    assert not check_collective(err, gpus=[0, 1], seconds=1.0, reference=None, tolerance=0.1).passed


def test_collective_of_one_gpu_passes_with_nothing_to_measure() -> None:
    one = FakeCollective(CollectiveResult(world=1, backend="nccl"))
    r = check_collective(one, gpus=[0], seconds=1.0, reference=360.0, tolerance=0.1)
    assert r.passed
    assert "one GPU" in r.detail


# --- ckpt_storage -----------------------------------------------------------------------------


def test_ckpt_storage_writes_reads_back_and_leaves_nothing(tmp_path: Path) -> None:
    r = check_ckpt_storage(str(tmp_path))
    assert r.passed
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("where", ["missing", "a_file"])
def test_ckpt_storage_fails_where_no_file_can_be_written(tmp_path: Path, where: str) -> None:
    target = tmp_path / where
    if where == "a_file":
        target.write_text("x")
    r = check_ckpt_storage(str(target))
    assert not r.passed
    assert str(target) in r.detail


def test_ckpt_storage_without_a_directory_is_skipped_and_says_so() -> None:
    r = check_ckpt_storage(None)
    assert r.passed
    assert r.detail.startswith("skipped")


# --- the runner -------------------------------------------------------------------------------


def runner(hw: SimHardware, burner: FakeBurner | None = None) -> PreflightRunner:
    return PreflightRunner(
        gpu=hw,
        burner=burner or FakeBurner(),
        collective=FakeCollective(CollectiveResult(busbw_gbps=360.0, world=4, backend="sim")),
        clock=FakeClock(),
        expected_gpus=lambda: 4,
    )


def test_runner_runs_the_checks_asked_for_in_the_table_order(tmp_path: Path) -> None:
    args = PreflightArgs(checks=["ckpt_storage", "ecc", "nvml_health"], ckpt_dir=str(tmp_path))
    out = runner(sim()).run(args)
    assert [c.name for c in out.checks] == ["nvml_health", "ecc", "ckpt_storage"]
    assert out.passed
    every = runner(sim()).run(PreflightArgs(ckpt_dir=str(tmp_path)))
    assert [c.name for c in every.checks] == list(PREFLIGHT_CHECKS)
    assert every.passed


def test_runner_burns_only_gpus_that_answer_and_fails_the_whole_preflight() -> None:
    hw = sim()
    hw.inject(FaultSpec(kind="gpu_lost", gpu=1))
    burner = FakeBurner()
    out = runner(hw, burner).run(PreflightArgs())
    assert not out.passed
    assert burner.calls == [([0, 2, 3], 2.0)]
    failed = {c.name for c in out.checks if not c.passed}
    assert failed == {"nvml_health", "row_remaps", "ecc", "collective_bandwidth"}
    wire = out.to_wire(command_id="c9")
    assert wire["command_id"] == "c9" and wire["passed"] is False
    assert {"name", "passed", "detail"} <= set(wire["checks"][0])
    assert out.summary().startswith("preflight failed: nvml_health: GPU 1 lost")


def test_runner_takes_one_preflight_at_a_time() -> None:
    entered, release = threading.Event(), threading.Event()

    class Blocking(FakeBurner):
        def burn(self, *, gpus: Sequence[int], seconds: float) -> list[DeviceBurn]:
            entered.set()
            release.wait(5)
            return super().burn(gpus=gpus, seconds=seconds)

    r = runner(sim(), Blocking())
    first = threading.Thread(target=r.run, args=(PreflightArgs(checks=["compute_burn"]),))
    first.start()
    try:
        assert entered.wait(5)
        with pytest.raises(PreflightBusy):
            r.run(PreflightArgs(checks=["ecc"]))
    finally:
        release.set()
        first.join(5)
    assert r.run(PreflightArgs(checks=["ecc"])).passed


def test_a_hung_gpu_read_fails_every_gpu_check_and_lets_the_others_run(tmp_path: Path) -> None:
    hw = sim()
    hw.inject(FaultSpec(kind="nvml_hang"))
    burner = FakeBurner()
    r = PreflightRunner(
        gpu=hw,
        burner=burner,
        collective=FakeCollective(CollectiveResult()),
        clock=FakeClock(),
        read_timeout_s=0.2,
    )
    try:
        out = r.run(PreflightArgs(ckpt_dir=str(tmp_path)))
    finally:
        hw.close()  # releases the abandoned read
    assert not out.passed
    by_name = {c.name: c for c in out.checks}
    assert by_name["ckpt_storage"].passed
    for name in ("nvml_health", "row_remaps", "ecc", "compute_burn", "collective_bandwidth"):
        assert by_name[name].detail == "NVML did not answer within 0.2 s"
    assert burner.calls == []
