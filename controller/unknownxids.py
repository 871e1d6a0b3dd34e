"""The XID codes each node reported that the XID catalog does not list: how often, first and
last when. A new driver's XID is visible (`agentctl describe node`) before anyone classifies
it; the catalog treats it as informational meanwhile, so no rule acts on it.

Bounded: at most `MAX_CODES_PER_NODE` codes per node (the one seen longest ago gives way to a
new one); nodes are bounded by the inventory. In memory only: a restarted controller rebuilds
it from the acknowledged events it replays (controller.tick). Not thread-safe: callers hold
the live state's lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from trainguard.controller.signals.state import XidCatalog
from trainguard.controller.views import UnknownXidView
from trainguard.protocol import Event, EventKind

__all__ = ["MAX_CODES_PER_NODE", "UnknownXids"]

MAX_CODES_PER_NODE = 16


@dataclass
class _Seen:
    count: int
    first_at: float
    last_at: float


class UnknownXids:
    """node -> unknown XID code -> how often and when it was reported."""

    def __init__(self, *, max_codes_per_node: int = MAX_CODES_PER_NODE) -> None:
        if max_codes_per_node < 1:
            raise ValueError("max_codes_per_node must be at least 1")
        self._max = max_codes_per_node
        # per node, codes in order of their last report, the least recent first
        self._nodes: dict[str, OrderedDict[int, _Seen]] = {}
        self.evicted_total = 0  # codes forgotten to keep a node's record bounded

    def note(self, node: str, code: int, *, at: float) -> None:
        """Node `node` reported XID `code`, which the catalog does not list, at `at`."""
        codes = self._nodes.setdefault(node, OrderedDict())
        seen = codes.get(code)
        if seen is None:
            if len(codes) >= self._max:
                codes.popitem(last=False)
                self.evicted_total += 1
            codes[code] = _Seen(count=1, first_at=at, last_at=at)
            return
        seen.count += 1
        seen.first_at = min(seen.first_at, at)
        seen.last_at = max(seen.last_at, at)
        codes.move_to_end(code)

    def note_event(self, node: str, event: Event, *, catalog: XidCatalog, at: float) -> None:
        """Note `event` if it is an XID whose code `catalog` does not list."""
        if event.kind != EventKind.XID or event.code is None:
            return
        if not catalog.classify(event.code, event.message).known:
            self.note(node, event.code, at=at)

    def of(self, node: str) -> tuple[UnknownXidView, ...]:
        """The node's unknown codes, the most recently reported first."""
        codes = self._nodes.get(node)
        if not codes:
            return ()
        return tuple(
            UnknownXidView(code=code, count=s.count, first_at=s.first_at, last_at=s.last_at)
            for code, s in reversed(codes.items())
        )

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)
