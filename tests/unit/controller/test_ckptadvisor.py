"""Each job's checkpoint interval advice on the FakeClock sim (controller.ckptadvisor): the
checkpoint cost from the ranks' commit events (the slowest rank per step, `block_s` before
`duration_s`), the node MTBF from the cluster's hardware incidents with its prior, the restart
time from the job's recoveries; in the job view, on the REST view and on /metrics."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from tests.builders import gpu
from tests.unit.controller.job_sim import Sim, running
from tests.unit.controller.test_lemons import _past_incident

_PRIOR_S = 8000 * 3600.0


def _commit(sim: Sim, node: str, *, rank: int, step: int, **data: float) -> None:
    sim.agents[node].event(
        "checkpoint_committed", job="job", rank=rank, data={"step": step, **data}
    )


def test_no_advice_before_a_checkpoint_committed(sim: Sim) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    assert sim.c.get_job("job").checkpoint_interval is None


def test_the_advice_comes_from_measured_costs_and_the_prior(sim: Sim) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    # two steps; per step the slowest rank counts; block_s is the cost, duration_s the fallback
    _commit(sim, "n1", rank=0, step=10, block_s=2.0, duration_s=40.0)
    _commit(sim, "n2", rank=1, step=10, block_s=4.0, duration_s=40.0)
    _commit(sim, "n1", rank=0, step=20, duration_s=6.0)
    sim.second(2)
    advice = sim.c.get_job("job").checkpoint_interval
    assert advice is not None
    assert advice.checkpoint_s == 5.0  # mean of 4 (step 10) and 6 (step 20)
    # no hardware history: the prior node MTBF (the few seconds watched barely count)
    assert advice.node_mtbf_s / _PRIOR_S == pytest.approx(1.0, rel=1e-3)
    assert advice.mtbf_s == advice.node_mtbf_s / 2  # two nodes
    assert advice.restart_s == 600.0  # no restart measured: the prior
    assert advice.step_time_s == 0.5 and advice.optimal_every_steps is not None
    text = generate_latest(sim.c.metrics.registry).decode()
    assert 'trainguard_controller_job_checkpoint_cost_seconds{job="job"} 5.0' in text
    assert 'trainguard_controller_job_checkpoint_interval_optimal_seconds{job="job"}' in text
    assert 'trainguard_controller_job_checkpoint_waste_optimal_ratio{job="job"}' in text
    assert 'trainguard_controller_job_mtbf_seconds{job="job"}' in text
    # the fake ranks report no periodic interval: no current series
    assert "trainguard_controller_job_checkpoint_interval_seconds{" not in text


def test_hardware_incidents_lower_the_mtbf_and_a_restart_sets_the_restart_time(sim: Sim) -> None:
    for days in (1, 2, 3):  # on nodes since gone (three of them: none is a lemon)
        _past_incident(sim, f"old{days}", days_ago=days)
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    _commit(sim, "n1", rank=0, step=10, block_s=3.0)
    sim.second()
    before = sim.c.get_job("job").checkpoint_interval
    assert before is not None
    # three incidents against the prior's weight of three: half the prior
    assert before.node_mtbf_s / (_PRIOR_S / 2) == pytest.approx(1.0, rel=1e-3)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    sim.second(61)  # past the advisor's cache
    after = sim.c.get_job("job").checkpoint_interval
    assert after is not None
    assert after.node_mtbf_s < before.node_mtbf_s  # the dbe is a fourth hardware incident
    assert 0 < after.restart_s < 600.0  # measured: the sim restarts in seconds
