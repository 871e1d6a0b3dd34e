"""The trainer library's CUDA paths on a real GPU: snapshots into pinned host buffers, the
CUDA RNG in a checkpoint, compute time from CUDA events, and FSDP2 on a CUDA device mesh
(NCCL) resumed bitwise after a kill -9."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from trainguard.trainer.compute_timer import ComputeTimer
from trainguard.trainer.state import SnapshotPool, capture_rng, restore_rng

JOB = Path(__file__).with_name("cuda_job.py")

pytestmark = pytest.mark.slow


def test_a_snapshot_of_cuda_state_lands_in_pinned_host_buffers_with_the_same_values() -> None:
    state: dict[str, Any] = {
        "model": {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.arange(7.0).cuda()},
        "opt": [torch.randn(33, device="cuda", dtype=torch.bfloat16)],
        "step": 3,
    }
    pool = SnapshotPool()
    try:
        for _ in range(2):  # the second snapshot reuses the first one's buffers
            snap = pool.snapshot(state)
            for got, want in (
                (snap["model"]["w"], state["model"]["w"]),
                (snap["model"]["b"], state["model"]["b"]),
                (snap["opt"][0], state["opt"][0]),
            ):
                assert got.device.type == "cpu"
                assert got.is_pinned()
                assert got.dtype == want.dtype
                assert torch.equal(got, want.cpu())
            assert snap["step"] == 3
            state["model"]["w"].add_(1.0)
        assert pool.allocated_bytes == 0  # the second snapshot allocated nothing
    finally:
        pool.close()


def test_the_cuda_rng_is_captured_and_restored() -> None:
    torch.cuda.manual_seed_all(123)
    torch.rand(4, device="cuda")
    rng = capture_rng()
    assert len(rng["cuda"]) == torch.cuda.device_count()
    want = torch.rand(16, device="cuda")
    torch.rand(1000, device="cuda")  # move the generator on
    restore_rng(rng)
    assert torch.equal(torch.rand(16, device="cuda"), want)


def test_compute_time_is_measured_with_cuda_events_without_a_host_sync() -> None:
    model = torch.nn.Linear(2048, 2048).cuda()
    timer = ComputeTimer(model=model)
    x = torch.randn(2048, 2048, device="cuda")
    took: list[float] = []
    for step in range(1, 40):
        with timer.measure(step=step):
            for _ in range(20):
                x = torch.tanh(model(x))
        got = timer.take()
        if got is not None:
            took.append(got)
    torch.cuda.synchronize()
    with timer.measure(step=40):
        model(x)
    torch.cuda.synchronize()
    last = timer.take()
    assert last is not None and last > 0
    assert took, "no step's events completed while the loop ran"
    assert all(t > 0 for t in took)
    assert timer._cuda is True


def _run(ckpt: Path, out: Path, *, mode: str, die_at: int = 0) -> int:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRAINGUARD_AGENT_SOCKET": ""}
    if os.environ.get("TRAINGUARD_GPU_AGENT_SOCKET"):
        env["TRAINGUARD_AGENT_SOCKET"] = os.environ["TRAINGUARD_GPU_AGENT_SOCKET"]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        str(JOB), "--ckpt-dir", str(ckpt), "--out", str(out), "--mode", mode,
        "--die-at", str(die_at),
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, timeout=240, check=False).returncode


def _losses(path: Path) -> tuple[list[int], dict[int, str]]:
    resumes: list[int] = []
    losses: dict[int, str] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if parts[0] == "resume":
            resumes.append(int(parts[1]))
        elif parts[0] == "step":
            losses[int(parts[1])] = parts[2]
    return resumes, losses


@pytest.mark.parametrize("mode", ["fsdp2", "plain"])
def test_a_cuda_job_killed_9_resumes_bitwise_from_its_checkpoint(tmp_path: Path, mode: str) -> None:
    ref_out = tmp_path / "ref.txt"
    assert _run(tmp_path / "ref-ckpt", ref_out, mode=mode) == 0
    _, ref = _losses(ref_out)
    assert sorted(ref) == list(range(1, 25))

    out = tmp_path / "run.txt"
    assert _run(tmp_path / "ckpt", out, mode=mode, die_at=13) != 0  # SIGKILLed
    assert _run(tmp_path / "ckpt", out, mode=mode) == 0
    resumes, got = _losses(out)
    assert resumes[0] == 1
    assert resumes[1] == 11  # the checkpoint of step 10 (every 5), committed before the kill
    for step in range(resumes[1], 25):
        assert got[step] == ref[step], f"step {step}: {got[step]} != {ref[step]}"
