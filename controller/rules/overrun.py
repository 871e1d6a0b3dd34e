"""Rules that overrun their evaluation budget at run time: counted per tick, disabled after
`overrun_ticks` in a row, and reported as one controller-level incident per rule.

The load-time cost model (cost.py) is a worst case for a configured cluster size; this is
the measurement. A rule cut at its budget in `overrun_ticks` consecutive ticks is disabled:
the engine skips it (its targets keep their state) until the rules are reloaded, and an
incident on the rule (target scope "controller") notifies whoever gets its severity. Pure:
the tick passes what the engine measured (`EvalTiming`) and applies what comes back.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.controller.model import Decision, Target
from trainguard.controller.rules.engine import EvalTiming
from trainguard.controller.rules.loader import Rule

__all__ = ["CONTROLLER_TARGET", "Disabled", "OverrunGuard", "disabled_decision"]

# What a rule-disabled incident is about: the controller itself (one per rule: the incident's
# rule is the disabled rule's name).
CONTROLLER_TARGET = Target(scope="controller")


@dataclass(frozen=True)
class Disabled:
    """A rule disabled for overrunning: when, and what its last evaluation took."""

    rule: str
    at: float  # unix s
    spent_s: float
    budget_s: float
    ticks: int


class OverrunGuard:
    """Consecutive overrunning ticks per rule and the rules disabled for it."""

    def __init__(self, *, overrun_ticks: int) -> None:
        self._overrun_ticks = overrun_ticks
        self._streak: dict[str, int] = {}
        self._disabled: dict[str, Disabled] = {}

    @property
    def skip(self) -> frozenset[str]:
        """The disabled rules: the engine does not evaluate them."""
        return frozenset(self._disabled)

    def disabled(self) -> list[Disabled]:
        return list(self._disabled.values())

    def observe(self, timing: EvalTiming, *, now: float) -> list[Disabled]:
        """Count this tick's overruns (rules cut at their budget); returns the rules this tick
        disabled. A rule that finished within budget starts its count again; a rule deferred
        (the tick's budget was spent before it) keeps its count."""
        newly: list[Disabled] = []
        for name in timing.spent_s:
            if name not in timing.cut:
                self._streak.pop(name, None)
                continue
            streak = self._streak.get(name, 0) + 1
            self._streak[name] = streak
            if streak >= self._overrun_ticks and name not in self._disabled:
                gone = Disabled(
                    rule=name,
                    at=now,
                    spent_s=timing.spent_s[name],
                    budget_s=timing.rule_budget_s,
                    ticks=streak,
                )
                self._disabled[name] = gone
                newly.append(gone)
        return newly

    def reset(self) -> list[Disabled]:
        """Forget every count and re-enable every rule (a rules reload); returns the rules that
        were disabled, whose incidents the reload resolves."""
        was = list(self._disabled.values())
        self._streak.clear()
        self._disabled.clear()
        return was


def disabled_decision(gone: Disabled, *, rule: Rule | None, state: str = "firing") -> Decision:
    """The decision that opens (firing) or resolves the incident on a disabled rule: at least
    a warning (a critical rule's severity stays), notify only (nothing to remediate)."""
    severity = "critical" if rule is not None and rule.severity == "critical" else "warning"
    summary = (
        f"rule {gone.rule} disabled: its evaluation overran its {gone.budget_s:g} s budget"
        f" {gone.ticks} ticks in a row (last {gone.spent_s:.3g} s); it is not evaluated until"
        " the rules are reloaded (fix or narrow it, see rule_budget in docs/controller.md)"
    )
    return Decision(
        rule=gone.rule,
        target=CONTROLLER_TARGET,
        state=state,  # type: ignore[arg-type]
        severity=severity,  # type: ignore[arg-type]
        actions=("notify",),
        summary=summary,
        value=gone.spent_s,
        since=gone.at,
    )
