"""A real `trainguard-agent` process (sim backend, export-only): /metrics, promtool, local
fault injection, trainer heartbeats, clean shutdown."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.agent_proc import AgentProcess, cleanup, sample_value, short_tmpdir
from trainguard.protocol import Heartbeat, encode_json

pytestmark = pytest.mark.slow


@pytest.fixture
def agent() -> Iterator[AgentProcess]:
    workdir = short_tmpdir()
    proc = AgentProcess(workdir)
    yield proc
    proc.kill()
    cleanup(workdir)


def test_quickstart_exports_every_hardware_family_and_passes_promtool(
    agent: AgentProcess,
) -> None:
    body = agent.metrics()
    for gpu in range(8):
        g = str(gpu)
        assert sample_value(body, "trainguard_gpu_temperature_celsius", gpu=g) is not None
        assert sample_value(body, "trainguard_nvlink_up", gpu=g, link="17") == 1
        ecc = {"type": "uncorrected", "scope": "volatile"}
        assert sample_value(body, "trainguard_gpu_ecc_errors_total", gpu=g, **ecc) == 0
    for port in range(8):
        assert sample_value(body, "trainguard_ib_port_up", device=f"mlx5_{port}", port="1") == 1
        assert sample_value(body, "trainguard_ib_port_data_bytes_total", device=f"mlx5_{port}")
    assert "# TYPE trainguard_gpu_xid_errors_total counter" in body
    assert sample_value(body, "trainguard_agent_info", node="node-1") == 1
    assert httpx.get(f"{agent.url}/healthz", timeout=5).text.strip() == "ok"

    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is required in CI (Debian package 'prometheus')")
        pytest.skip("promtool not installed")
    check = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr


def test_inject_subcommand_makes_the_fault_visible_on_metrics(agent: AgentProcess) -> None:
    done = agent.inject("dbe", "--gpu", "2")
    assert done.returncode == 0, done.stderr
    # one human line; -o json gives the agent's answer
    assert done.stdout == "fault dbe injected gpu=2\n"
    wait_for(
        lambda: (
            sample_value(agent.metrics(), "trainguard_gpu_xid_errors_total", gpu="2", xid="48") == 1
        ),
        timeout_s=30,
        what="XID 48 on gpu 2",
    )
    body = agent.metrics()
    assert (
        sample_value(
            body, "trainguard_gpu_ecc_errors_total", gpu="2", type="uncorrected", scope="volatile"
        )
        == 1
    )
    assert sample_value(body, "trainguard_gpu_remap_pending", gpu="2") == 1
    assert sample_value(body, "trainguard_gpu_remap_pending", gpu="1") == 0
    assert "event=fault_injected kind=dbe gpu=2" in agent.log()

    done = agent.inject("ib_down", "--device", "mlx5_3", "-o", "json")
    assert done.returncode == 0 and json.loads(done.stdout)["fault"] == "ib_down", done.stdout
    wait_for(
        lambda: sample_value(agent.metrics(), "trainguard_ib_port_up", device="mlx5_3") == 0,
        timeout_s=30,
        what="mlx5_3 down",
    )


def test_inject_of_missing_hardware_fails_with_the_agents_reason(agent: AgentProcess) -> None:
    done = agent.inject("dbe", "--gpu", "9")
    assert done.returncode == 1
    assert "400" in done.stderr and "gpu: no GPU 9" in done.stderr


def test_fault_endpoint_rejects_bad_bodies_clearly(agent: AgentProcess) -> None:
    r = httpx.post(f"{agent.url}/v1/faults", json={"kind": "meltdown"}, timeout=5)
    assert r.status_code == 400 and r.json()["detail"].startswith("kind:")
    r = httpx.post(f"{agent.url}/v1/faults", content=b"{", timeout=5)
    assert r.status_code == 400 and "invalid JSON" in r.json()["detail"]


def test_trainer_heartbeats_become_metrics_and_shutdown_removes_the_socket(
    agent: AgentProcess,
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        for rank in range(2):
            hb = Heartbeat(
                job="job-a",
                rank=rank,
                step=100 + rank,
                t=0.0,
                loss=1.5,
                ckpt_step=90,
                ckpt_failures=2 * rank,
                ckpt_age_s=125.0,
                ckpt_interval_s=40.0,
                # rank 0 alone copies to the second region
                ckpt_replica_step=80 if rank == 0 else None,
                ckpt_replica_lag_s=30.0 if rank == 0 else None,
            )
            s.sendto(encode_json(hb), str(agent.socket_path))
        s.sendto(b"garbage", str(agent.socket_path))
    wait_for(
        lambda: (
            sample_value(agent.metrics(), "trainguard_trainer_step", job="job-a", rank="1") == 101
        ),
        timeout_s=30,
        what="rank 1 step on /metrics",
    )
    body = agent.metrics()
    assert sample_value(body, "trainguard_trainer_checkpoint_step", job="job-a", rank="0") == 90
    assert sample_value(body, "trainguard_trainer_heartbeat_age_seconds", rank="0") is not None
    # checkpoint health, as the ranks report it
    assert sample_value(body, "trainguard_trainer_checkpoint_failures", rank="1") == 2
    assert sample_value(body, "trainguard_trainer_checkpoint_age_seconds", rank="0") == 125.0
    assert sample_value(body, "trainguard_trainer_checkpoint_interval_seconds", rank="0") == 40.0
    assert sample_value(body, "trainguard_trainer_checkpoint_replica_step", rank="0") == 80
    assert sample_value(body, "trainguard_trainer_checkpoint_replica_lag_seconds", rank="0") == 30
    assert sample_value(body, "trainguard_trainer_checkpoint_replica_step", rank="1") is None
    assert sample_value(body, "trainguard_agent_heartbeats_received_total") == 2
    assert sample_value(body, "trainguard_agent_heartbeats_dropped_total", reason="malformed") == 1

    assert agent.terminate() == 0
    assert not Path(agent.socket_path).exists()
    assert "event=agent_stopped" in agent.log()


def test_each_xid_line_of_the_kernel_log_is_exported_under_its_own_severity() -> None:
    workdir = short_tmpdir()
    kmsg = workdir / "kmsg"
    kmsg.write_text("")
    config = workdir / "agent.yaml"
    config.write_text(f"hardware:\n  sim_kmsg_path: {kmsg}\n")
    agent = AgentProcess(workdir, "--config", str(config))
    try:
        with kmsg.open("a") as f:  # sim GPU 1 sits at 0000:2a:00.0; priority 4: the kernel's
            f.write(
                "4,1,10,-;NVRM: Xid (PCI:0000:2a:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 00\n"
                "4,2,11,-;NVRM: Xid (PCI:0000:2a:00): 145, RLW_REMAP Fatal XC0 i0 Link 01\n"
                "4,3,12,-;NVRM: Xid (PCI:0000:2a:00): 999, pid=1, a code nobody classified\n"
                "12,4,13,-;NVRM: Xid (PCI:0000:2a:00): 79, pid=1, written by a user process\n"
            )
        xid = "trainguard_gpu_xid_errors_total"
        wait_for(
            lambda: sample_value(agent.metrics(), xid, gpu="1", xid="999") is not None,
            timeout_s=30,
            what="the kernel log's XIDs on /metrics",
        )
        body = agent.metrics()
        assert sample_value(body, xid, gpu="1", xid="145", severity="informational") == 1
        assert sample_value(body, xid, gpu="1", xid="145", severity="fatal") == 1
        assert sample_value(body, xid, gpu="1", xid="999", severity="unknown") == 1
        assert sample_value(body, xid, xid="79") is None  # forged: never an XID
        assert sample_value(body, "trainguard_agent_kmsg_non_kernel_records_total") == 1
    finally:
        agent.kill()
        cleanup(workdir)
