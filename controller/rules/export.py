"""Export a RuleSet as Prometheus alerting rules over the agent's /metrics names.

`PROM_SIGNALS` maps each (scope, signal) to PromQL: the signals the agent exports, as the
contract's signal table (`trainguard.signals`) names them, plus the controller's aggregates
of them. Every signal expression is aggregated to the scope's identity labels (`IDENTITY`),
so vectors of one scope always match one-to-one and job aggregates join rank vectors with
`on(job) group_left`. Rules that read something Prometheus does not have (controller
inventory such as `role`, report age, event counters without a metric, `age()`, `present()`
under `not`) are skipped with a warning naming them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.controller.model import Target
from trainguard.controller.rules.lang import (
    And,
    Arith,
    Call,
    Cmp,
    InList,
    Neg,
    Node,
    Not,
    Num,
    Or,
    Sig,
    Str,
    format_duration,
)
from trainguard.controller.rules.loader import Rule, RuleSet
from trainguard.signals import SIGNALS, Signal, by_key

__all__ = [
    "GROUP_NAME",
    "IDENTITY",
    "PROM_SIGNALS",
    "PromSignal",
    "alert_annotations",
    "alert_labels",
    "prom_signals",
    "to_prometheus_rules",
]

GROUP_NAME = "trainguard"

IDENTITY: dict[str, str] = {
    "gpu": "node, gpu",
    "nvlink": "node, gpu, link",
    "ib_port": "node, device, port",
    "node": "node",
    "rank": "job, rank",
    "job": "job",
}


@dataclass(frozen=True)
class PromSignal:
    """How one signal reads in PromQL.

    `selector` is an instant-vector selector. The signal's value is
    `scale * <agg> by (<scope identity>) (selector)`; range functions go inside the aggregation
    (`sum by (node, gpu) (increase(selector[5m]))`) unless `subquery` is set, in which case the
    aggregated expression is evaluated as a subquery (`max_over_time(sum by (job) (x)[15m:])`).

    `born_on_event` marks a counter whose labelled series the agent creates at its first event
    (a label value, such as the XID code, is not known before): its first sample already holds
    the first count, so `increase()`/`rate()` alone read 0 there. Such counters also count a
    series born inside the window from zero: `(x unless x offset 5m) or increase(x[5m])`.
    """

    selector: str
    agg: str = "max"
    scale: float = 1.0
    subquery: bool = False
    born_on_event: bool = False


# the agent labels every XID line with its own severity (XidCatalog.classify): a Nonfatal
# NVLink5 XID is not fatal, so the alert selects the label, never a list of codes
_FATAL_XID_LABELS = 'severity="fatal"'
_TABLE = by_key()


def _agent_metric(scope: str, name: str) -> str:
    """The Prometheus family the agent exports signal `name` of `scope` as."""
    prom = _TABLE[scope, name].prom
    assert prom is not None, f"{scope}.{name} has no Prometheus metric"
    return prom.name


def _born_on_event(selector: str) -> PromSignal:
    # one series per label value (the XID code), created by the agent at its first event
    return PromSignal(selector, agg="sum", born_on_event=True)


def prom_signals(signals: Iterable[Signal] = SIGNALS) -> dict[tuple[str, str], PromSignal]:
    """(scope, signal) -> PromQL for the signals of table `signals`."""
    t: dict[tuple[str, str], PromSignal] = {}
    # every signal the agent exports, as the signal table says
    for s in signals:
        if s.prom is None:
            continue
        if s.prom.born_on_event:
            t[s.scope, s.name] = _born_on_event(s.prom.selector)
        else:
            t[s.scope, s.name] = PromSignal(s.prom.selector, scale=s.prom.scale)
    # controller signals that aggregate what the agent exports
    xid = _agent_metric("gpu", "xid_total")
    lost = _agent_metric("gpu", "lost")
    step = _agent_metric("rank", "step")
    fatal = _born_on_event(f"{xid}{{{_FATAL_XID_LABELS}}}")
    t["gpu", "xid_fatal_total"] = fatal
    t["node", "gpus"] = PromSignal(lost, agg="count")
    t["node", "gpus_lost"] = PromSignal(lost, agg="sum")
    t["node", "ib_ports"] = PromSignal(_agent_metric("ib_port", "up"), agg="count")
    t["node", "agent_sources_stale"] = PromSignal("trainguard_agent_source_stale", agg="sum")
    t["node", "xid_total"] = _born_on_event(xid)
    t["node", "xid_fatal_total"] = fatal
    t["job", "ranks"] = PromSignal(step, agg="count", subquery=True)
    t["job", "step"] = PromSignal(step, subquery=True)
    t["job", "step_age_s"] = PromSignal(
        _agent_metric("rank", "step_age_s"), agg="min", subquery=True
    )
    t["job", "heartbeat_age_s"] = PromSignal(
        _agent_metric("rank", "heartbeat_age_s"), agg="min", subquery=True
    )
    t["job", "samples_per_s"] = PromSignal(
        _agent_metric("rank", "samples_per_s"), agg="sum", subquery=True
    )
    t["job", "ckpt_step"] = PromSignal(_agent_metric("rank", "ckpt_step"), agg="min")
    for name in (
        "ckpt_failures",
        "ckpt_age_s",
        "ckpt_interval_s",
        "ckpt_replica_step",
        "ckpt_replica_lag_s",
    ):
        t["job", name] = PromSignal(_agent_metric("rank", name))
    return t


# (scope, signal) -> PromQL. Signals missing here exist only in the controller.
PROM_SIGNALS: dict[tuple[str, str], PromSignal] = prom_signals()

_NEGATE = {"==": "!=", "!=": "==", "<": ">=", "<=": ">", ">": "<=", ">=": "<"}


class _Unexpressible(Exception):
    pass


@dataclass(frozen=True)
class _Expr:
    text: str
    kind: str  # "scalar" | "vector" (scope identity labels) | "job" (job label only)


def to_prometheus_rules(rules: RuleSet) -> tuple[dict[str, Any], list[str]]:
    """(rule-file dict for promtool / Prometheus, warnings for rules that were skipped)."""
    out: list[dict[str, Any]] = []
    warnings: list[str] = []
    for rule in rules.rules:
        try:
            expr = _Translator(rule.scope).bool(rule.condition.ast, negate=False)
        except _Unexpressible as e:
            warnings.append(f"rule {rule.name}: not exported to Prometheus: {e}")
            continue
        annotations = alert_annotations(rule)
        labels = {"severity": rule.severity, "scope": rule.scope, **dict(rule.labels)}
        out.append(
            {
                "alert": rule.name,
                "expr": expr.text,
                "for": format_duration(rule.for_s),
                "labels": labels,
                "annotations": annotations,
            }
        )
    return {"groups": [{"name": GROUP_NAME, "rules": out}]}, warnings


def alert_annotations(rule: Rule) -> dict[str, str]:
    """The annotations of `rule`'s exported alert."""
    annotations = {"summary": rule.summary}
    if rule.description:
        annotations["description"] = rule.description
    return annotations


def alert_labels(
    *, rule: str, severity: str, target: Target, rule_labels: Mapping[str, str]
) -> dict[str, str]:
    """The labels Prometheus puts on the exported alert of `rule` firing for `target`: the
    alert name, the rule's labels (as `to_prometheus_rules` writes them) and the scope's
    identity labels (`IDENTITY`, what every exported expression is aggregated by)."""
    labels = {"alertname": rule, "severity": severity, "scope": target.scope, **rule_labels}
    values = dataclasses.asdict(target)
    for name in IDENTITY.get(target.scope, "").split(", "):
        if name and values.get(name) is not None:
            labels[name] = str(values[name])
    return labels


def _num(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    if v == float("-inf"):
        return "-Inf"
    if v == int(v) and abs(v) < 1e15:
        return str(int(v))
    return repr(v)


def _from_zero(selector: str, func: str, window: str | None, window_s: float) -> str:
    """increase()/rate() of a counter series that may have been born inside the window.

    A series with no sample a window ago (`unless ... offset`) counts its whole value as new:
    born at its first event, it went from an implied 0 to its first sample. Every other series
    takes the plain range function (`or` keeps the left side where both have the series).
    """
    born = f"({selector} unless {selector} offset {window})"
    if func == "rate":
        born = f"{born} / {_num(window_s)}"
    return f"({born} or {func}({selector}[{window}]))"


class _Translator:
    def __init__(self, scope: str) -> None:
        self.scope = scope

    # boolean expressions: a vector that is non-empty exactly where the condition holds
    def bool(self, node: Node, *, negate: bool) -> _Expr:
        if isinstance(node, Not):
            return self.bool(node.operand, negate=not negate)
        if isinstance(node, And | Or):
            is_and = isinstance(node, And) != negate  # De Morgan
            left = self.bool(node.left, negate=negate)
            right = self.bool(node.right, negate=negate)
            return self._join("and" if is_and else "or", left, right)
        if isinstance(node, Cmp):
            op = _NEGATE[node.op] if negate else node.op
            return self._compare(op, self.num(node.left), self.num(node.right))
        if isinstance(node, InList):
            x = self.num(node.operand)
            negated = node.negate != negate
            parts = [
                self._compare("!=" if negated else "==", x, _Expr(_num(float(v)), "scalar"))
                for v in node.items
            ]
            acc = parts[0]
            for p in parts[1:]:
                acc = self._join("and" if negated else "or", acc, p)
            return acc
        if isinstance(node, Call) and node.func == "finite":
            x = self.num(node.arg)
            if negate:
                return _Expr(f"({x.text} unless abs({x.text}) < +Inf)", x.kind)
            return _Expr(f"(abs({x.text}) < +Inf)", x.kind)
        if isinstance(node, Call) and node.func == "present":
            if negate:
                raise _Unexpressible("'not present(...)' has no PromQL form for a labelled vector")
            return self.num(node.arg)
        raise _Unexpressible(f"unsupported boolean expression at column {node.pos + 1}")

    def _join(self, op: str, a: _Expr, b: _Expr) -> _Expr:
        if a.kind == b.kind:
            return _Expr(f"({a.text} {op} {b.text})", a.kind)
        # A rank vector with a job vector: match on the job label, keep the rank labels.
        return _Expr(f"({a.text} {op} on(job) {b.text})", "vector" if op != "or" else a.kind)

    def _compare(self, op: str, a: _Expr, b: _Expr) -> _Expr:
        if a.kind == "scalar" and b.kind == "scalar":
            raise _Unexpressible("a comparison of two constants")
        return self._binary(op, a, b)

    def _binary(self, op: str, a: _Expr, b: _Expr) -> _Expr:
        if "scalar" in (a.kind, b.kind) or a.kind == b.kind:
            kind = b.kind if a.kind == "scalar" else a.kind
            return _Expr(f"({a.text} {op} {b.text})", kind)
        if a.kind == "vector" and b.kind == "job":
            return _Expr(f"({a.text} {op} on(job) group_left() {b.text})", "vector")
        return _Expr(f"({a.text} {op} on(job) group_right() {b.text})", "vector")

    # numeric expressions
    def num(self, node: Node) -> _Expr:
        if isinstance(node, Num):
            return _Expr(_num(node.value), "scalar")
        if isinstance(node, Str):
            raise _Unexpressible("string values exist only in the controller")
        if isinstance(node, Sig):
            return self._signal(node.name, None, None)
        if isinstance(node, Neg):
            x = self.num(node.operand)
            return _Expr(f"(-{x.text})", x.kind)
        if isinstance(node, Arith):
            return self._binary(node.op, self.num(node.left), self.num(node.right))
        if isinstance(node, Call):
            return self._call(node)
        raise _Unexpressible(f"a true/false value used as a number at column {node.pos + 1}")

    def _call(self, node: Call) -> _Expr:
        f = node.func
        if f == "abs":
            x = self.num(node.arg)
            return _Expr(f"abs({x.text})", x.kind)
        if f in ("rate", "increase", "changes", "max_over_time", "min_over_time"):
            assert isinstance(node.arg, Sig)
            return self._signal(node.arg.name, f, node.window_text, node.window_s)
        if f in ("job_median", "job_max", "job_min", "job_count"):
            assert isinstance(node.arg, Sig)
            inner = self._signal(node.arg.name, None, None).text
            agg = {
                "job_median": "quantile by (job) (0.5, {})",
                "job_max": "max by (job) ({})",
                "job_min": "min by (job) ({})",
                "job_count": "count by (job) ({})",
            }[f]
            return _Expr(agg.format(inner), "job")
        raise _Unexpressible(f"{f}() has no PromQL equivalent here")

    def _signal(
        self, name: str, func: str | None, window: str | None, window_s: float | None = None
    ) -> _Expr:
        spec = PROM_SIGNALS.get((self.scope, name))
        if spec is None:
            raise _Unexpressible(f"signal {name!r} ({self.scope}) has no Prometheus metric")
        selector = spec.selector
        by = IDENTITY[self.scope]
        kind = "vector"
        if func is None:
            text = f"{spec.agg} by ({by}) ({selector})"
        elif spec.subquery:
            text = f"{func}({spec.agg} by ({by}) ({selector})[{window}:])"
        elif spec.born_on_event and func in ("increase", "rate") and window_s is not None:
            text = f"{spec.agg} by ({by}) ({_from_zero(selector, func, window, window_s)})"
        else:
            text = f"{spec.agg} by ({by}) ({func}({selector}[{window}]))"
        if spec.scale != 1.0 and func != "changes":
            text = f"({_num(spec.scale)} * {text})"
        return _Expr(text, kind)


def expressible(rules: Iterable[Rule]) -> list[str]:
    """Names of the rules that export (for docs and tests)."""
    rs = RuleSet(rules=tuple(rules), sources=())
    exported, _ = to_prometheus_rules(rs)
    return [r["alert"] for r in exported["groups"][0]["rules"]]
