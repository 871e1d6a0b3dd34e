"""Safety rails as pure functions, and their store-backed state on a FakeClock."""

from __future__ import annotations

import pytest

from trainguard.clock import FakeClock
from trainguard.controller.config import SafetyConfig
from trainguard.controller.records import NewAction
from trainguard.controller.safety import (
    Safety,
    backoff_s,
    breaker_verdict,
    budget_verdict,
    matching_silence,
    stale_drain_reason,
)
from trainguard.controller.store import Store
from trainguard.controller.views import SilenceView


@pytest.mark.parametrize(
    ("rule", "age_s", "blocked"),
    [
        ("gpu_dbe", 3.0, False),
        ("gpu_dbe", 11.0, True),
        ("gpu_dbe", None, True),
        ("node_silent", 600.0, False),
    ],
    ids=["fresh", "stale", "never-reported", "exempt-rule"],
)
def test_stale_drain_reason(rule, age_s, blocked):
    why = stale_drain_reason(
        rule=rule, report_age_s=age_s, stale_after_s=10.0, exempt_rules=["node_silent"]
    )
    assert (why is not None) == blocked


def _silence(rule=None, node=None, expires_at=100.0, active=True) -> SilenceView:
    return SilenceView(
        id=1,
        rule=rule,
        node=node,
        created_by="op",
        created_at=0.0,
        expires_at=expires_at,
        active=active,
    )


@pytest.mark.parametrize(
    ("silence", "rule", "node", "matches"),
    [
        (_silence(rule="r"), "r", "n1", True),
        (_silence(rule="r"), "other", "n1", False),
        (_silence(node="n1"), "any", "n1", True),
        (_silence(node="n1"), "any", "n2", False),
        (_silence(rule="r", node="n1"), "r", "n2", False),
        (_silence(rule="r", node="n1"), "r", "n1", True),
        (_silence(rule="r", expires_at=50.0), "r", "n1", False),
    ],
    ids=["rule", "other-rule", "node", "other-node", "both-node-differs", "both", "expired"],
)
def test_silence_matching(silence, rule, node, matches):
    found = matching_silence([silence], rule=rule, node=node, now=60.0)
    assert (found is not None) == matches


def test_budget_allows_until_exhausted():
    assert budget_verdict(drains_in_window=1, budget=2, window_s=3600).allowed
    verdict = budget_verdict(drains_in_window=2, budget=2, window_s=3600)
    assert not verdict.allowed and "budget exhausted" in verdict.reason


def test_breaker_opens_above_threshold_and_stays_open_for_a_window():
    closed = breaker_verdict(
        rule="r", nodes_in_window={"a", "b"}, threshold=2, window_s=600, tripped_at=None, now=0
    )
    assert not closed.open
    tripped = breaker_verdict(
        rule="r", nodes_in_window={"a", "b", "c"}, threshold=2, window_s=600, tripped_at=None, now=0
    )
    assert tripped.open and tripped.first
    later = breaker_verdict(
        rule="r", nodes_in_window={"d"}, threshold=2, window_s=600, tripped_at=0, now=300
    )
    assert later.open and not later.first
    over = breaker_verdict(
        rule="r", nodes_in_window={"d"}, threshold=2, window_s=600, tripped_at=0, now=601
    )
    assert not over.open


def test_backoff_doubles_and_caps():
    assert [backoff_s(n, initial_s=2, max_s=10) for n in (1, 2, 3, 4, 5)] == [2, 4, 8, 10, 10]


def test_budget_window_slides_with_the_clock(tmp_path):
    clock = FakeClock()
    store = Store(tmp_path / "c.db", now=clock.now)
    safety = Safety(store, SafetyConfig(drain_budget=1, drain_budget_window_s=3600))
    incident = store.incidents.create(
        rule="r",
        target_key="node:n1",
        target={"scope": "node", "node": "n1"},
        target_text="n1",
        severity="critical",
        summary="",
        node="n1",
        job=None,
        ts=clock.now(),
        timeline=[],
    )
    store.actions.add(
        incident, [NewAction(kind="drain", target="n1", idempotency_key="k")], ts=clock.now()
    )
    assert not safety.budget(now=clock.now()).allowed
    clock.advance(3601)
    assert safety.budget(now=clock.now()).allowed


def test_breaker_state_survives_reopening_the_store(tmp_path):
    clock = FakeClock()
    store = Store(tmp_path / "c.db", now=clock.now)
    Safety(store, SafetyConfig()).record_trip(rule="r", now=clock.now(), incident_id=7, nodes=["a"])
    store.close()
    again = Safety(Store(tmp_path / "c.db", now=clock.now), SafetyConfig(breaker_window_s=600))
    verdict = again.breaker(rule="r", now=clock.now() + 10)
    assert verdict.open and not verdict.first and again.breaker_incident("r") == 7
