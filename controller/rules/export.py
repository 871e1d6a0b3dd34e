"""Export a RuleSet as Prometheus alerting rules over the agent's /metrics names.

`PROM_SIGNALS` is the one table mapping each (scope, signal) to PromQL; align it with
`agent/metrics.py` when metric names change. Every signal expression is aggregated to the
scope's identity labels (`IDENTITY`), so vectors of one scope always match one-to-one and job
aggregates join rank vectors with `on(job) group_left`. Rules that read something Prometheus
does not have (controller inventory such as `role`, report age, event counters without a
metric, `age()`, `present()` under `not`) are skipped with a warning naming them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

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
from trainguard.controller.signals import IB_COUNTERS, IB_HW_COUNTERS
from trainguard.xid_catalog import XidCatalog

__all__ = ["GROUP_NAME", "IDENTITY", "PROM_SIGNALS", "PromSignal", "to_prometheus_rules"]

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


_FATAL_XID_PLACEHOLDER = "{fatal_xids}"


def _ib_counter(name: str) -> PromSignal:
    if name == "port_xmit_data":
        return PromSignal('trainguard_ib_port_data_bytes_total{direction="transmit"}', scale=0.25)
    if name == "port_rcv_data":
        return PromSignal('trainguard_ib_port_data_bytes_total{direction="receive"}', scale=0.25)
    if name == "port_xmit_wait":
        return PromSignal("trainguard_ib_port_transmit_wait_ticks_total")
    if name.endswith("_packets"):
        return PromSignal(f'trainguard_ib_port_packets_total{{counter="{name}"}}')
    return PromSignal(f'trainguard_ib_port_errors_total{{counter="{name}"}}')


def _xid_counter(selector: str) -> PromSignal:
    # one series per (GPU, XID code), created by the agent when that code is first seen
    return PromSignal(selector, agg="sum", born_on_event=True)


def _table() -> dict[tuple[str, str], PromSignal]:
    t: dict[tuple[str, str], PromSignal] = {
        ("gpu", "lost"): PromSignal("trainguard_gpu_lost"),
        ("gpu", "temperature_celsius"): PromSignal("trainguard_gpu_temperature_celsius"),
        ("gpu", "power_watts"): PromSignal("trainguard_gpu_power_watts"),
        ("gpu", "utilization_gpu_percent"): PromSignal(
            "trainguard_gpu_utilization_ratio", scale=100
        ),
        ("gpu", "utilization_memory_percent"): PromSignal(
            "trainguard_gpu_memory_utilization_ratio", scale=100
        ),
        ("gpu", "memory_used_bytes"): PromSignal("trainguard_gpu_memory_used_bytes"),
        ("gpu", "memory_total_bytes"): PromSignal("trainguard_gpu_memory_total_bytes"),
        ("gpu", "sm_clock_mhz"): PromSignal("trainguard_gpu_sm_clock_hertz", scale=1e-6),
        ("gpu", "throttle_hw_slowdown"): PromSignal(
            'trainguard_gpu_throttle_active{reason="hw_slowdown"}'
        ),
        ("gpu", "throttle_hw_thermal"): PromSignal(
            'trainguard_gpu_throttle_active{reason="hw_thermal"}'
        ),
        ("gpu", "throttle_sw_thermal"): PromSignal(
            'trainguard_gpu_throttle_active{reason="sw_thermal"}'
        ),
        ("gpu", "throttle_power_brake"): PromSignal(
            'trainguard_gpu_throttle_active{reason="hw_power_brake"}'
        ),
        ("gpu", "remapped_rows_correctable"): PromSignal(
            'trainguard_gpu_remapped_rows{kind="correctable"}'
        ),
        ("gpu", "remapped_rows_uncorrectable"): PromSignal(
            'trainguard_gpu_remapped_rows{kind="uncorrectable"}'
        ),
        ("gpu", "remapped_rows_pending"): PromSignal("trainguard_gpu_remap_pending"),
        ("gpu", "remapped_rows_failure"): PromSignal("trainguard_gpu_remap_failed"),
        ("gpu", "retired_pages_sbe"): PromSignal('trainguard_gpu_retired_pages{cause="sbe"}'),
        ("gpu", "retired_pages_dbe"): PromSignal('trainguard_gpu_retired_pages{cause="dbe"}'),
        ("gpu", "retired_pages_pending"): PromSignal("trainguard_gpu_retired_pages_pending"),
        ("gpu", "pcie_replay_total"): PromSignal("trainguard_gpu_pcie_replay_errors_total"),
        ("gpu", "xid_total"): _xid_counter("trainguard_gpu_xid_errors_total"),
        ("gpu", "xid_fatal_total"): _xid_counter(
            f'trainguard_gpu_xid_errors_total{{xid=~"{_FATAL_XID_PLACEHOLDER}"}}'
        ),
        ("nvlink", "up"): PromSignal("trainguard_nvlink_up"),
        ("ib_port", "up"): PromSignal("trainguard_ib_port_up"),
        ("ib_port", "phys_up"): PromSignal("trainguard_ib_port_physical_up"),
        ("ib_port", "rate_gbps"): PromSignal(
            "trainguard_ib_port_rate_bytes_per_second", scale=8e-9
        ),
        ("node", "gpus"): PromSignal("trainguard_gpu_lost", agg="count"),
        ("node", "gpus_lost"): PromSignal("trainguard_gpu_lost", agg="sum"),
        ("node", "ib_ports"): PromSignal("trainguard_ib_port_up", agg="count"),
        ("node", "agent_sources_stale"): PromSignal("trainguard_agent_source_stale", agg="sum"),
        ("node", "xid_total"): _xid_counter("trainguard_gpu_xid_errors_total"),
        ("node", "xid_fatal_total"): _xid_counter(
            f'trainguard_gpu_xid_errors_total{{xid=~"{_FATAL_XID_PLACEHOLDER}"}}'
        ),
        ("job", "ranks"): PromSignal("trainguard_trainer_step", agg="count", subquery=True),
        ("job", "step"): PromSignal("trainguard_trainer_step", subquery=True),
        ("job", "step_age_s"): PromSignal(
            "trainguard_trainer_step_age_seconds", agg="min", subquery=True
        ),
        ("job", "heartbeat_age_s"): PromSignal(
            "trainguard_trainer_heartbeat_age_seconds", agg="min", subquery=True
        ),
        ("job", "samples_per_s"): PromSignal(
            "trainguard_trainer_samples_per_second", agg="sum", subquery=True
        ),
    }
    for kind, scope in (
        ("corrected", "volatile"),
        ("uncorrected", "volatile"),
        ("corrected", "aggregate"),
        ("uncorrected", "aggregate"),
    ):
        t["gpu", f"ecc_{kind}_{scope}_total"] = PromSignal(
            f'trainguard_gpu_ecc_errors_total{{type="{kind}",scope="{scope}"}}'
        )
    for field, kind in (
        ("crc_flit_errors_total", "crc_flit"),
        ("crc_data_errors_total", "crc_data"),
        ("replay_errors_total", "replay"),
        ("recovery_errors_total", "recovery"),
    ):
        t["nvlink", field] = PromSignal(f'trainguard_nvlink_errors_total{{type="{kind}"}}')
    for name in IB_COUNTERS:
        t["ib_port", name] = _ib_counter(name)
    for name in IB_HW_COUNTERS:
        t.setdefault(
            ("ib_port", name), PromSignal(f'trainguard_ib_port_hw_events_total{{counter="{name}"}}')
        )
    for signal, metric in (
        ("step", "trainguard_trainer_step"),
        ("loss", "trainguard_trainer_loss"),
        ("grad_norm", "trainguard_trainer_grad_norm"),
        ("samples_per_s", "trainguard_trainer_samples_per_second"),
        ("tokens_per_s", "trainguard_trainer_tokens_per_second"),
        ("step_time_s", "trainguard_trainer_step_time_seconds"),
        ("compute_time_s", "trainguard_trainer_compute_time_seconds"),
        ("heartbeat_age_s", "trainguard_trainer_heartbeat_age_seconds"),
        ("step_age_s", "trainguard_trainer_step_age_seconds"),
        ("ckpt_step", "trainguard_trainer_checkpoint_step"),
    ):
        t["rank", signal] = PromSignal(metric)
    return t


# (scope, signal) -> PromQL. Signals missing here exist only in the controller.
PROM_SIGNALS: dict[tuple[str, str], PromSignal] = _table()

_NEGATE = {"==": "!=", "!=": "==", "<": ">=", "<=": ">", ">": "<=", ">=": "<"}


class _Unexpressible(Exception):
    pass


@dataclass(frozen=True)
class _Expr:
    text: str
    kind: str  # "scalar" | "vector" (scope identity labels) | "job" (job label only)


def to_prometheus_rules(rules: RuleSet) -> tuple[dict[str, Any], list[str]]:
    """(rule-file dict for promtool / Prometheus, warnings for rules that were skipped)."""
    fatal = "|".join(str(c) for c in sorted(XidCatalog.load().fatal_codes()))
    out: list[dict[str, Any]] = []
    warnings: list[str] = []
    for rule in rules.rules:
        try:
            expr = _Translator(rule.scope, fatal).bool(rule.condition.ast, negate=False)
        except _Unexpressible as e:
            warnings.append(f"rule {rule.name}: not exported to Prometheus: {e}")
            continue
        annotations = {"summary": rule.summary}
        if rule.description:
            annotations["description"] = rule.description
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
    def __init__(self, scope: str, fatal_xids: str) -> None:
        self.scope = scope
        self.fatal = fatal_xids

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
        selector = spec.selector.replace(_FATAL_XID_PLACEHOLDER, self.fatal)
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
