"""Metric families from a snapshot: names, labels, absent fields, units, promtool-clean."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from trainguard.agent.metrics import AgentSnapshot, SnapshotCollector, render, xid_labels
from trainguard.agent.sim import SimHardware
from trainguard.clock import FakeClock
from trainguard.model import GpuSample, IbPortSample
from trainguard.protocol import FaultSpec, RankState
from trainguard.xid_catalog import XidCatalog

ALLOWED_LABELS = {
    "node", "gpu", "uuid", "link", "device", "port", "job", "rank",
    "reason", "collector", "xid", "state", "counter", "type", "scope", "kind", "cause",
    "direction", "result", "version", "severity",
}  # fmt: skip


def sim_snapshot() -> AgentSnapshot:
    clock = FakeClock()
    sim = SimHardware(gpus=2, ib_ports=2, node_name="node-1", seed=0, clock=clock)
    sim.inject(FaultSpec(kind="thermal", gpu=1))
    clock.advance(1.0)
    return AgentSnapshot(
        node="node-1",
        version="0.1.0",
        gpus=sim.collect().gpus,
        ib_ports=sim.collect_ib(),
        ranks=(RankState(job="job-a", rank=0, step=5, loss=float("nan"), heartbeat_age_s=1.5),),
        xid_total={(1, "48", "fatal"): 2},
        collect_duration_s={"gpu": 0.01},
        collect_errors_total={"gpu": 0},
        reports_total={"ok": 3, "error": 1, "rejected": 0},
        heartbeats_dropped_total={"malformed": 2, "sender_not_allowed": 3},
        heartbeat_senders_refused_total={"other_job": 1, "owned_by_another_sender": 2},
    )


def text(snap: AgentSnapshot) -> str:
    return render(SnapshotCollector(lambda: snap)).decode()


def sample(body: str, name: str, **labels: str) -> float:
    for line in body.splitlines():
        m = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise AssertionError(f"no sample {name}{labels}")


def test_gpu_nvlink_ib_trainer_and_agent_families_are_exported() -> None:
    body = text(sim_snapshot())
    assert sample(body, "trainguard_gpu_throttle_active", gpu="1", reason="hw_thermal") == 1.0
    assert sample(body, "trainguard_gpu_throttle_active", gpu="0", reason="hw_thermal") == 0.0
    assert sample(body, "trainguard_gpu_sm_clock_hertz", gpu="1") == 900e6
    assert sample(body, "trainguard_gpu_memory_total_bytes", gpu="0") == 80 * 1024**3
    assert 0 < sample(body, "trainguard_gpu_utilization_ratio", gpu="0") <= 1
    assert (
        sample(
            body, "trainguard_gpu_ecc_errors_total", gpu="0", type="uncorrected", scope="volatile"
        )
        == 0
    )
    assert sample(body, "trainguard_gpu_xid_errors_total", gpu="1", xid="48") == 2
    assert sample(body, "trainguard_nvlink_up", gpu="0", link="17") == 1
    assert sample(body, "trainguard_nvlink_errors_total", gpu="0", link="3", type="replay") == 0
    assert sample(body, "trainguard_ib_port_up", device="mlx5_1", port="1") == 1
    assert sample(body, "trainguard_ib_port_rate_bytes_per_second", device="mlx5_0") == 50e9
    assert (
        sample(body, "trainguard_ib_port_errors_total", device="mlx5_0", counter="link_downed") == 0
    )
    assert sample(body, "trainguard_trainer_step", job="job-a", rank="0") == 5
    assert sample(body, "trainguard_trainer_heartbeat_age_seconds", job="job-a", rank="0") == 1.5
    assert sample(body, "trainguard_agent_reports_total", result="error") == 1
    assert sample(body, "trainguard_agent_heartbeats_dropped_total", reason="malformed") == 2
    refused = "trainguard_agent_heartbeat_senders_refused_total"
    assert sample(body, refused, reason="owned_by_another_sender") == 2
    assert sample(body, refused, reason="other_job") == 1
    assert sample(body, "trainguard_agent_info", version="0.1.0") == 1
    assert "trainguard_trainer_loss{" in body and "NaN" in body


def test_ib_data_counters_are_exported_in_bytes() -> None:
    port = IbPortSample(
        device="mlx5_0", port=1, counters={"port_xmit_data": 10, "port_rcv_data": 3}
    )
    body = text(AgentSnapshot(node="n", version="v", ib_ports=(port,)))
    assert sample(body, "trainguard_ib_port_data_bytes_total", direction="transmit") == 40
    assert sample(body, "trainguard_ib_port_data_bytes_total", direction="receive") == 12


def test_absent_fields_produce_no_sample_not_zero() -> None:
    bare = GpuSample(index=0, uuid="GPU-x", pci_bus_id="0000:18:00.0", name="H100")
    body = text(AgentSnapshot(node="n", version="v", gpus=(bare,)))
    assert sample(body, "trainguard_gpu_lost", gpu="0") == 0
    for name in (
        "trainguard_gpu_temperature_celsius{",
        "trainguard_gpu_power_watts{",
        "trainguard_gpu_ecc_errors_total{",
        "trainguard_gpu_throttle_active{",
        "trainguard_gpu_retired_pages{",
    ):
        assert name not in body


def test_labels_come_only_from_the_bounded_set() -> None:
    body = text(sim_snapshot())
    names = set(re.findall(r'[{,](\w+)="', body))
    assert names <= ALLOWED_LABELS, names - ALLOWED_LABELS


def test_every_family_follows_the_naming_convention() -> None:
    body = text(sim_snapshot())
    types = dict(re.findall(r"^# TYPE (\w+) (\w+)$", body, re.M))
    assert types
    for name, kind in types.items():
        assert name.startswith("trainguard_"), name
        assert kind in ("counter", "gauge"), name
        assert name.endswith("_total") == (kind == "counter"), name
    sample_names = set(re.findall(r"^(\w+)\{", body, re.M))
    assert sample_names <= set(types), sample_names - set(types)


def test_no_snapshot_yet_renders_empty() -> None:
    assert render(SnapshotCollector(lambda: None)) == b""


def test_exposition_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is required in CI (Debian package 'prometheus')")
        pytest.skip("promtool not installed")
    proc = subprocess.run(
        [promtool, "check", "metrics"], check=False, input=render(SnapshotCollector(sim_snapshot)),
        capture_output=True, timeout=30,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert proc.stdout.decode().strip() == "" and proc.stderr.decode().strip() == ""


@pytest.mark.parametrize(
    ("code", "message", "labels"),
    [
        pytest.param(145, "RLW_REMAP Nonfatal XC0 i0 Link 00 (0x4 0x1)", ("145", "informational")),
        pytest.param(145, "RLW_REMAP Fatal XC0 i0 Link 00", ("145", "fatal"), id="145-fatal"),
        pytest.param(
            154,
            "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
            ("154", "fatal"),
            id="154-reboot",
        ),
        pytest.param(13, "Graphics SM Warp Exception", ("13", "application"), id="catalog"),
        pytest.param(999, "", ("999", "unknown"), id="not-in-catalog"),
        pytest.param(1024, "", ("other", "unknown"), id="beyond-max"),
        pytest.param(10**12, "", ("other", "unknown"), id="garbage"),
        pytest.param(0, "", ("other", "unknown"), id="zero"),
    ],
)
def test_xid_labels_are_the_lines_severity_and_bounded(
    code: int, message: str, labels: tuple[str, str]
) -> None:
    assert xid_labels(XidCatalog.load(), code, message) == labels


def test_xid_counter_has_one_series_per_severity_and_the_refused_kmsg_records() -> None:
    snap = AgentSnapshot(
        node="n",
        version="v",
        xid_total={
            (0, "145", "informational"): 3,
            (0, "145", "fatal"): 1,
            (1, "999", "unknown"): 1,
        },
        kmsg_non_kernel_records_total=4,
    )
    body = text(snap)
    xid = "trainguard_gpu_xid_errors_total"
    assert sample(body, xid, gpu="0", xid="145", severity="informational") == 3
    assert sample(body, xid, gpu="0", xid="145", severity="fatal") == 1
    assert sample(body, xid, gpu="1", xid="999", severity="unknown") == 1
    assert sample(body, "trainguard_agent_kmsg_non_kernel_records_total", node="n") == 4
