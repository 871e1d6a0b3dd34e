"""The agent's hardware edge on a real GPU: the NVML collector, the PCI bus map the XID
parser needs, the preflight (NVML checks, the compute burn with its silent-data-corruption
check, the NCCL worker) and a running agent exporting a CUDA job's heartbeats.

GPU reset and node reboot are not run here: the GPU machines these checks run on must not
be reset (docs/hardware.md says how the repair path is tested)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_for
from trainguard.agent.collectors.nvml import NvmlGpuCollector
from trainguard.agent.preflight import PreflightRunner
from trainguard.agent.preflight_backends import ProcessBurner, WorkerRun, build_workers
from trainguard.clock import SYSTEM_CLOCK
from trainguard.command_args import PreflightArgs

pytestmark = pytest.mark.slow
OUT = Path(os.environ.get("TRAINGUARD_GPU_REPORT_DIR", "/tmp"))


def _smi(query: str) -> list[list[str]]:
    text = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [[c.strip() for c in line.split(",")] for line in text.strip().splitlines()]


def _record(name: str, value: object) -> None:
    with (OUT / "gpu-record.jsonl").open("a") as f:
        f.write(json.dumps({"what": name, "value": value}, default=str) + "\n")


def test_the_nvml_collector_reads_every_gpu_as_nvidia_smi_sees_it() -> None:
    coll = NvmlGpuCollector()
    try:
        got = coll.collect()
        smi = _smi("index,pci.bus_id,uuid,name,memory.total,temperature.gpu")
        _record("nvml_collection", got)
        _record("nvidia_smi", smi)
        assert len(got.gpus) == len(smi) >= 1
        for sample, row in zip(got.gpus, smi, strict=True):
            assert not sample.lost
            assert sample.index == int(row[0])
            # nvidia-smi prints an 8-digit domain ("00000000:18:00.0"); the collector's is 4
            assert sample.pci_bus_id == row[1].lower()[-12:]
            assert sample.uuid == row[2]
            assert sample.name == row[3]
            assert sample.memory_total_bytes == int(row[4]) * 1024**2
            assert sample.temperature_celsius is not None and 0 < sample.temperature_celsius < 120
            assert sample.power_watts is not None and sample.power_watts > 0
            assert sample.ecc_uncorrected_volatile_total is not None
            assert sample.remapped_rows_pending is not None
        # every read the collector makes either answered or is a NotSupported it remembers
        assert not [e for e in got.errors if "NotSupported" not in e], got.errors
        assert coll.bus_id_to_index() == {s.pci_bus_id: s.index for s in got.gpus}
    finally:
        coll.close()


def test_the_preflight_passes_on_a_healthy_gpu(tmp_path: Path) -> None:
    gpu = NvmlGpuCollector()
    burner, collective = build_workers(sim=None, run=WorkerRun(python=sys.executable))
    runner = PreflightRunner(
        gpu=gpu, burner=burner, collective=collective, clock=SYSTEM_CLOCK, expected_gpus=lambda: 1
    )
    try:
        outcome = runner.run(PreflightArgs(ckpt_dir=str(tmp_path), burn_s=3.0))
    finally:
        gpu.close()
    _record("preflight", outcome.to_wire(command_id="gpu-check"))
    assert outcome.passed, outcome.summary()
    burn = next(c for c in outcome.checks if c.name == "compute_burn")
    assert burn.value is not None and burn.value > 1.0  # TFLOP/s: far above any CPU


def test_the_compute_burn_catches_a_flipped_bit_on_the_gpu() -> None:
    burner = ProcessBurner(device="cuda", run=WorkerRun(python=sys.executable), corrupt=[0])
    results = burner.burn(gpus=[0], seconds=1.0)
    _record("burn_corrupt", [r.__dict__ for r in results])
    assert results[0].mismatches > 0 and not results[0].error


def test_the_nccl_worker_forms_a_group_on_the_gpu() -> None:
    spec = json.dumps({"device": "cuda", "world": 1, "seconds": 1.0})
    answer = (
        subprocess.run(
            [sys.executable, "-m", "trainguard.agent.allreduce", spec],
            capture_output=True,
            text=True,
            timeout=180,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    got = json.loads(answer)
    _record("allreduce_world1", got)
    assert got["backend"] == "nccl" and got["wrong"] == 0 and got["iterations"] >= 1


def _scrape(port: int) -> str:
    """The agent's /metrics, or "" while it does not answer yet."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return str(r.read().decode())
    except OSError:
        return ""


def test_an_agent_on_nvml_exports_the_gpu_and_a_cuda_jobs_heartbeats(tmp_path: Path) -> None:
    port = free_port()
    sock = tmp_path / "hb.sock"
    agent_cmd = [
        sys.executable, "-m", "trainguard.agent.main", "--gpu-backend", "nvml",
        "--node-name", "gpu-check", "--metrics-address", "127.0.0.1", "--metrics-port",
        str(port), "--heartbeat-socket", str(sock), "--jobs-dir", str(tmp_path / "jobs"),
        "--kmsg-path", "/dev/kmsg", "--controller", "", "--collect-interval-s", "0.5",
    ]  # fmt: skip
    job_cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
        str(Path(__file__).with_name("cuda_job.py")), "--ckpt-dir", str(tmp_path / "ckpt"),
        "--out", str(tmp_path / "job.txt"), "--steps", "60", "--pad-s", "0.2",
    ]  # fmt: skip

    def steady_heartbeats() -> dict[str, float]:
        """The rank's step, compute and step time once it is past its first steps (the first
        ones hold CUDA's and NCCL's start-up)."""
        got = {}
        for line in _scrape(port).splitlines():
            for name in ("step", "compute_time_seconds", "step_time_seconds"):
                if line.startswith(f"trainguard_trainer_{name}{{"):
                    got[name] = float(line.rsplit(" ", 1)[1])
        return got if len(got) == 3 and got["step"] >= 10 else {}

    log_path = tmp_path / "agent.log"
    with log_path.open("wb") as log:
        agent = subprocess.Popen(agent_cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(
            lambda: agent.poll() is None and sock.exists() and "trainguard_gpu" in _scrape(port),
            timeout_s=60,
            what="the agent's GPU metrics",
        )
        job = subprocess.Popen(job_cmd, env={**os.environ, "TRAINGUARD_AGENT_SOCKET": str(sock)})
        try:  # a rank's series go once it has exited: read them while it trains
            seen = wait_for(steady_heartbeats, timeout_s=180, what="the job's compute time")
            (OUT / "agent-metrics.txt").write_text(_scrape(port))
        finally:
            assert job.wait(timeout=240) == 0
        _record("heartbeat", seen)
        # CUDA-event time of the forward and backward: more than nothing, less than the step
        # (which also holds the optimizer step, the loss read and a 0.2 s pad)
        assert 0 < seen["compute_time_seconds"] < seen["step_time_seconds"]
        assert agent.poll() is None
    finally:
        agent.terminate()
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
        (OUT / "agent.log").write_bytes(log_path.read_bytes()[-20000:])
