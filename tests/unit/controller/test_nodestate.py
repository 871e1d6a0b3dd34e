"""Node states move only along the transition table: LiveState.set_node_state refuses a move
the table does not hold, with a message naming the node, both states and what was allowed,
and leaves the stored node as it was; the drain backend leaves a node the lifecycle holds
alone; a store made before the lifecycle's states migrates with its nodes kept."""

from __future__ import annotations

import itertools

import pytest

from tests.unit.controller.job_sim import Sim
from trainguard.controller.actions.base import PermanentError
from trainguard.controller.actions.drain import LocalDrainBackend
from trainguard.controller.nodestate import (
    TRANSITIONS,
    InvalidNodeTransition,
    NodeState,
    check_node_transition,
    node_state_values,
)
from trainguard.controller.store import Store
from trainguard.controller.store import schema as store_schema

S = NodeState
# a legal way to each state from a new node (active)
PATHS: dict[NodeState, tuple[NodeState, ...]] = {
    S.ACTIVE: (),
    S.DRAINING: (S.DRAINING,),
    S.DRAINED: (S.DRAINED,),
    S.DIAGNOSING: (S.DRAINED, S.DIAGNOSING),
    S.REPAIRING: (S.DRAINED, S.DIAGNOSING, S.REPAIRING),
    S.VALIDATING: (S.DRAINED, S.VALIDATING),
    S.RETIRED: (S.RETIRED,),
}
# every move the table allows, spelled out: a change to the table changes this test
ALLOWED = {
    (S.ACTIVE, S.DRAINING),
    (S.ACTIVE, S.DRAINED),
    (S.ACTIVE, S.RETIRED),
    (S.DRAINING, S.DRAINED),
    (S.DRAINING, S.ACTIVE),
    (S.DRAINING, S.RETIRED),
    (S.DRAINED, S.DRAINING),
    (S.DRAINED, S.ACTIVE),
    (S.DRAINED, S.DIAGNOSING),
    (S.DRAINED, S.VALIDATING),
    (S.DRAINED, S.RETIRED),
    (S.DIAGNOSING, S.REPAIRING),
    (S.DIAGNOSING, S.VALIDATING),
    (S.DIAGNOSING, S.DRAINED),
    (S.DIAGNOSING, S.RETIRED),
    (S.REPAIRING, S.VALIDATING),
    (S.REPAIRING, S.DRAINED),
    (S.REPAIRING, S.RETIRED),
    (S.VALIDATING, S.ACTIVE),
    (S.VALIDATING, S.DRAINED),
    (S.VALIDATING, S.RETIRED),
    (S.RETIRED, S.VALIDATING),
}
MOVES = [(a, b) for a, b in itertools.product(NodeState, NodeState) if a != b]


def _node_in(sim: Sim, state: NodeState) -> None:
    sim.add("n1")
    for step in PATHS[state]:
        sim.c.live.set_node_state("n1", step.value, reason=f"to {step.value}")
    assert sim.c.live.node_state("n1") == state.value


def test_the_table_has_a_row_for_every_state() -> None:
    assert set(TRANSITIONS) == set(NodeState)
    for state, targets in TRANSITIONS.items():
        assert state not in targets  # staying put is always allowed, never listed


def test_the_stored_strings_are_the_drain_states_and_the_lifecycle_s() -> None:
    assert node_state_values() == (
        "active",
        "draining",
        "drained",
        "diagnosing",
        "repairing",
        "validating",
        "retired",
    )


def test_only_active_is_in_service_and_the_lifecycle_owns_four_states() -> None:
    assert [s for s in NodeState if s.in_service] == [S.ACTIVE]
    assert {s for s in NodeState if s.in_lifecycle} == {
        S.DIAGNOSING,
        S.REPAIRING,
        S.VALIDATING,
        S.RETIRED,
    }


def test_every_state_can_be_left_for_retirement_except_retired_itself() -> None:
    assert all(S.RETIRED in TRANSITIONS[s] for s in NodeState if s is not S.RETIRED)


@pytest.mark.parametrize(
    ("current", "wanted"), MOVES, ids=[f"{a.value}-{b.value}" for a, b in MOVES]
)
def test_check_allows_exactly_the_table_s_moves(current: NodeState, wanted: NodeState) -> None:
    if (current, wanted) in ALLOWED:
        check_node_transition("n1", current, wanted)
    else:
        with pytest.raises(InvalidNodeTransition) as e:
            check_node_transition("n1", current, wanted)
        assert e.value.current is current and e.value.wanted is wanted


def test_staying_in_a_state_is_always_allowed() -> None:
    for state in NodeState:
        check_node_transition("n1", state, state)


def test_the_refusal_names_the_node_both_states_and_what_is_allowed() -> None:
    with pytest.raises(InvalidNodeTransition) as e:
        check_node_transition("gpu-7", S.RETIRED, S.ACTIVE)
    assert str(e.value) == (
        "node gpu-7: cannot go from retired to active (from retired it may go to validating)"
    )


@pytest.mark.parametrize("state", list(NodeState), ids=lambda s: s.value)
def test_set_node_state_reaches_each_state_along_the_table(sim: Sim, state: NodeState) -> None:
    _node_in(sim, state)
    assert sim.c.store.nodes.get("n1").state == state.value  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("current", "wanted"),
    [(S.RETIRED, S.ACTIVE), (S.ACTIVE, S.VALIDATING), (S.REPAIRING, S.ACTIVE)],
    ids=["retired-active", "active-validating", "repairing-active"],
)
def test_set_node_state_refuses_a_move_and_keeps_the_stored_node(
    sim: Sim, current: NodeState, wanted: NodeState
) -> None:
    _node_in(sim, current)
    with pytest.raises(InvalidNodeTransition):
        sim.c.live.set_node_state("n1", wanted.value, reason="nope")
    stored = sim.c.store.nodes.get("n1")
    assert stored is not None and stored.state == current.value
    assert sim.c.live.node_state("n1") == current.value


def test_set_node_state_of_an_unknown_node_is_a_key_error(sim: Sim) -> None:
    with pytest.raises(KeyError):
        sim.c.live.set_node_state("ghost", "drained", reason="x")


@pytest.mark.parametrize("state", [S.DIAGNOSING, S.REPAIRING, S.VALIDATING, S.RETIRED])
def test_local_drain_leaves_a_node_the_lifecycle_holds_as_it_is(sim: Sim, state: NodeState) -> None:
    _node_in(sim, state)
    backend = LocalDrainBackend(sim.c.live)
    reached, data = backend.drain("n1", reason="again", key="k")
    assert reached == "drained" and state.value in data["note"]
    assert backend.poll("n1", key="k", progress={}) == "drained"
    assert sim.c.live.node_state("n1") == state.value
    with pytest.raises(PermanentError, match="node return"):
        backend.undrain("n1", key="k")
    assert sim.c.live.node_state("n1") == state.value


def test_a_store_made_before_the_lifecycle_migrates_with_its_nodes(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "old.db")
    monkeypatch.setattr(store_schema, "MIGRATIONS", store_schema.MIGRATIONS[:5])
    monkeypatch.setattr(store_schema, "SCHEMA_VERSION", 5)
    old = Store(path, now=lambda: 1000.0)
    old.nodes.add("n1", role="spare", labels={"rack": "r1"})
    old.nodes.update("n1", state="drained", drain_reason="xid 79")
    with pytest.raises(Exception, match="CHECK"):
        old.nodes.update("n1", state="retired")
    old.close()
    monkeypatch.undo()
    s = Store(path, now=lambda: 1000.0)
    assert s.schema_version() == store_schema.SCHEMA_VERSION
    node = s.nodes.get("n1")
    assert node is not None
    assert (node.role, node.state, node.drain_reason, node.labels) == (
        "spare",
        "drained",
        "xid 79",
        {"rack": "r1"},
    )
    assert s.nodes.update("n1", state="retired", drain_reason="rma").state == "retired"
    with pytest.raises(Exception, match="CHECK"):
        s.nodes.update("n1", state="broken")
    s.close()
