"""Compiled getters: (scope, signal) -> a function reading that signal (or its history) from an
`EvalContext`, the per-target view the rules engine points at each target in turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from trainguard.controller.signals.catalogue import RANK_FIELDS, SIGNALS
from trainguard.controller.signals.records import _JOB_NUMERIC, _NODE_NUMERIC, _ib_value
from trainguard.controller.signals.series import Series
from trainguard.model import GPU_VALUE_FIELDS, NVLINK_VALUE_FIELDS

__all__ = ["EvalContext", "Getter", "TrackedSignals", "getter", "series_getter", "target_of"]


class TrackedSignals(Protocol):
    """The part of `SignalState` a condition consults through `EvalContext.signals`."""

    def is_tracked(self, scope: str, name: str) -> bool: ...


class EvalContext:
    """What a compiled condition reads for one target (filled in by the engine per target)."""

    __slots__ = (
        "cache",
        "gpu",
        "job",
        "link",
        "node",
        "now",
        "port",
        "rank",
        "signals",
        "stale_after_s",
    )

    def __init__(self, signals: TrackedSignals, *, now: float, stale_after_s: float) -> None:
        self.signals = signals
        self.now = now
        self.stale_after_s = stale_after_s
        self.node: Any = None
        self.gpu: Any = None
        self.link: Any = None
        self.port: Any = None
        self.rank: Any = None
        self.job: Any = None
        self.cache: dict[Any, Any] = {}  # per-tick aggregates (job_median, ...)


Getter = Callable[[EvalContext], Any]


def target_of(scope: str, ctx: EvalContext) -> tuple[Any, ...]:
    """(scope, node, gpu, link, device, port, job, rank) of the target `ctx` points at, in
    `trainguard.controller.model.Target` field order."""
    if scope == "gpu":
        return (scope, ctx.node.name, ctx.gpu.index, None, None, None, None, None)
    if scope == "nvlink":
        return (scope, ctx.node.name, ctx.gpu.index, ctx.link.link, None, None, None, None)
    if scope == "ib_port":
        s = ctx.port.sample
        return (scope, ctx.node.name, None, None, s.device, s.port, None, None)
    if scope == "node":
        return (scope, ctx.node.name, None, None, None, None, None, None)
    if scope == "rank":
        r = ctx.rank
        return (scope, r.node, None, None, None, None, r.job, r.rank)
    return (scope, None, None, None, None, None, ctx.job.name, None)


def _gpu_field(name: str) -> Getter:
    def get(c: EvalContext) -> Any:
        s = c.gpu.sample
        return None if s is None else getattr(s, name)

    return get


def _gpu_attr(name: str) -> Getter:
    return lambda c: getattr(c.gpu, name)


def _link_field(name: str) -> Getter:
    return lambda c: getattr(c.link, name)


def _ib_getter(name: str) -> Getter:
    return lambda c: _ib_value(c.port.sample, name)


def _report_age(c: EvalContext) -> Any:
    t = c.node.last_report_at
    return None if t is None else c.now - t


def _role(c: EvalContext) -> Any:
    n = c.node
    return n.role if n.role is not None else n.role_hint


def _rank_field(name: str) -> Getter:
    def get(c: EvalContext) -> Any:
        s = c.rank.state
        return None if s is None else getattr(s, name)

    return get


def _rank_aged(name: str) -> Getter:
    def get(c: EvalContext) -> Any:
        r = c.rank
        s = r.state
        return None if s is None else getattr(s, name) + (c.now - r.received_at)

    return get


def _ranks_reporting(c: EvalContext) -> Any:
    limit = c.stale_after_s
    now = c.now
    return sum(
        1
        for r in c.job.ranks.values()
        if r.state is not None and r.state.heartbeat_age_s + (now - r.received_at) <= limit
    )


def _job_min_aged(name: str) -> Getter:
    def get(c: EvalContext) -> Any:
        now = c.now
        vals = [
            getattr(r.state, name) + (now - r.received_at)
            for r in c.job.ranks.values()
            if r.state is not None
        ]
        return min(vals) if vals else None

    return get


def _build_getters() -> dict[tuple[str, str], Getter]:
    g: dict[tuple[str, str], Getter] = {}
    for name in GPU_VALUE_FIELDS:
        g["gpu", name] = _gpu_field(name)
    for name in ("xid_total", "xid_fatal_total", "xid_last_code", "gpu_lost_total"):
        g["gpu", name] = _gpu_attr(name)
    for name in NVLINK_VALUE_FIELDS:
        g["nvlink", name] = _link_field(name)
    for name in SIGNALS["ib_port"]:
        g["ib_port", name] = _ib_getter(name)
    g["node", "report_age_s"] = _report_age
    for name, fn in _NODE_NUMERIC.items():
        g["node", name] = lambda c, fn=fn: fn(c.node)  # type: ignore[misc]
    g["node", "xid_total"] = lambda c: c.node.xid_total
    g["node", "xid_fatal_total"] = lambda c: c.node.xid_fatal_total
    g["node", "preemption_total"] = lambda c: c.node.preemption_total
    g["node", "agent_sources_stale"] = lambda c: c.node.agent_sources_stale
    g["node", "role"] = _role
    g["node", "state"] = lambda c: c.node.state
    g["node", "job"] = lambda c: c.node.job
    for name in RANK_FIELDS:
        aged = name in ("heartbeat_age_s", "step_age_s")
        g["rank", name] = _rank_aged(name) if aged else _rank_field(name)
    g["rank", "nan_total"] = lambda c: c.rank.nan_total
    g["rank", "phase"] = _rank_field("phase")
    g["job", "step_age_s"] = _job_min_aged("step_age_s")
    g["job", "heartbeat_age_s"] = _job_min_aged("heartbeat_age_s")
    for name, jfn in _JOB_NUMERIC.items():
        g["job", name] = lambda c, jfn=jfn: jfn(c.job)  # type: ignore[misc]
    g["job", "ranks_reporting"] = _ranks_reporting
    g["job", "nan_total"] = lambda c: c.job.nan_total
    g["job", "state"] = lambda c: c.job.meta_state
    missing = {(s, n) for s in SIGNALS for n in SIGNALS[s]} - set(g)
    assert not missing, f"signals without a getter: {sorted(missing)}"
    return g


_GETTERS = _build_getters()


def getter(scope: str, name: str) -> Getter:
    """The function reading signal `name` of `scope` from an EvalContext."""
    return _GETTERS[scope, name]


def _series_of(scope: str, name: str) -> Callable[[EvalContext], tuple[Series | None, float]]:
    """(series, time the value was first seen) for a signal of a target."""
    if scope == "nvlink":
        return lambda c: (c.gpu.link_series.get((c.link.link, name)), c.gpu.first_seen)
    attr = {"gpu": "gpu", "ib_port": "port", "node": "node", "rank": "rank", "job": "job"}[scope]

    def get(c: EvalContext) -> tuple[Series | None, float]:
        rec = getattr(c, attr)
        first = rec.first_seen
        return rec.series.get(name), (c.now if first is None else first)

    return get


def series_getter(scope: str, name: str) -> Callable[[EvalContext], tuple[Series | None, float]]:
    return _series_of(scope, name)
