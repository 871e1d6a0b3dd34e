"""The rules engine: one pure tick from (rules, signals, now, memory) to Decisions.

`evaluate` reads the SignalState (never mutates it), reads no clock and does no I/O. Per
(rule, target) it emits "pending" while the condition has held for less than `for:`, "firing"
on every tick once it has held that long, and "resolved" once when a pending or firing
condition stops holding (or its target or rule disappears). Cooldowns, silences and
deduplication belong to the incident layer.

Timed evaluation (`timing=EvalTiming(...)`, the tick's): each rule's evaluation is measured
with the injected timer; a rule past `rule_budget_s` is cut for this tick, a rule in `skip`
(disabled) is not evaluated, and once the whole evaluation has spent `tick_budget_s` the
remaining rules wait for the next tick. A rule not evaluated to its end decides nothing: its
targets keep the state they had (a firing one keeps firing, nothing resolves).

No action on stale data: for gpu, nvlink, ib_port and rank scopes, a target on a node whose
last report is older than `stale_after_s` keeps its state (a pending one stays pending, a firing
one keeps firing, nothing new starts and nothing resolves); node silence is the node rules' job.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from trainguard.controller.model import Decision, Target
from trainguard.controller.rules.loader import Rule, RuleSet
from trainguard.controller.signals import EvalContext, SignalState, target_of

__all__ = ["HELD_SCOPES", "EngineMemory", "EvalTiming", "MemoryEntry", "evaluate"]

# Scopes whose data comes from one node's report, so a silent node freezes them.
HELD_SCOPES = frozenset({"gpu", "nvlink", "ib_port", "rank"})


@dataclass(frozen=True)
class MemoryEntry:
    """What the engine remembers about one (rule, target) whose condition held last tick."""

    target: Target
    since: float  # when the condition first held (unix s)
    state: str  # "pending" | "firing"
    severity: str
    actions: tuple[str, ...]
    summary: str
    value: float | None
    labels: Mapping[str, str]
    cooldown_s: float


@dataclass(frozen=True)
class EngineMemory:
    """Immutable engine state between ticks: (rule name, target key) -> MemoryEntry."""

    entries: Mapping[tuple[str, str], MemoryEntry] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def __len__(self) -> int:
        return len(self.entries)


@dataclass
class EvalTiming:
    """The clock and budgets of a timed evaluation, and what it measured (filled in by
    `evaluate`): seconds spent per rule evaluated, rules cut at `rule_budget_s`, rules left
    for the next tick once `tick_budget_s` was spent."""

    timer: Callable[[], float]  # monotonic seconds (the tick passes time.perf_counter)
    rule_budget_s: float
    tick_budget_s: float
    skip: frozenset[str] = frozenset()
    spent_s: dict[str, float] = field(default_factory=dict)
    cut: set[str] = field(default_factory=set)
    deferred: list[str] = field(default_factory=list)


def evaluate(
    *,
    rules: RuleSet,
    signals: SignalState,
    now: float,
    memory: EngineMemory,
    stale_after_s: float = 10.0,
    timing: EvalTiming | None = None,
) -> tuple[list[Decision], EngineMemory]:
    """One tick: the Decisions for this instant and the memory for the next tick."""
    decisions: list[Decision] = []
    new: dict[tuple[str, str], MemoryEntry] = {}
    old = memory.entries
    fresh_after = now - stale_after_s
    started = timing.timer() if timing is not None else 0.0
    for rule in rules.rules:
        deadline = None
        begun = 0.0
        if timing is not None:
            begun = timing.timer()
            if rule.name in timing.skip or begun - started >= timing.tick_budget_s:
                if rule.name not in timing.skip:
                    timing.deferred.append(rule.name)
                _carry(rule.name, old, new, decisions)
                continue
            deadline = begun + timing.rule_budget_s
        found = _evaluate_rule(
            rule,
            signals,
            now=now,
            stale_after_s=stale_after_s,
            old=old,
            deadline=deadline,
            timer=timing.timer if timing is not None else None,
        )
        if timing is not None:
            timing.spent_s[rule.name] = timing.timer() - begun
        if found is None:  # cut at its budget: no verdict this tick
            assert timing is not None
            timing.cut.add(rule.name)
            _carry(rule.name, old, new, decisions)
            continue
        for key, entry in found.items():
            new[key] = entry
            decisions.append(_decision(rule.name, entry, entry.state))
    for key, entry in old.items():
        if key in new:
            continue
        rule_name = key[0]
        target = entry.target
        if (
            target.scope in HELD_SCOPES
            and rules.get(rule_name) is not None
            and _node_silent(signals, target, fresh_after)
        ):
            new[key] = entry
            decisions.append(_decision(rule_name, entry, entry.state))
            continue
        decisions.append(_decision(rule_name, entry, "resolved"))
    return decisions, EngineMemory(MappingProxyType(new))


def _evaluate_rule(
    rule: Rule,
    signals: SignalState,
    *,
    now: float,
    stale_after_s: float,
    old: Mapping[tuple[str, str], MemoryEntry],
    deadline: float | None,
    timer: Callable[[], float] | None,
) -> dict[tuple[str, str], MemoryEntry] | None:
    """The entries of the targets where `rule` holds; None when it ran past `deadline` (the
    clock is read before each node's targets and every few targets of the other scopes, so a
    rule that matches nothing is cut too, and reading it costs little beside the tests)."""
    found: dict[tuple[str, str], MemoryEntry] = {}
    ctx = EvalContext(signals, now=now, stale_after_s=stale_after_s)
    cond = rule.condition
    memo_key = None if cond.uses_age() else (rule.name, cond.source)
    test = cond.compiled.test
    check = None
    if deadline is not None and timer is not None:
        check = _deadline_check(timer=timer, deadline=deadline)
    try:
        for _ in signals.matches(
            rule.scope,
            ctx,
            fresh_after=now - stale_after_s if rule.scope in HELD_SCOPES else None,
            test=test,
            memo_key=memo_key,
            reads=cond.signals(),
            check=check,
        ):
            target = Target(*target_of(rule.scope, ctx))
            key = (rule.name, target.key)
            prev = old.get(key)
            since = prev.since if prev is not None else now
            value = _number(cond.compiled.value(ctx))
            found[key] = MemoryEntry(
                target=target,
                since=since,
                state="firing" if now - since >= rule.for_s else "pending",
                severity=rule.severity,
                actions=rule.actions,
                summary=_summary(rule, target, value),
                value=value,
                labels=rule.labels,
                cooldown_s=rule.cooldown_s,
            )
    except _OverBudget:
        return None
    return found


class _OverBudget(Exception):
    """A rule's evaluation passed its deadline (raised from its test, caught by its caller)."""


def _deadline_check(*, timer: Callable[[], float], deadline: float) -> Callable[[], None]:
    def check() -> None:
        if timer() > deadline:
            raise _OverBudget

    return check


def _carry(
    rule_name: str,
    old: Mapping[tuple[str, str], MemoryEntry],
    new: dict[tuple[str, str], MemoryEntry],
    decisions: list[Decision],
) -> None:
    """A rule not evaluated this tick: its targets keep their entries and states."""
    for key, entry in old.items():
        if key[0] == rule_name:
            new[key] = entry
            decisions.append(_decision(rule_name, entry, entry.state))


def _node_silent(signals: SignalState, target: Target, fresh_after: float) -> bool:
    node = target.node
    if target.scope == "rank" and target.job is not None and target.rank is not None:
        node = signals.rank_node(target.job, target.rank) or node
    if node is None:
        return False
    t = signals.last_report_at(node)
    # A node the controller no longer knows (forgotten) is gone, not silent: resolve.
    return t is not None and t < fresh_after


def _decision(rule: str, e: MemoryEntry, state: Any) -> Decision:
    return Decision(
        rule=rule,
        target=e.target,
        state=state,
        severity=e.severity,  # type: ignore[arg-type]
        actions=e.actions,
        summary=e.summary,
        value=e.value,
        since=e.since,
        labels=dict(e.labels),
        cooldown_s=e.cooldown_s,
    )


def _number(v: Any) -> float | None:
    if v is None or isinstance(v, str):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _summary(rule: Rule, target: Target, value: float | None) -> str:
    text = f"{target.describe()}: {rule.summary}"
    if value is None:
        return text
    if math.isfinite(value) and value == int(value):
        return f"{text} (value {int(value)})"
    return f"{text} (value {value:.4g})"
