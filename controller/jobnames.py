"""The budget of job names a node may introduce, and their expiry.

A report names jobs (its ranks, its processes, its events). A name the controller's job
table holds is known; any other name is *unknown*: the job runs outside the controller, or
the node invents it. Each unknown name a node reports costs one place in that node's budget
(`max_per_node`) and in the controller's (`max_total`) for as long as the node keeps
reporting it; a name beyond either budget is refused (the report is taken without it). A
name no node has reported for `expire_after_s` is expired: its places are freed and the
caller forgets what the live view holds for it.

Pure and O(the report) per `admit`: one ordered map of (node, name) by last report, so
`expire` pops only what expired. Not thread-safe: the report service holds its lock.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from trainguard.protocol import Report

__all__ = ["Admission", "JobNames", "job_names_of", "without_jobs"]

REASON_NODE = "node_budget"
REASON_TOTAL = "total_budget"


@dataclass(frozen=True)
class Admission:
    """What `admit` refused: name -> reason (REASON_NODE or REASON_TOTAL)."""

    refused: dict[str, str]


_ADMITTED = Admission(refused={})


class JobNames:
    """Per-node and total budgets of unknown job names, with expiry (see the module doc)."""

    def __init__(
        self,
        *,
        max_per_node: int,
        max_total: int,
        expire_after_s: float,
        is_known: Callable[[str], bool],
    ) -> None:
        if max_per_node < 0 or max_total < 0:
            raise ValueError("budgets must not be negative")
        if expire_after_s <= 0:
            raise ValueError("expire_after_s must be positive")
        self.max_per_node = max_per_node
        self.max_total = max_total
        self.expire_after_s = expire_after_s
        self._is_known = is_known
        self._last: OrderedDict[tuple[str, str], float] = OrderedDict()  # oldest first
        self._of_node: dict[str, set[str]] = {}  # node -> the unknown names it holds
        self._holders: dict[str, int] = {}  # name -> how many nodes hold it

    def admit(self, node: str, names: Iterable[str], *, now: float) -> Admission:
        """Take the job names of one report of `node` at `now`; say which are refused."""
        refused: dict[str, str] | None = None
        held = self._of_node.get(node)
        for name in names:
            key = (node, name)
            if key in self._last:
                self._last[key] = now
                self._last.move_to_end(key)
                continue
            if self._is_known(name):
                continue
            if (len(held) if held is not None else 0) >= self.max_per_node:
                reason = REASON_NODE
            elif name not in self._holders and len(self._holders) >= self.max_total:
                reason = REASON_TOTAL
            else:
                if held is None:
                    held = self._of_node[node] = set()
                held.add(name)
                self._holders[name] = self._holders.get(name, 0) + 1
                self._last[key] = now
                continue
            if refused is None:
                refused = {}
            refused[name] = reason
        return _ADMITTED if refused is None else Admission(refused=refused)

    def expire(self, *, now: float) -> list[str]:
        """Free the places of names not reported for `expire_after_s`; return the names no
        node holds any more and the job table does not know (the caller forgets them)."""
        gone: list[str] = []
        cutoff = now - self.expire_after_s
        while self._last:
            key, seen_at = next(iter(self._last.items()))
            if seen_at > cutoff:
                break
            del self._last[key]
            node, name = key
            self._release(node, name)
            if name not in self._holders and not self._is_known(name):
                gone.append(name)
        return gone

    def forget_node(self, node: str) -> None:
        """The node was removed: free its places (its names expire as usual)."""
        for name in self._of_node.pop(node, set()):
            self._last.pop((node, name), None)
            self._drop_holder(name)

    def held(self, node: str) -> int:
        """How many unknown names `node` holds now."""
        return len(self._of_node.get(node, ()))

    def total(self) -> int:
        """How many distinct unknown names are held now."""
        return len(self._holders)

    def _release(self, node: str, name: str) -> None:
        held = self._of_node.get(node)
        if held is not None:
            held.discard(name)
            if not held:
                del self._of_node[node]
        self._drop_holder(name)

    def _drop_holder(self, name: str) -> None:
        left = self._holders.get(name, 0) - 1
        if left > 0:
            self._holders[name] = left
        else:
            self._holders.pop(name, None)


def job_names_of(report: Report) -> set[str]:
    """The distinct job names a report speaks of: its ranks, processes and events."""
    names = {r.job for r in report.ranks}
    names.update(p.job for p in report.jobs)
    names.update(e.job for e in report.events if e.job)
    return names


def without_jobs(report: Report, refused: Collection[str]) -> Report:
    """`report` without the ranks and processes of the `refused` job names."""
    return dataclasses.replace(
        report,
        ranks=tuple(r for r in report.ranks if r.job not in refused),
        jobs=tuple(p for p in report.jobs if p.job not in refused),
    )
