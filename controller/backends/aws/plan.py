"""Which retired nodes' instances are replaced now: a pure planner over the nodes, the steps in
flight and the recent terminations (`plan_terminations`), and the edge that reads them from the
controller and writes one `terminate_instance` row per planned node (`ReplacementPlanner`,
called by the tick).

The budget is the step's own safety rail: at most `max_in_flight` instances out at once (an
open step: terminated, its replacement not yet in service) and at most `replace_max`
terminations in any `replace_window_s`. The row's key names the node and the instance
(`terminate:<node>:<instance>`), so one instance is planned once, whatever became of it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from trainguard.controller.actionkinds import ActionKind
from trainguard.controller.backends.config import INSTANCE_ID, REGION, AwsBackendConfig
from trainguard.controller.nodestate import NodeState
from trainguard.controller.records import NewAction
from trainguard.controller.store import Store

log = logging.getLogger("trainguard.controller.aws")

KEY_PREFIX = "terminate:"
REPLACED = "replaced:"  # how the step closes the old node's record (its drain reason)


def termination_key(node: str, instance_id: str) -> str:
    return f"{KEY_PREFIX}{node}:{instance_id}"


@dataclass(frozen=True)
class CloudNode:
    """What the planner reads of a node."""

    name: str
    state: str
    job: str | None
    labels: Mapping[str, str]
    reason: str | None = None  # its drain reason: `replaced: ...` once its step has ended


@dataclass(frozen=True)
class Termination:
    node: str
    instance_id: str
    region: str
    reason: str

    @property
    def key(self) -> str:
        return termination_key(self.node, self.instance_id)


@dataclass(frozen=True)
class TerminationPlan:
    planned: list[Termination]
    # node -> why it waits (the budget) or is never planned (no or a bad instance id)
    held: dict[str, str]


def plan_terminations(
    nodes: Iterable[CloudNode],
    *,
    config: AwsBackendConfig,
    planned_before: Callable[[str], bool],
    in_flight: int,
    started_in_window: int,
) -> TerminationPlan:
    """The retired nodes (no job, an instance id in their labels, not planned before, not
    closed as replaced) whose instances are terminated now, within the budget, in name
    order."""
    planned: list[Termination] = []
    held: dict[str, str] = {}
    if not config.replace_retired:
        return TerminationPlan(planned=planned, held=held)
    room = min(config.max_in_flight - in_flight, config.replace_max - started_in_window)
    for node in sorted(nodes, key=lambda n: n.name):
        if node.state != NodeState.RETIRED.value or node.job is not None:
            continue
        if (node.reason or "").startswith(REPLACED):
            continue  # its step ended (its row may since have gone with the store's retention)
        instance_id = node.labels.get(config.instance_id_label, "")
        region = node.labels.get(config.region_label) or config.region
        if not instance_id:
            continue  # not a cloud node (or its agent does not say which instance it is)
        if not INSTANCE_ID.fullmatch(instance_id):
            held[node.name] = (
                f"label {config.instance_id_label}={instance_id!r}: not an instance id"
            )
            continue
        if not REGION.fullmatch(region):
            held[node.name] = f"label {config.region_label}={region!r}: not a region name"
            continue
        termination = Termination(
            node=node.name, instance_id=instance_id, region=region, reason="retired"
        )
        if planned_before(termination.key):
            continue
        if len(planned) >= room:
            held[node.name] = (
                f"replacement budget: {in_flight + len(planned)} in flight"
                f" (max_in_flight {config.max_in_flight}), {started_in_window + len(planned)}"
                f" started in the last {config.replace_window_s:g} s"
                f" (replace_max {config.replace_max})"
            )
            continue
        planned.append(termination)
    return TerminationPlan(planned=planned, held=held)


class ReplacementPlanner:
    """The tick's side of cloud replacement: plan, then write the rows (no incident)."""

    def __init__(
        self,
        *,
        store: Store,
        config: AwsBackendConfig,
        nodes: Callable[[], Iterable[CloudNode]],
        wake: Callable[[], None] = lambda: None,
        dry_run: bool = False,
    ) -> None:
        self._store = store
        self._config = config
        self._nodes = nodes
        self._wake = wake
        self._dry_run = dry_run
        self._held: dict[str, str] = {}  # logged once per node and reason
        self._planned: set[str] = set()  # keys known to have a row (one query per key)
        self._lock = threading.Lock()

    def plan(self, *, now: float) -> list[str]:
        """Write a terminate_instance row for each node plan_terminations picks; the keys."""
        with self._lock:
            kind = ActionKind.TERMINATE_INSTANCE.value
            in_flight = sum(1 for a, _ in self._store.actions.open() if a.kind == kind)
            started = self._store.actions.count_keyed_since(
                KEY_PREFIX, since=now - self._config.replace_window_s
            )
            plan = plan_terminations(
                self._nodes(),
                config=self._config,
                planned_before=self._planned_before,
                in_flight=in_flight,
                started_in_window=started,
            )
            held = dict(plan.held)
            planned = plan.planned
            if self._dry_run:  # safety.dry_run: say what would be terminated, do nothing
                held.update({t.node: f"dry run: would terminate {t.instance_id}" for t in planned})
                planned = []
            for node, why in held.items():
                if self._held.get(node) != why:
                    log.warning("event=replacement_held node=%s reason=%r", node, why)
            self._held = held
            written: list[str] = []
            for t in planned:
                self._store.actions.add(
                    None,
                    [
                        NewAction(
                            kind=kind,
                            target=t.node,
                            idempotency_key=t.key,
                            params={
                                "node": t.node,
                                "instance_id": t.instance_id,
                                "region": t.region,
                                "reason": t.reason,
                                "actor": "controller",
                            },
                        )
                    ],
                    ts=now,
                )
                written.append(t.key)
                log.info(
                    "event=replacement_planned node=%s instance=%s region=%s",
                    t.node,
                    t.instance_id,
                    t.region,
                )
            self._planned.update(written)
            if written:
                self._wake()
            return written

    def _planned_before(self, key: str) -> bool:
        if key not in self._planned and self._store.actions.by_key(key) is not None:
            self._planned.add(key)
        return key in self._planned


__all__ = [
    "KEY_PREFIX",
    "REPLACED",
    "CloudNode",
    "ReplacementPlanner",
    "Termination",
    "TerminationPlan",
    "plan_terminations",
    "termination_key",
]
