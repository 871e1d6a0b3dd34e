"""Lemon nodes: a per-node history of hardware incidents, and the verdict that retires a node
that keeps failing (docs/controller.md "Node lifecycle").

A hardware incident is one of the node's incidents whose plan drains it, or whose rule is about
the GPU itself (xid, ecc, dbe, gpu lost), counted from the incidents table within
`lifecycle.lemon_window_s`. A node with `lifecycle.lemon_incidents` or more is a lemon: the
drain step and the spare preflight retire it (reason `lemon: N hardware incidents in D days`)
instead of leaving it drained, the next time it is drained or leaves the spare pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from trainguard.controller.config import LifecycleConfig
from trainguard.controller.store import Store
from trainguard.controller.views import HardwareIncidentView

_DAY_S = 86400.0


@dataclass
class LemonPolicy:
    store: Store
    config: LifecycleConfig
    now: Callable[[], float]

    def history(self, node: str) -> tuple[HardwareIncidentView, ...]:
        """The node's hardware incidents within the window, oldest first."""
        since = self.now() - self.config.lemon_window_s
        return tuple(
            HardwareIncidentView(id=i.id, rule=i.rule, opened_at=i.opened_at, summary=i.summary)
            for i in self.store.incidents.hardware_history(since=since, node=node)
        )

    def counts(self, nodes: list[str]) -> dict[str, int]:
        """Hardware incidents within the window per node (0 for each of `nodes` with none)."""
        since = self.now() - self.config.lemon_window_s
        out = dict.fromkeys(nodes, 0)
        for i in self.store.incidents.hardware_history(since=since):
            if i.node is not None:
                out[i.node] = out.get(i.node, 0) + 1
        return out

    def verdict(self, node: str) -> str | None:
        """The retire reason when `node` is a lemon, else None."""
        limit = self.config.lemon_incidents
        if limit <= 0:
            return None
        n = len(self.history(node))
        if n < limit:
            return None
        return f"lemon: {n} hardware incidents in {self.config.lemon_window_s / _DAY_S:g} days"


__all__ = ["LemonPolicy"]
