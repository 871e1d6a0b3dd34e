"""Where the burn and the all-reduce run: a child that overruns its deadline is killed with
its whole process group, a failing or mute child fails the check with its reason, and the sim
puts its faults on top of a real CPU burn (a flipped bit caught, a slow GPU slow)."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.helpers import wait_for
from trainguard.agent.preflight_backends import (
    ProcessBurner,
    ProcessCollective,
    SimBurner,
    SimCollective,
    WorkerRun,
    run_worker,
)
from trainguard.agent.preflight_checks import CollectiveResult, WorkerError, check_compute_burn
from trainguard.agent.sim import SIM_BURN_TFLOPS, SIM_BUSBW_GBPS, SimHardware
from trainguard.clock import FakeClock
from trainguard.protocol import FaultSpec


def sim(gpus: int = 4) -> SimHardware:
    return SimHardware(gpus=gpus, ib_ports=0, node_name="n1", seed=0, clock=FakeClock())


def fake_python(tmp_path: Path, body: str) -> str:
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_child_past_its_deadline_is_killed_with_its_process_group(tmp_path: Path) -> None:
    pidfile = tmp_path / "grandchild"
    python = fake_python(tmp_path, f"sleep 60 & echo $! > {pidfile}\nwait\n")
    with pytest.raises(WorkerError, match=r"burn: no answer within 0.5 s \(killed\)"):
        run_worker(
            "trainguard.agent.burn", {}, run=WorkerRun(python=python, startup_s=0.5), seconds=0.0
        )
    grandchild = int(wait_for(lambda: pidfile.read_text().strip() or None, timeout_s=5, what="pid"))
    wait_for(lambda: _gone(grandchild), timeout_s=5, what="the rank the child started is killed")


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (
            "echo 'ModuleNotFoundError: torch' >&2; exit 1\n",
            "burn: exit 1: ModuleNotFoundError: torch",
        ),
        ("echo not json\n", "burn: no JSON answer"),
        ("echo '[1]'\n", "burn: answer is not an object"),
        ("echo '{}'\n", "burn: malformed answer"),
    ],
    ids=["exits", "not-json", "not-object", "no-results"],
)
def test_a_failing_child_fails_the_check_with_its_reason(
    tmp_path: Path, body: str, reason: str
) -> None:
    burner = ProcessBurner(
        device="cuda", run=WorkerRun(python=fake_python(tmp_path, body), startup_s=10)
    )
    r = check_compute_burn(burner, gpus=[0], burn_s=0.1, reference=None, tolerance=0.1)
    assert not r.passed
    assert r.detail.startswith(reason)


def test_sim_burn_catches_the_sdc_gpu_and_reports_the_slow_one() -> None:
    hw = sim()
    hw.inject(FaultSpec(kind="sdc", gpu=2))
    hw.inject(FaultSpec(kind="slowdown", gpu=3))
    burner = SimBurner(hw, ProcessBurner(device="cpu", run=WorkerRun(startup_s=60)))
    r = check_compute_burn(
        burner, gpus=[0, 1, 2, 3], burn_s=0.2, reference=SIM_BURN_TFLOPS, tolerance=0.1
    )
    assert not r.passed
    assert "GPU 2: 1 of" in r.detail and "silent data corruption" in r.detail
    assert "GPU 3: 8.9 TFLOP/s" in r.detail
    assert "GPU 0" not in r.detail and "GPU 1" not in r.detail
    hw.reset_gpu(2)
    hw.reset_gpu(3)
    ok = check_compute_burn(
        burner, gpus=[0, 1, 2, 3], burn_s=0.2, reference=SIM_BURN_TFLOPS, tolerance=0.1
    )
    assert ok.passed and ok.value == SIM_BURN_TFLOPS


class CpuCollective:
    def __init__(self) -> None:
        self.calls = 0

    def all_reduce(self, *, gpus: Sequence[int], seconds: float) -> CollectiveResult:
        self.calls += 1
        return CollectiveResult(busbw_gbps=0.4, world=2, backend="gloo")


def test_sim_collective_follows_its_nvlinks_and_lost_gpus() -> None:
    hw = sim()
    cpu = CpuCollective()
    coll = SimCollective(hw, cpu)  # type: ignore[arg-type]
    assert coll.all_reduce(gpus=[0, 1, 2, 3], seconds=1.0).busbw_gbps == SIM_BUSBW_GBPS
    for link in range(4):
        hw.inject(FaultSpec(kind="nvlink_down", gpu=1, link=link))
    slow = coll.all_reduce(gpus=[0, 1, 2, 3], seconds=1.0)
    assert slow.busbw_gbps == pytest.approx(SIM_BUSBW_GBPS * 14 / 18)
    assert (slow.world, slow.backend) == (4, "sim over gloo")
    hw.inject(FaultSpec(kind="gpu_lost", gpu=0))
    assert "lost" in coll.all_reduce(gpus=[0, 1, 2, 3], seconds=1.0).error
    assert coll.all_reduce(gpus=[0], seconds=1.0).world == 1
    assert cpu.calls == 3  # one GPU: nothing run


@pytest.mark.slow
def test_the_gloo_all_reduce_really_runs_among_two_processes() -> None:
    r = ProcessCollective(device="cpu", run=WorkerRun(startup_s=90)).all_reduce(
        gpus=[0, 1, 2], seconds=0.3
    )
    assert (r.backend, r.world, r.wrong, r.error) == ("gloo", 2, 0, "")
    assert r.busbw_gbps > 0
