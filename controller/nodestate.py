"""The node state machine: the states of the node table and the moves allowed between them.

Every write of a node's state goes through `check_node_transition` (LiveState.set_node_state);
a move outside `TRANSITIONS` raises InvalidNodeTransition. Setting a node to the state it is
in is always allowed (it only updates the reason). The stored strings are the members'
values. Whether a node in service is a job's node or a hot spare is its role, not its state:
a node that passes validation goes back to `active`, and its role says which pool it is in.
docs/controller.md draws the table.
"""

from __future__ import annotations

from enum import Enum


class NodeState(str, Enum):
    ACTIVE = "active"  # in service: a job's node or a spare, by role
    DRAINING = "draining"  # a drain step asked its job to stop there
    DRAINED = "drained"  # out of service; the reason says why
    DIAGNOSING = "diagnosing"  # a preflight runs to find what is wrong
    REPAIRING = "repairing"  # a GPU reset or a reboot runs
    VALIDATING = "validating"  # a preflight runs to prove it healthy
    RETIRED = "retired"  # out for good (RMA); only an operator brings it back

    @classmethod
    def parse(cls, state: str) -> NodeState | None:
        """The member a stored state names; None for a string outside the table."""
        try:
            return cls(state)
        except ValueError:
            return None

    @property
    def in_service(self) -> bool:
        """May run a job's ranks or be picked as a spare."""
        return self is NodeState.ACTIVE

    @property
    def in_lifecycle(self) -> bool:
        """A step of the node lifecycle owns the node (diagnosing, repairing, validating,
        retired): a scheduler's own drain state does not overwrite it."""
        return self in _LIFECYCLE


_LIFECYCLE = frozenset(
    {NodeState.DIAGNOSING, NodeState.REPAIRING, NodeState.VALIDATING, NodeState.RETIRED}
)

_S = NodeState
# state -> the other states a node in it may move to. Who makes each move:
#   drain step: active -> draining -> drained (active -> drained at once when no job runs or
#     the node is silent); a scheduler's own drain (Slurm) mirrors the same two states
#   undrain (an operator's): draining/drained -> active
#   lifecycle: drained -> diagnosing (preflight) -> repairing (gpu reset / reboot) ->
#     validating (preflight) -> active; nothing to repair: diagnosing -> validating; a failed
#     check or repair: -> drained with the reason; `node return`: drained -> validating
#   retire (an operator's, or the lemon threshold): any -> retired; `node return` of a
#     retired node (back from RMA): retired -> validating
TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    _S.ACTIVE: frozenset({_S.DRAINING, _S.DRAINED, _S.RETIRED}),
    _S.DRAINING: frozenset({_S.DRAINED, _S.ACTIVE, _S.RETIRED}),
    _S.DRAINED: frozenset({_S.DRAINING, _S.ACTIVE, _S.DIAGNOSING, _S.VALIDATING, _S.RETIRED}),
    _S.DIAGNOSING: frozenset({_S.REPAIRING, _S.VALIDATING, _S.DRAINED, _S.RETIRED}),
    _S.REPAIRING: frozenset({_S.VALIDATING, _S.DRAINED, _S.RETIRED}),
    _S.VALIDATING: frozenset({_S.ACTIVE, _S.DRAINED, _S.RETIRED}),
    _S.RETIRED: frozenset({_S.VALIDATING}),
}


class InvalidNodeTransition(ValueError):
    """A write of a node's state that the table does not allow (an undrain of a retired
    node, a race between two steps on one node): the step that tried it fails."""

    def __init__(self, node: str, current: NodeState, wanted: NodeState) -> None:
        allowed = ", ".join(s.value for s in NodeState if s in TRANSITIONS[current]) or "nothing"
        super().__init__(
            f"node {node}: cannot go from {current.value} to {wanted.value}"
            f" (from {current.value} it may go to {allowed})"
        )
        self.node = node
        self.current = current
        self.wanted = wanted


def check_node_transition(node: str, current: NodeState, wanted: NodeState) -> None:
    """Raise InvalidNodeTransition unless `current` may move to `wanted` (or equals it)."""
    if wanted != current and wanted not in TRANSITIONS[current]:
        raise InvalidNodeTransition(node, current, wanted)


def node_state_values() -> tuple[str, ...]:
    """Every state's stored string, in table order (the schema's CHECK, the metric's label
    values)."""
    return tuple(s.value for s in NodeState)


__all__ = [
    "TRANSITIONS",
    "InvalidNodeTransition",
    "NodeState",
    "check_node_transition",
    "node_state_values",
]
