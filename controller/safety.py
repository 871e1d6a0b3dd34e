"""Safety rails between a decision and an action: silences, the remediation budget, the
circuit breaker, dry-run, the stale-data check and retry backoff.

The verdicts are pure functions of their inputs (tested on a FakeClock); `Safety` reads the
store-backed state they need (silences, recent drains, recent incidents, breaker trips), so
every rail survives a controller restart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from trainguard.controller.config import SafetyConfig
from trainguard.controller.store import Store
from trainguard.controller.views import SilenceView


def stale_drain_reason(
    *,
    rule: str,
    report_age_s: float | None,
    stale_after_s: float,
    exempt_rules: Iterable[str],
) -> str | None:
    """Why a drain for `rule` must not run on this node's data, or None if it may."""
    if rule in set(exempt_rules):
        return None
    if report_age_s is None:
        return "the node never reported; not draining on missing data"
    if report_age_s > stale_after_s:
        return (
            f"the node's data is {report_age_s:.1f} s old (stale_after_s={stale_after_s:g});"
            " not draining on stale data"
        )
    return None


def silence_matches(silence: SilenceView, *, rule: str, node: str | None, now: float) -> bool:
    """A silence matches when active and every coordinate it names equals the incident's."""
    if not silence.active or silence.expires_at <= now:
        return False
    if silence.rule is not None and silence.rule != rule:
        return False
    return not (silence.node is not None and silence.node != node)


def matching_silence(
    silences: Iterable[SilenceView], *, rule: str, node: str | None, now: float
) -> SilenceView | None:
    for s in silences:
        if silence_matches(s, rule=rule, node=node, now=now):
            return s
    return None


@dataclass(frozen=True)
class BudgetVerdict:
    allowed: bool
    used: int
    limit: int
    reason: str = ""


def budget_verdict(*, drains_in_window: int, budget: int, window_s: float) -> BudgetVerdict:
    """May one more automatic drain run, given how many ran within the window?"""
    if drains_in_window < budget:
        return BudgetVerdict(allowed=True, used=drains_in_window, limit=budget)
    return BudgetVerdict(
        allowed=False,
        used=drains_in_window,
        limit=budget,
        reason=(
            f"remediation budget exhausted: {drains_in_window} automatic drains in the last"
            f" {window_s:g} s (budget {budget}); paging instead of draining"
        ),
    )


@dataclass(frozen=True)
class BreakerVerdict:
    open: bool
    first: bool  # this incident trips it (page once); later ones only note it
    nodes: frozenset[str]
    reason: str = ""


def breaker_verdict(
    *,
    rule: str,
    nodes_in_window: Iterable[str],
    threshold: int,
    window_s: float,
    tripped_at: float | None,
    now: float,
) -> BreakerVerdict:
    """More than `threshold` distinct nodes tripping `rule` within the window is a cluster
    problem. Once tripped the breaker stays open for a full window after the trip."""
    nodes = frozenset(nodes_in_window)
    still_open = tripped_at is not None and now - tripped_at < window_s
    if len(nodes) <= threshold and not still_open:
        return BreakerVerdict(open=False, first=False, nodes=nodes)
    reason = (
        f"circuit breaker open for rule {rule}: {len(nodes)} nodes tripped it within"
        f" {window_s:g} s (threshold {threshold}); likely a cluster-wide problem, not draining"
    )
    return BreakerVerdict(open=True, first=not still_open, nodes=nodes, reason=reason)


def backoff_s(attempt: int, *, initial_s: float, max_s: float) -> float:
    """Delay before retry number `attempt` (1 = first retry): doubling, capped."""
    return float(min(max_s, initial_s * (2 ** max(0, attempt - 1))))


class Safety:
    """The store-backed rails, evaluated when an incident opens or an action runs."""

    def __init__(self, store: Store, config: SafetyConfig) -> None:
        self._store = store
        self.config = config
        # Set by the controller once the job table exists: why draining this node would
        # leave its job below min_nodes with nothing to replace it (None = allowed).
        self.job_floor: Callable[[str], str | None] | None = None

    def drain_floor(self, node: str) -> str | None:
        return self.job_floor(node) if self.job_floor is not None else None

    @property
    def dry_run(self) -> bool:
        return self.config.dry_run

    def silence_for(self, *, rule: str, node: str | None, now: float) -> SilenceView | None:
        silences = self._store.silences.find(now=now, include_expired=False)
        return matching_silence(silences, rule=rule, node=node, now=now)

    def budget(self, *, now: float) -> BudgetVerdict:
        window_s = self.config.drain_budget_window_s
        used = self._store.actions.count_auto_drains(since=now - window_s)
        return budget_verdict(
            drains_in_window=used, budget=self.config.drain_budget, window_s=window_s
        )

    def breaker(self, *, rule: str, now: float) -> BreakerVerdict:
        window_s = self.config.breaker_window_s
        nodes = self._store.incidents.nodes_tripping_rule(rule, since=now - window_s)
        trip = self._store.breakers.get(rule)
        return breaker_verdict(
            rule=rule,
            nodes_in_window=nodes,
            threshold=self.config.breaker_threshold,
            window_s=window_s,
            tripped_at=trip[0] if trip else None,
            now=now,
        )

    def record_trip(self, *, rule: str, now: float, incident_id: int, nodes: Iterable[str]) -> None:
        self._store.breakers.trip(rule, tripped_at=now, incident_id=incident_id, nodes=list(nodes))

    def breaker_incident(self, rule: str) -> int | None:
        trip = self._store.breakers.get(rule)
        return trip[1] if trip else None


__all__ = [
    "BreakerVerdict",
    "BudgetVerdict",
    "Safety",
    "backoff_s",
    "breaker_verdict",
    "budget_verdict",
    "matching_silence",
    "silence_matches",
    "stale_drain_reason",
]
