"""The rule cost model at load: the shipped rules fit the default budget with room, a costly
rule (or set) is refused naming the rule, its cost and the budget, the same way at start,
on reload and by `agentctl rules check`."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from trainguard.controller.cli import main as agentctl
from trainguard.controller.config import ControllerConfig
from trainguard.controller.errors import BadRequest
from trainguard.controller.rules.cost import CostLimits, check_costs, limits_of, rule_cost
from trainguard.controller.rules.loader import RuleError, RuleSet, load_rules, parse_rules
from trainguard.controller.tick import load_rule_set
from trainguard.rules import shipped_dir
from trainguard.strict import ConfigError, build

# The example: valid, and ~4 s a tick at 2,048 nodes.
TEMP_SCAN = """
rules:
  - name: temp_scan
    scope: gpu
    condition: max_over_time(temperature_celsius[15m]) < 0
    severity: info
    summary: never true
"""


def _many_terms(name: str, terms: int = 48) -> str:
    cond = " or ".join(["rate(power_watts[5m]) > 0"] * terms)
    return (
        f"  - name: {name}\n    scope: gpu\n    condition: {cond}\n"
        "    severity: info\n    summary: s\n"
    )


def _ruleset(text: str) -> RuleSet:
    return RuleSet(rules=tuple(parse_rules(text, source="t.yaml")), sources=("t.yaml",))


def _defaults() -> CostLimits:
    return limits_of(ControllerConfig())


def test_every_shipped_rule_fits_the_default_budget_with_room() -> None:
    limits = _defaults()
    costs = check_costs(load_rules([shipped_dir()]), limits)
    assert max(costs.values()) * 2 <= limits.max_cost_per_rule
    assert sum(costs.values()) * 3 <= limits.max_cost_total


def test_cost_is_series_times_window_points_per_windowed_term() -> None:
    limits = _defaults()
    (rule,) = _ruleset(TEMP_SCAN).rules
    # 2,048 nodes x 8 GPUs, a 15 min window at one point per 5 s (+ the base and newest)
    assert rule_cost(rule, limits) == 2048 * 8 * (900 // 5 + 2)
    (counter,) = _ruleset(
        "rules:\n  - {name: c, scope: gpu, condition: 'increase(xid_fatal_total[5m]) > 0',"
        " severity: info, summary: s}\n"
    ).rules
    # a counter keeps points only while it counts: 1% of them by default
    assert rule_cost(counter, limits) == round(2048 * 8 * 0.01 * (300 // 5 + 2))
    (plain,) = _ruleset(
        "rules:\n  - {name: p, scope: gpu, condition: 'temperature_celsius > 90',"
        " severity: info, summary: s}\n"
    ).rules
    assert rule_cost(plain, limits) == 0


def test_a_costly_rule_is_refused_naming_the_rule_its_cost_and_the_budget() -> None:
    with pytest.raises(RuleError) as e:
        check_costs(_ruleset(TEMP_SCAN), _defaults())
    assert e.value.rule == "temp_scan"
    assert e.value.file == "t.yaml"
    text = str(e.value)
    assert "cost 2,981,888 history points per tick" in text
    assert "rule_budget.max_cost_per_rule 1,500,000" in text


def test_rules_of_48_windowed_terms_are_refused() -> None:
    text = "rules:\n" + "".join(_many_terms(f"wide_{i}") for i in range(8))
    with pytest.raises(RuleError) as e:
        check_costs(_ruleset(text), _defaults())
    assert e.value.rule == "wide_0"


def test_rules_each_within_budget_but_over_the_total_are_refused_as_a_set() -> None:
    limits = CostLimits(
        nodes=2048,
        gpus_per_node=8,
        nvlinks_per_gpu=18,
        ib_ports_per_node=8,
        ranks_per_node=8,
        moving_counters_percent=1.0,
        max_cost_per_rule=500_000,
        max_cost_total=1_000_000,
    )
    text = "rules:\n" + "".join(
        f"  - {{name: drop_{i}, scope: job, condition: 'samples_per_s < max_over_time("
        f"samples_per_s[15m])', severity: info, summary: s}}\n"
        for i in range(3)
    )
    with pytest.raises(RuleError) as e:
        check_costs(_ruleset(text), limits)
    assert e.value.rule is None
    assert "total cost 1,118,208 history points per tick of 3 rules" in str(e.value)
    assert "rule_budget.max_cost_total 1,000,000" in str(e.value)


def test_the_cluster_size_is_bounded_by_api_max_nodes() -> None:
    config = build(ControllerConfig, {"api": {"max_nodes": 16}}, source="t")
    (rule,) = _ruleset(TEMP_SCAN).rules
    assert rule_cost(rule, limits_of(config)) == 16 * 8 * 182
    check_costs(_ruleset(TEMP_SCAN), limits_of(config))  # 16 nodes: within budget


def _config(tmp_path: Path, rules: str, **extra: object) -> ControllerConfig:
    path = tmp_path / "rules.yaml"
    path.write_text(rules)
    data = {"store": {"path": str(tmp_path / "c.db")}, "rules": [str(path)], **extra}
    return build(ControllerConfig, data, source="test")


def test_a_costly_rule_file_at_start_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_rule_set(_config(tmp_path, TEMP_SCAN))
    assert "rule temp_scan" in str(e.value)
    assert "exceeds rule_budget.max_cost_per_rule" in str(e.value)


def test_agentctl_rules_check_refuses_it_with_the_same_message(tmp_path: Path) -> None:
    path = tmp_path / "costly.yaml"
    path.write_text(TEMP_SCAN)
    out, err = io.StringIO(), io.StringIO()
    code = agentctl(["rules", "check", str(path)], stdin=io.StringIO(), stdout=out, stderr=err)
    assert code == 1
    with pytest.raises(RuleError) as e:
        check_costs(load_rules([path]), _defaults())
    assert str(e.value) in err.getvalue()


def test_agentctl_rules_check_sizes_the_cluster_from_a_controller_config(
    tmp_path: Path,
) -> None:
    path = tmp_path / "costly.yaml"
    path.write_text(TEMP_SCAN)
    config = tmp_path / "controller.yaml"
    config.write_text("rule_budget: {nodes: 16}\n")
    out, err = io.StringIO(), io.StringIO()
    argv = ["rules", "check", "--controller-config", str(config), str(path)]
    code = agentctl(argv, stdin=io.StringIO(), stdout=out, stderr=err)
    assert (code, out.getvalue()) == (0, "OK: 1 rules\n"), err.getvalue()


def test_a_costly_rule_file_on_reload_is_refused_and_the_running_rules_stay(
    make_core, tmp_path: Path
) -> None:
    c = make_core()
    before = c.ticker.rule_count
    Path(c.config.rules[0]).write_text(TEMP_SCAN)
    with pytest.raises(BadRequest) as e:
        c.reload_rules(actor="op")
    assert "rules not reloaded, the running rules stay" in str(e.value)
    assert "rule temp_scan: cost 2,981,888" in str(e.value)
    assert c.ticker.rule_count == before
