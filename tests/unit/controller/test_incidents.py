"""Incident lifecycle: the transition table (every pair) and the manager's planning."""

from __future__ import annotations

import itertools

import pytest

from tests.builders import Reporter
from trainguard.controller.incidents import TRANSITIONS, InvalidTransition, check_transition

STATES = ("open", "acting", "mitigated", "resolved", "suppressed")
ALLOWED = {
    ("open", "acting"),
    ("open", "resolved"),
    ("open", "suppressed"),
    ("acting", "mitigated"),
    ("acting", "resolved"),
    ("mitigated", "resolved"),
    ("suppressed", "resolved"),
}


@pytest.mark.parametrize(
    ("current", "wanted"),
    list(itertools.product(STATES, STATES)),
    ids=[f"{a}-to-{b}" for a, b in itertools.product(STATES, STATES)],
)
def test_transition_table(current, wanted):
    if (current, wanted) in ALLOWED:
        check_transition(1, current, wanted)
    else:
        with pytest.raises(InvalidTransition, match=f"cannot go from {current} to {wanted}"):
            check_transition(1, current, wanted)


def test_table_covers_every_state():
    assert set(TRANSITIONS) == set(STATES)


def test_manager_refuses_an_illegal_move(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now(), dbe=1), actor="a")
    c.tick()
    (incident,) = c.list_incidents()
    assert incident.state == "mitigated"
    with pytest.raises(InvalidTransition):
        c.incidents.transition(incident.id, "acting", now=core_clock.now(), message="no")
