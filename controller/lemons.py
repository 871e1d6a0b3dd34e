"""Lemon nodes: a per-node history of hardware incidents, and the verdict that retires a node
that keeps failing (docs/controller.md "Node lifecycle").

A hardware incident is one of the node's incidents whose plan drains it, or whose rule is about
the GPU itself (xid, ecc, dbe, gpu lost), counted from the incidents table within
`lifecycle.lemon_window_s`; a failed repair or post-repair validation of the node lifecycle
(controller.repairplan) counts as one too. A node with `lifecycle.lemon_incidents` or more is
a lemon: the drain step, the spare preflight and a failing lifecycle repair retire it (reason
`lemon: N hardware incidents in D days`) instead of leaving it drained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainguard.controller.config import LifecycleConfig
from trainguard.controller.repairplan import HARDWARE_FAILURE_KEYS
from trainguard.controller.store import Store
from trainguard.controller.views import HardwareIncidentView

_DAY_S = 86400.0


@dataclass
class LemonPolicy:
    store: Store
    config: LifecycleConfig
    now: Callable[[], float]

    def history(self, node: str) -> tuple[HardwareIncidentView, ...]:
        """The node's hardware incidents within the window, oldest first: its incidents, then
        its failed lifecycle repairs (rule `<kind>_failed`, id the step's)."""
        since = self.now() - self.config.lemon_window_s
        incidents = tuple(
            HardwareIncidentView(id=i.id, rule=i.rule, opened_at=i.opened_at, summary=i.summary)
            for i in self.store.incidents.hardware_history(since=since, node=node)
        )
        failed = tuple(
            HardwareIncidentView(
                id=a.id, rule=f"{a.kind}_failed", opened_at=a.created_at, summary=a.result
            )
            for prefix in HARDWARE_FAILURE_KEYS
            for a in self.store.actions.failed_keyed(prefix, since=since, target=node)
        )
        return incidents + tuple(sorted(failed, key=lambda v: (v.opened_at, v.id)))

    def counts(self, nodes: list[str]) -> dict[str, int]:
        """Hardware incidents within the window per node (0 for each of `nodes` with none)."""
        since = self.now() - self.config.lemon_window_s
        out = dict.fromkeys(nodes, 0)
        for i in self.store.incidents.hardware_history(since=since):
            if i.node is not None:
                out[i.node] = out.get(i.node, 0) + 1
        for prefix in HARDWARE_FAILURE_KEYS:
            for a in self.store.actions.failed_keyed(prefix, since=since):
                out[a.target] = out.get(a.target, 0) + 1
        return out

    def verdict(self, node: str, *, failing: int = 0) -> str | None:
        """The retire reason when `node` is a lemon, else None. `failing`: hardware failures
        happening now and not stored yet (a lifecycle step that is failing)."""
        limit = self.config.lemon_incidents
        if limit <= 0:
            return None
        n = len(self.history(node)) + failing
        if n < limit:
            return None
        return f"lemon: {n} hardware incidents in {self.config.lemon_window_s / _DAY_S:g} days"


__all__ = ["LemonPolicy"]
