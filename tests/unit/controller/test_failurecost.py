"""What failures cost (controller.failurecost) against a worked example, the `cost:` config,
and on the FakeClock sim: a job's and an incident's GPU-hours after a restart, on /metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from tests.builders import gpu
from tests.unit.controller.job_sim import Sim, running
from trainguard.controller.config import load_config
from trainguard.controller.failurecost import failure_cost, recovery_loss
from trainguard.strict import ConfigError


def test_worked_example_downtime_redone_steps_overhead_and_money() -> None:
    # 16 GPUs, one recovery of 10 minutes that redid 100 steps of 2 s; saves held 6 minutes
    cost = failure_cost(
        recoveries=[{"phases_s": {"restart": 120.0, "mttr": 600.0}, "lost_steps": 100}],
        gpus=16,
        step_time_s=2.0,
        checkpoint_block_s=360.0,
        gpu_hour_price=2.5,
    )
    assert cost.failures == 1
    assert cost.downtime_gpu_hours == pytest.approx(600 * 16 / 3600)  # 2.67
    assert cost.redone_gpu_hours == pytest.approx(100 * 2 * 16 / 3600)  # 0.89
    assert cost.lost_gpu_hours == pytest.approx(3.5556, abs=1e-4)
    assert cost.checkpoint_overhead_gpu_hours == pytest.approx(1.6)
    assert cost.lost_money == pytest.approx(3.5556 * 2.5, abs=1e-3)
    assert cost.checkpoint_overhead_money == pytest.approx(4.0)


def test_recoveries_without_phases_do_not_count_and_no_price_means_no_money() -> None:
    assert recovery_loss({"lost_steps": 5}) is None
    assert recovery_loss({"phases_s": {"restart": 30.0}}) == (30.0, 0)  # no mttr: the restart
    cost = failure_cost(
        recoveries=[{"lost_steps": 5}, {"phases_s": {"mttr": 36.0}, "lost_steps": 10}],
        gpus=100,
        step_time_s=None,
    )
    assert cost.failures == 1
    assert cost.lost_gpu_hours == pytest.approx(1.0)  # no step time: downtime only
    assert cost.lost_money is None and cost.checkpoint_overhead_gpu_hours is None


@pytest.mark.parametrize("value", ["0", "-1", ".inf", ".nan", "2000000", "cheap"])
def test_cost_gpu_hour_is_bounded(tmp_path: Path, value: str) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text(f"cost: {{gpu_hour: {value}}}")
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert info.value.key == "cost.gpu_hour"


def test_cost_gpu_hour_defaults_to_unset(tmp_path: Path) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text("cost: {gpu_hour: 2.5}")
    assert load_config(str(path)).cost.gpu_hour == 2.5
    path.write_text("{}")
    assert load_config(str(path)).cost.gpu_hour is None


def test_a_restart_costs_the_job_and_its_incident_gpu_hours(sim: Sim) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.agents["n1"].event(
        "checkpoint_committed", job="job", rank=0, data={"step": 2, "block_s": 36.0}
    )
    sim.second(3)
    before = sim.c.get_job("job").failure_cost
    assert before is not None and before.failures == 0 and before.lost_gpu_hours == 0
    gpus = before.gpus
    assert before.checkpoint_overhead_gpu_hours == pytest.approx(36.0 * gpus / 3600)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    sim.until(
        lambda: sim.incident("gpu_dbe").cost is not None, max_s=30, what="the restart confirmed"
    )
    incident = sim.incident("gpu_dbe").cost
    assert incident is not None and incident.failures == 1 and incident.lost_gpu_hours > 0
    assert incident.lost_money is None  # no cost.gpu_hour
    sim.second(61)  # past the advisor's cache
    after = sim.c.get_job("job").failure_cost
    assert after is not None and after.failures == 1
    assert after.lost_gpu_hours == pytest.approx(incident.lost_gpu_hours, rel=0.5)
    text = generate_latest(sim.c.metrics.registry).decode()
    assert 'trainguard_controller_job_lost_gpu_seconds{job="job"}' in text
    assert 'trainguard_controller_job_checkpoint_overhead_gpu_seconds{job="job"}' in text
    assert "trainguard_controller_job_lost_cost{" not in text
