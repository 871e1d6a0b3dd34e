"""A real agent whose NVML hangs (sim fault nvml_hang) keeps serving /metrics, collecting IB
and XIDs and reporting to a real controller; the GPU source shows stale (metric, report, the
agent_source_stale incident) and recovers once the hang ends."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.agent_proc import AgentProcess, sample_value
from tests.integration.controller_proc import AGENT_TOKEN, OP, start_controller, write_config

pytestmark = pytest.mark.slow

RULES = """
rules:
  - name: agent_source_stale
    scope: node
    condition: agent_sources_stale > 0
    for: 0s
    severity: warning
    actions: [notify]
    summary: agent collection source stale
"""


def _metric(agent: AgentProcess, name: str, **labels: str) -> float | None:
    return sample_value(agent.metrics(), name, **labels)


def test_hung_nvml_stales_the_gpu_source_only_and_it_recovers(short_tmp: Path) -> None:
    ctl_dir = short_tmp / "ctl"
    ctl_dir.mkdir()
    controller = start_controller(
        write_config(ctl_dir, rules=RULES, tick_interval_s=0.2), log_path=ctl_dir / "log"
    )
    agent_dir = short_tmp / "agent"
    agent_dir.mkdir()
    token = agent_dir / "token"
    token.write_text(AGENT_TOKEN + "\n")
    token.chmod(0o600)
    config = agent_dir / "agent.yaml"
    config.write_text("collectors:\n  gpu:\n    deadline_s: 1.0\n")
    agent = AgentProcess(
        agent_dir, "--config", str(config), "--controller", controller.url,
        "--token-file", str(token), "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
    )  # fmt: skip
    try:

        def node() -> dict[str, object] | None:
            r = httpx.get(f"{controller.url}/v1/nodes/node-1", headers=OP, timeout=5)
            return r.json() if r.status_code == 200 else None

        wait_for(node, timeout_s=30, what="the agent's first report")
        assert _metric(agent, "trainguard_agent_source_stale", source="gpu") == 0

        assert agent.inject("nvml_hang").returncode == 0
        wait_for(
            lambda: _metric(agent, "trainguard_agent_source_stale", source="gpu") == 1,
            timeout_s=30,
            what="the GPU source to show stale",
        )
        body = agent.metrics()  # /metrics answers while NVML hangs
        assert sample_value(body, "trainguard_agent_source_stale", source="ib") == 0
        assert sample_value(body, "trainguard_agent_source_stale", source="xid") == 0
        # the last GPU values stay, marked stale by the metric above
        assert sample_value(body, "trainguard_gpu_temperature_celsius", gpu="0") is not None
        gpu_success = sample_value(
            body, "trainguard_agent_source_last_success_timestamp_seconds", source="gpu"
        )
        ib_data = sample_value(
            body, "trainguard_ib_port_data_bytes_total", device="mlx5_0", direction="transmit"
        )
        loops = sample_value(body, "trainguard_agent_loop_iterations_total")
        reported_at = node()["last_report_at"]  # type: ignore[index]
        assert ib_data is not None and loops is not None and gpu_success is not None

        # while NVML stays hung: IB keeps counting, XIDs keep arriving, the loop and reports go on
        assert agent.inject("xid", "--gpu", "2", "--code", "79").returncode == 0
        wait_for(
            lambda: _metric(agent, "trainguard_gpu_xid_errors_total", gpu="2", xid="79") == 1,
            timeout_s=30,
            what="the XID counted while NVML hangs",
        )
        wait_for(
            lambda: (
                (
                    _metric(
                        agent,
                        "trainguard_ib_port_data_bytes_total",
                        device="mlx5_0",
                        direction="transmit",
                    )
                    or 0
                )
                > ib_data
            ),
            timeout_s=30,
            what="IB counters to keep updating",
        )
        wait_for(
            lambda: (_metric(agent, "trainguard_agent_loop_iterations_total") or 0) > loops + 5,
            timeout_s=30,
            what="the collect loop to keep ticking",
        )
        wait_for(
            lambda: node()["last_report_at"] > reported_at,  # type: ignore[index,operator]
            timeout_s=30,
            what="reports to keep reaching the controller",
        )
        incident = wait_for(
            lambda: [
                i
                for i in httpx.get(f"{controller.url}/v1/incidents", headers=OP, timeout=5).json()
                if i["rule"] == "agent_source_stale"
            ],
            timeout_s=30,
            what="the agent_source_stale incident",
        )
        assert [i["node"] for i in incident] == ["node-1"]
        assert _metric(agent, "trainguard_agent_events_total", kind="source_stale") == 1
        assert (
            _metric(agent, "trainguard_agent_source_last_success_timestamp_seconds", source="gpu")
            == gpu_success
        )

        assert agent.inject("clear").returncode == 0
        wait_for(
            lambda: _metric(agent, "trainguard_agent_source_stale", source="gpu") == 0,
            timeout_s=30,
            what="the GPU source to recover after the hang",
        )
        assert (
            _metric(agent, "trainguard_agent_source_last_success_timestamp_seconds", source="gpu")
            or 0
        ) > gpu_success
        assert _metric(agent, "trainguard_agent_events_total", kind="source_recovered") == 1
        wait_for(
            lambda: _metric(agent, "trainguard_agent_spool_events") == 0,
            timeout_s=30,
            what="the stale and recovered events to reach the controller",
        )
        assert "event=source_stale source=gpu" in agent.log()
        assert "event=source_recovered source=gpu" in agent.log()
    finally:
        assert agent.terminate() == 0
        assert controller.terminate() == 0


def test_agent_stops_cleanly_while_nvml_hangs(short_tmp: Path) -> None:
    agent = AgentProcess(short_tmp, "--collect-interval-s", "0.2")
    try:
        assert agent.inject("nvml_hang").returncode == 0
        wait_for(
            lambda: _metric(agent, "trainguard_agent_source_stale", source="gpu") == 1,
            timeout_s=30,
            what="the GPU source to show stale",
        )
    finally:
        assert agent.terminate(timeout_s=10) == 0
    assert "event=source_abandoned source=gpu" in agent.log()
    assert "event=agent_stopped" in agent.log()
