"""The optimal checkpoint interval's arithmetic (controller.ckptinterval) against worked
examples: Young's sqrt(2 C M), Daly's refinement, the expected waste it minimises, the node
MTBF with its prior, and the `economics:` config that feeds them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from trainguard.controller.ckptinterval import (
    advise,
    daly_interval_s,
    expected_waste,
    job_mtbf_s,
    node_mtbf_s,
    young_interval_s,
)
from trainguard.controller.config import load_config
from trainguard.strict import ConfigError

_H = 3600.0


def test_young_worked_example_12h_mtbf_5min_checkpoint_gives_about_1_4_hours() -> None:
    t = young_interval_s(checkpoint_s=300, mtbf_s=12 * _H)
    assert t == pytest.approx(math.sqrt(2 * 300 * 43200))
    assert t == pytest.approx(5091.17, abs=0.01)
    assert t / _H == pytest.approx(1.41, abs=0.01)


def test_daly_worked_example_and_its_limits() -> None:
    assert daly_interval_s(checkpoint_s=300, mtbf_s=12 * _H) == pytest.approx(4893.13, abs=0.01)
    # a cheap checkpoint against a long MTBF: Daly comes to Young (less C)
    young = young_interval_s(checkpoint_s=1, mtbf_s=1e6)
    assert daly_interval_s(checkpoint_s=1, mtbf_s=1e6) == pytest.approx(young - 1, rel=1e-3)
    # a checkpoint costing two MTBFs or more: once per failure
    assert daly_interval_s(checkpoint_s=200, mtbf_s=100) == 100
    assert daly_interval_s(checkpoint_s=500, mtbf_s=100) == 100


def test_expected_waste_counts_checkpoints_redone_work_and_restarts() -> None:
    # C/T + (T/2 + R)/M = 300/3600 + (1800 + 600)/43200
    waste = expected_waste(interval_s=3600, checkpoint_s=300, restart_s=600, mtbf_s=43200)
    assert waste == pytest.approx(300 / 3600 + 2400 / 43200)
    # Young's interval is the minimum of this model
    best = young_interval_s(checkpoint_s=300, mtbf_s=43200)
    at_best = expected_waste(interval_s=best, checkpoint_s=300, restart_s=600, mtbf_s=43200)
    for factor in (0.5, 0.9, 1.1, 2.0):
        other = expected_waste(
            interval_s=best * factor, checkpoint_s=300, restart_s=600, mtbf_s=43200
        )
        assert other > at_best
    # beyond all progress it is capped at the whole wall time
    assert expected_waste(interval_s=10, checkpoint_s=300, restart_s=0, mtbf_s=100) == 1.0


def test_node_mtbf_is_the_prior_without_history_and_the_cluster_rate_with_much() -> None:
    prior = 8000 * _H
    assert node_mtbf_s(
        incidents=0, exposure_s=0, prior_mtbf_s=prior, prior_incidents=3
    ) == pytest.approx(prior)
    # 3 incidents in no time weigh as much as the prior: half of it
    assert node_mtbf_s(
        incidents=3, exposure_s=0, prior_mtbf_s=prior, prior_incidents=3
    ) == pytest.approx(prior / 2)
    # 1000 incidents over 1000 * 100 h of node time: the cluster's 100 h, barely moved
    many = node_mtbf_s(
        incidents=1000, exposure_s=1000 * 100 * _H, prior_mtbf_s=prior, prior_incidents=3
    )
    assert many / _H == pytest.approx(100, rel=0.25)
    assert job_mtbf_s(node_mtbf_s=96 * _H, nodes=8) == 12 * _H


def test_advice_for_a_job_in_seconds_and_steps() -> None:
    # 8 nodes at 96 h each: the job's 12 h; 5-minute checkpoints; 1800 s now at 2 s a step
    a = advise(
        checkpoint_s=300,
        restart_s=600,
        node_mtbf_s=96 * _H,
        nodes=8,
        current_s=1800,
        step_time_s=2.0,
    )
    assert a.mtbf_s == 12 * _H
    assert a.young_s == pytest.approx(5091.17, abs=0.01)
    assert a.optimal_s == pytest.approx(4893.13, abs=0.01)
    assert (a.optimal_every_steps, a.current_every_steps) == (2447, 900)
    assert a.current_waste is not None and a.current_waste > a.optimal_waste
    assert a.optimal_waste == pytest.approx(300 / a.optimal_s + (a.optimal_s / 2 + 600) / 43200)
    # no periodic checkpoints and no step time: the optimum alone
    bare = advise(checkpoint_s=0.0, restart_s=0, node_mtbf_s=1e6, nodes=1)
    assert bare.current_waste is None and bare.optimal_every_steps is None
    assert bare.optimal_s > 0  # a cost too small to measure still gives a finite interval


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"checkpoint_s": -1, "mtbf_s": 10}, "checkpoint_s"),
        ({"checkpoint_s": 1, "mtbf_s": 0}, "mtbf_s"),
        ({"checkpoint_s": math.nan, "mtbf_s": 10}, "checkpoint_s"),
        ({"checkpoint_s": 1, "mtbf_s": math.inf}, "mtbf_s"),
    ],
    ids=["negative-cost", "zero-mtbf", "nan-cost", "infinite-mtbf"],
)
def test_inputs_out_of_range_are_refused_naming_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        young_interval_s(**kwargs)
    with pytest.raises(ValueError, match=field):
        daly_interval_s(**kwargs)


def test_economics_config_defaults_and_bounds(tmp_path: Path) -> None:
    path = tmp_path / "controller.yaml"
    path.write_text("{}")
    cfg = load_config(str(path)).economics
    assert cfg.node_mtbf_prior_s == 8000 * _H and cfg.node_mtbf_prior_incidents == 3.0
    assert cfg.mtbf_window_s == 30 * 86400 and cfg.restart_prior_s == 600
    for text, key in (
        ("economics: {node_mtbf_prior_s: 0}", "economics.node_mtbf_prior_s"),
        ("economics: {node_mtbf_prior_s: .inf}", "economics.node_mtbf_prior_s"),
        ("economics: {node_mtbf_prior_incidents: 0}", "economics.node_mtbf_prior_incidents"),
        ("economics: {mtbf_window_s: -1}", "economics.mtbf_window_s"),
        ("economics: {restart_prior_s: -5}", "economics.restart_prior_s"),
        ("economics: {restart_prior_s: .nan}", "economics.restart_prior_s"),
        ("economics: {mtbf_windw_s: 5}", "economics.mtbf_windw_s"),
    ):
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(str(path))
        assert info.value.key == key, text
