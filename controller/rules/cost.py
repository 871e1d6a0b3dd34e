"""What a rule costs to evaluate, bounded at load: a rule set over its budget is refused.

The cost is the history points one tick scans, at the largest cluster the controller is
sized for (`rule_budget.nodes`, at most `api.max_nodes`, and the sizes per node):

    cost(rule) = sum over its windowed terms of series(scope) x moving(term) x points(term)

- series(scope): node, job: nodes (a node runs at most one job); gpu: nodes x gpus_per_node;
  nvlink: that x nvlinks_per_gpu; ib_port: nodes x ib_ports_per_node; rank: nodes x
  ranks_per_node.
- points(term): a windowed function (rate, increase, changes, max_over_time, min_over_time)
  scans the points its window holds: window_s / 5 s + 2 (a series keeps a point at most every
  5 s, SignalState's min_spacing_s).
- moving(term): the share of series that hold points at all. A series is kept on change only:
  a signal that changes rarely (a counter; on a GPU, NVLink or IB port also a flag or link
  state, the signals SignalState tracks by default) holds points only while it moves,
  `moving_counters_percent` / 100 of them at once; any other (a gauge: temperature, power,
  throughput) changes every report: 1.

A plain signal read costs one lookup per target whatever the rule (and the condition's
length is bounded by the language), so it is not counted. The model is a worst case at the
configured size, not a forecast; what it guarantees is that no valid rule file can ask the
tick for more than the budget: `check_costs` raises RuleError naming the rule, its cost and
the budget, at start (exit 2), on reload (the running rules stay) and in `agentctl rules
check`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainguard.controller.rules.lang import Call, Sig, walk
from trainguard.controller.rules.loader import Rule, RuleError, RuleSet
from trainguard.controller.signals import DEFAULT_TRACKED, SIGNALS

if TYPE_CHECKING:  # only the annotation: the rules never import the controller's config
    from trainguard.controller.config import ControllerConfig

__all__ = [
    "HISTORY_SPACING_S",
    "CostLimits",
    "check_costs",
    "limits_of",
    "rule_cost",
    "window_samples",
]

# SignalState keeps a history point at most this often (its min_spacing_s default).
HISTORY_SPACING_S = 5.0
# Scopes of one device each, whose default-tracked signals are counters, flags and link states.
_DEVICE_SCOPES = frozenset({"gpu", "nvlink", "ib_port"})


@dataclass(frozen=True)
class CostLimits:
    """The cluster size a cost is computed for and the budgets (points scanned per tick)."""

    nodes: int
    gpus_per_node: int
    nvlinks_per_gpu: int
    ib_ports_per_node: int
    ranks_per_node: int
    moving_counters_percent: float
    max_cost_per_rule: int
    max_cost_total: int

    def series(self, scope: str) -> int:
        """How many targets a rule of `scope` evaluates at this cluster size."""
        nodes = self.nodes
        per_scope = {
            "node": nodes,
            "job": nodes,
            "gpu": nodes * self.gpus_per_node,
            "nvlink": nodes * self.gpus_per_node * self.nvlinks_per_gpu,
            "ib_port": nodes * self.ib_ports_per_node,
            "rank": nodes * self.ranks_per_node,
        }
        return per_scope[scope]


def limits_of(config: ControllerConfig) -> CostLimits:
    """The cost limits a controller config sets (rule_budget, nodes at most api.max_nodes)."""
    b = config.rule_budget
    return CostLimits(
        nodes=min(b.nodes, config.api.max_nodes),
        gpus_per_node=b.gpus_per_node,
        nvlinks_per_gpu=b.nvlinks_per_gpu,
        ib_ports_per_node=b.ib_ports_per_node,
        ranks_per_node=b.ranks_per_node,
        moving_counters_percent=b.moving_counters_percent,
        max_cost_per_rule=b.max_cost_per_rule,
        max_cost_total=b.max_cost_total,
    )


def window_samples(window_s: float) -> int:
    """History points a windowed function scans: one per HISTORY_SPACING_S, plus the base
    point and the newest."""
    return int(window_s // HISTORY_SPACING_S) + 2


def rule_cost(rule: Rule, limits: CostLimits) -> int:
    """History points `rule` scans per tick at the cluster size of `limits`."""
    series = limits.series(rule.scope)
    total = 0.0
    for node in walk(rule.condition.ast):
        if isinstance(node, Call) and node.window_s is not None and isinstance(node.arg, Sig):
            rare = _changes_rarely(rule.scope, node.arg.name)
            moving = limits.moving_counters_percent / 100 if rare else 1.0
            total += series * moving * window_samples(node.window_s)
    return round(total)


def _changes_rarely(scope: str, name: str) -> bool:
    spec = SIGNALS[scope].get(name)
    if spec is not None and spec.counter:
        return True
    return scope in _DEVICE_SCOPES and name in DEFAULT_TRACKED[scope]


def _why(rule: Rule, cost: int, limits: CostLimits) -> str:
    return (
        f"cost {cost:,} history points per tick (over {limits.series(rule.scope):,}"
        f" {rule.scope} series at {limits.nodes:,} nodes) exceeds"
        f" rule_budget.max_cost_per_rule {limits.max_cost_per_rule:,}: shorten its windows,"
        " drop windowed terms, or raise the budget (docs/rules.md, Cost)"
    )


def check_costs(rules: RuleSet, limits: CostLimits) -> dict[str, int]:
    """Each rule's cost (name -> history points per tick); raises RuleError for the first rule
    over max_cost_per_rule, or for the set when the sum passes max_cost_total."""
    costs: dict[str, int] = {}
    for rule in rules.rules:
        cost = rule_cost(rule, limits)
        if cost > limits.max_cost_per_rule:
            raise RuleError(rule.source, rule.name, _why(rule, cost, limits))
        costs[rule.name] = cost
    total = sum(costs.values())
    if total > limits.max_cost_total:
        top = sorted(costs.items(), key=lambda kv: -kv[1])[:3]
        named = ", ".join(f"{name} {cost:,}" for name, cost in top)
        raise RuleError(
            ", ".join(rules.sources),
            None,
            f"total cost {total:,} history points per tick of {len(costs)} rules exceeds"
            f" rule_budget.max_cost_total {limits.max_cost_total:,} (costliest: {named})",
        )
    return costs
