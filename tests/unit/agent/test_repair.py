"""The `repair` command: refused while a job runs on the node, reboot only when the config
allows it, a GPU reset through the sim (clears its faults, can fail) and through nvidia-smi as
an argument list; a reboot of the sim brings it back clean."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.commands import CommandExecutor
from trainguard.agent.repair import (
    RebootRecord,
    RepairFailed,
    SimRepair,
    SystemRepair,
    repair_handler,
)
from trainguard.agent.sim import SimHardware
from trainguard.clock import FakeClock
from trainguard.command_args import RepairArgs, command
from trainguard.protocol import FaultSpec


def sim(gpus: int = 4) -> SimHardware:
    return SimHardware(gpus=gpus, ib_ports=1, node_name="n1", seed=0, clock=FakeClock())


def executor(
    hw: SimHardware,
    *,
    jobs: list[str] | None = None,
    allow_reboot: bool = False,
    record: Path | None = None,
) -> CommandExecutor:
    return CommandExecutor(
        repair_handler(
            SimRepair(hw),
            busy_jobs=lambda: jobs or [],
            allow_reboot=allow_reboot,
            reboots=RebootRecord(record or Path("/nonexistent/last-reboot-command")),
        )
    )


def test_reset_applies_pending_remaps_and_clears_the_gpus_faults() -> None:
    hw = sim()
    hw.inject(FaultSpec(kind="dbe", gpu=1))
    hw.inject(FaultSpec(kind="slowdown", gpu=1))
    hw.inject(FaultSpec(kind="slowdown", gpu=2))
    hw.inject(FaultSpec(kind="sdc", gpu=1))
    result = executor(hw).execute(command("r1", RepairArgs(method="gpu_reset", gpus=[1])))
    assert (result.ok, result.message) == (True, "reset GPU 1")
    g1 = hw.collect().gpus[1]
    assert (g1.remapped_rows_pending, g1.remapped_rows_uncorrectable) == (False, 1)
    assert g1.ecc_uncorrected_volatile_total == 0
    assert g1.ecc_uncorrected_aggregate_total == 1  # the past stays counted
    assert hw.sdc_gpus() == frozenset()
    assert [f.gpu for f in hw.active_faults()] == [2]  # another GPU's fault stays
    assert hw.resets == [1]


def test_reset_of_every_gpu_by_default_brings_a_lost_one_back() -> None:
    hw = sim()
    hw.inject(FaultSpec(kind="gpu_lost", gpu=3))
    result = executor(hw).execute(command("r1", RepairArgs()))
    assert result.ok and hw.resets == [0, 1, 2, 3]
    assert not any(g.lost for g in hw.collect().gpus)


def test_a_failing_reset_says_which_gpu_and_changes_nothing() -> None:
    hw = sim()
    hw.inject(FaultSpec(kind="remap_pending", gpu=2))
    hw.inject(FaultSpec(kind="reset_fail", gpu=2))
    result = executor(hw).execute(command("r1", RepairArgs(gpus=[0, 2])))
    assert not result.ok
    assert "GPU 2: GPU 2: reset failed" in result.message
    assert result.data["reset"] == [0]
    assert hw.collect().gpus[2].remapped_rows_pending is True


def test_repair_is_refused_while_a_job_runs_on_the_node() -> None:
    hw = sim()
    for args in (RepairArgs(), RepairArgs(method="reboot")):
        result = executor(hw, jobs=["train", "eval"], allow_reboot=True).execute(command("r", args))
        assert not result.ok
        assert "refused: job(s) eval, train still run on this node" in result.message
    assert hw.resets == [] and hw.reboots_total == 0


def test_reset_of_a_gpu_the_node_lacks_is_refused() -> None:
    result = executor(sim(2)).execute(command("r1", RepairArgs(gpus=[5])))
    assert not result.ok and "no GPU 5 on this node (2 GPUs)" in result.message


def test_reboot_is_refused_unless_the_config_allows_it() -> None:
    hw = sim()
    result = executor(hw).execute(command("r1", RepairArgs(method="reboot")))
    assert not result.ok
    assert "repair.allow_reboot" in result.message
    assert hw.reboots_total == 0


def test_sim_reboot_comes_back_without_faults(tmp_path: Path) -> None:
    hw = sim()
    hw.inject(FaultSpec(kind="remap_failure", gpu=0))
    hw.inject(FaultSpec(kind="ib_down", device="mlx5_0", port=1))
    hw.inject(FaultSpec(kind="reset_fail", gpu=0))
    reboot = executor(hw, allow_reboot=True, record=tmp_path / "last-reboot-command")
    result = reboot.execute(command("r1", RepairArgs(method="reboot")))
    assert (result.ok, result.message) == (True, "reboot started")
    assert hw.reboots_total == 1
    assert hw.active_faults() == []
    assert hw.collect_ib()[0].state == "ACTIVE"


def test_system_repair_runs_nvidia_smi_and_systemctl_as_argument_lists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[Any, dict[str, Any]]] = []

    def run(argv: Any, **kw: Any) -> subprocess.CompletedProcess[bytes]:
        calls.append((argv, kw))
        code = 3 if argv[0] == "systemctl" else 0
        return subprocess.CompletedProcess(argv, code, b"", b"Failed to reboot: Access denied")

    monkeypatch.setattr(subprocess, "run", run)
    repair = SystemRepair(gpu_count=lambda: 8, reset_timeout_s=60.0)
    repair.reset_gpu(6)
    with pytest.raises(RepairFailed, match="exit 3: Failed to reboot: Access denied"):
        repair.reboot()
    assert [argv for argv, _ in calls] == [
        ["nvidia-smi", "--gpu-reset", "-i", "6"],
        ["systemctl", "reboot"],
    ]
    assert all(kw["timeout"] == 60.0 and not kw.get("shell") for _, kw in calls)


def test_system_repair_without_nvidia_smi_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RepairFailed, match="nvidia-smi: not found"):
        SystemRepair(gpu_count=lambda: 1, reset_timeout_s=5.0).reset_gpu(0)


def test_a_resent_reboot_command_is_answered_done_not_rebooted_again(tmp_path: Path) -> None:
    record = tmp_path / "last-reboot-command"
    hw = sim()
    executor(hw, allow_reboot=True, record=record).execute(
        command("r1", RepairArgs(method="reboot"))
    )
    assert record.read_text() == "r1\n"
    # the agent that came back (a new executor, the same state dir) gets the command again
    again = executor(hw, allow_reboot=True, record=record, jobs=["late"])
    result = again.execute(command("r1", RepairArgs(method="reboot")))
    assert (result.ok, result.message) == (True, "rebooted: this command's reboot is done")
    assert hw.reboots_total == 1
    assert (
        executor(hw, allow_reboot=True, record=record)
        .execute(command("r2", RepairArgs(method="reboot")))
        .ok
    )
    assert hw.reboots_total == 2


def test_a_reboot_that_cannot_be_recorded_does_not_start() -> None:
    hw = sim()
    result = executor(hw, allow_reboot=True).execute(command("r1", RepairArgs(method="reboot")))
    assert not result.ok
    assert result.message.startswith("reboot refused: cannot record it in /nonexistent/")
    assert hw.reboots_total == 0
