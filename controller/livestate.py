"""The controller's in-memory view of its nodes, under one lock: records, freshness, pending
commands, the jobs seen in heartbeats; and the gate through which the SignalState changes.

The store is written when a node record changes; freshness (last report time, agent
version, labels) is kept here and written in one batch per tick (`flush`). A SignalState
change made while a tick evaluates rules is queued, whole, and applied in order after it
(`change_signals`, `begin_evaluation`, `end_evaluation`), so the engine sees one consistent
state and a report never waits for an evaluation. This object is also what the job manager
(NodeAccess) and the local drain backend (NodeOps) use to read and change nodes.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from trainguard.clock import Clock
from trainguard.command_args import CommandArgs, command_kind
from trainguard.controller.nodestate import NodeState, check_node_transition
from trainguard.controller.records import CommandRecord, FreshNode, NodeRecord
from trainguard.controller.signals import SignalState
from trainguard.controller.store import Store
from trainguard.controller.unknownxids import UnknownXids
from trainguard.protocol import to_wire

__all__ = ["JobSeen", "LiveState"]

log = logging.getLogger("trainguard.controller")

_DEFERRED_BATCH = 64  # queued SignalState changes applied per lock hold after a tick


@dataclass
class JobSeen:
    """A job as its ranks' heartbeats show it (it may have been started outside the
    controller): the nodes its ranks run on, each rank's step, the newest checkpoint step."""

    nodes: set[str] = field(default_factory=set)
    # node -> rank -> step, as the node's last report naming the job had them (bounded by it)
    ranks_of: dict[str, dict[int, int]] = field(default_factory=dict)
    ckpt_step: int | None = None

    @property
    def ranks(self) -> dict[int, int]:
        """rank -> step, over every node."""
        merged: dict[int, int] = {}
        for ranks in self.ranks_of.values():
            merged.update(ranks)
        return merged


def _run_deferred(fn: Callable[[], None]) -> None:
    # one bad report must not leave every later one queued behind it
    try:
        fn()
    except Exception:
        log.exception("event=deferred_signal_update_error")


class LiveState:
    """Node state shared by the controller's services. The containers are created once and
    only changed in place (services keep references to them); hold `lock` to touch them."""

    def __init__(self, *, store: Store, signals: SignalState, clock: Clock) -> None:
        self.lock = threading.RLock()
        self.store = store
        self.signals = signals
        self._clock = clock
        self.nodes: dict[str, NodeRecord] = {n.name: n for n in store.nodes.all()}
        self.last_seen: dict[str, float] = {
            n.name: n.last_report_at for n in self.nodes.values() if n.last_report_at
        }
        self.fresh: dict[str, FreshNode] = {}
        self.node_jobs: dict[str, str | None] = {}
        self.hw_counts: dict[str, tuple[int, int]] = {}  # node -> (gpus, ib ports)
        self.unknown_xids = UnknownXids()  # XID codes the catalog does not list, per node
        self.jobs_seen: dict[str, JobSeen] = {}
        self.pending: dict[str, list[CommandRecord]] = {}
        self.reported: set[str] = set()  # nodes that reported since this process started
        # node -> when the controller resumed from a stall it was reporting before: its age
        # counts from then (`resume_ages`, controller.stallguard)
        self._ages_from: dict[str, float] = {}
        # SignalState changes queued while a tick evaluates (see `change_signals`)
        self._evaluating = False
        self._deferred: list[Callable[[], None]] = []
        for cmd in store.commands.pending():
            self.pending.setdefault(cmd.node, []).append(cmd)
        for n in self.nodes.values():
            signals.set_node_meta(n.name, role=n.role, state=n.state, job=n.job)

    # --- the SignalState gate -------------------------------------------------------------

    def change_signals(self, fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Change the SignalState now, or after the running evaluation. Caller holds lock."""
        if self._evaluating:
            self._deferred.append(functools.partial(fn, *args, **kwargs))
        else:
            fn(*args, **kwargs)

    def begin_evaluation(self) -> None:
        """Queue SignalState changes from now on (the tick evaluates). Caller holds lock."""
        self._evaluating = True

    def end_evaluation(self) -> None:
        """Apply the changes queued during an evaluation, in order, then stop queueing.

        Only the tick thread changes the SignalState while an evaluation runs, so what was
        queued when it ended is applied in batches without the lock: ingest goes on
        appending behind it meanwhile. What arrived during that catch-up is applied under the
        lock, which bounds the work even when reports arrive faster than this thread applies
        them (it would never catch up otherwise)."""
        with self.lock:
            backlog = len(self._deferred)
        done = 0
        while done < backlog:
            with self.lock:
                batch = self._deferred[done : done + _DEFERRED_BATCH]
            for fn in batch:
                _run_deferred(fn)
            done += len(batch)
        with self.lock:
            rest = self._deferred[done:]
            self._deferred = []
            for fn in rest:
                _run_deferred(fn)
            self._evaluating = False

    # --- records and freshness ------------------------------------------------------------

    def put_node(self, rec: NodeRecord) -> None:
        """Hold `rec` as the node's record and tell the SignalState. Caller holds lock."""
        self.nodes[rec.name] = rec
        self.change_signals(
            self.signals.set_node_meta, rec.name, role=rec.role, state=rec.state, job=rec.job
        )

    def set_job_meta(self, job: str, nodes: tuple[str, ...], state: str) -> None:
        """A job's nodes or state changed (the job manager's `on_state`)."""
        with self.lock:
            self.change_signals(self.signals.set_job_meta, job, nodes=nodes, state=state)

    def flush(self) -> None:
        """Write the freshness gathered since the last flush, in one batch."""
        with self.lock:
            batch = list(self.fresh.values())
            self.fresh.clear()
        if batch:
            self.store.nodes.flush_freshness(batch)

    def drop_pending(self, node: str, ids: set[str]) -> None:
        """Forget pending commands `ids` of `node` (done or timed out). Caller holds lock."""
        cmds = self.pending.get(node)
        if cmds:
            left = [c for c in cmds if c.id not in ids]
            if left:
                self.pending[node] = left
            else:
                del self.pending[node]

    # --- NodeAccess (job manager) and NodeOps (local drain backend) ---------------------------

    def node_record(self, node: str) -> NodeRecord | None:
        with self.lock:
            return self.nodes.get(node)

    def all_nodes(self) -> list[NodeRecord]:
        with self.lock:
            return list(self.nodes.values())

    def nodes_known(self) -> Iterable[str]:
        with self.lock:
            return sorted(self.nodes)

    def refresh_node(self, node: str) -> None:
        rec = self.store.nodes.get(node)
        if rec is None:
            return
        with self.lock:
            self.put_node(rec)

    def node_state(self, node: str) -> str | None:
        with self.lock:
            rec = self.nodes.get(node)
        return rec.state if rec else None

    def node_role(self, node: str) -> str | None:
        with self.lock:
            rec = self.nodes.get(node)
        return rec.role if rec else None

    def node_job(self, node: str) -> str | None:
        with self.lock:
            job = self.node_jobs.get(node)
            rec = self.nodes.get(node)
        return job or (rec.job if rec else None)

    def report_age_s(self, node: str) -> float | None:
        with self.lock:
            t = self.last_seen.get(node)
            if t is not None:
                t = max(t, self._ages_from.get(node, t))
        return None if t is None else max(0.0, self._clock.now() - t)

    def resume_ages(self, *, at: float, reported_since: float) -> list[str]:
        """The controller stalled until `at` (controller.stallguard): every node that had
        reported since `reported_since` has its report age (here and in the SignalState: its
        ranks' heartbeat and step ages too) counted from `at`. Returns those nodes."""
        with self.lock:
            resumed = [n for n, t in self.last_seen.items() if reported_since <= t < at]
            for n in resumed:
                self._ages_from[n] = at
            self.change_signals(self.signals.resume_ages, at=at, reported_since=reported_since)
        return sorted(resumed)

    def set_node_state(self, node: str, state: str, *, reason: str | None) -> None:
        """Move the node to `state` (a NodeState value); InvalidNodeTransition for a move the
        table does not allow, KeyError for an unknown node."""
        wanted = NodeState(state)
        with self.lock:
            held = self.nodes.get(node) or self.store.nodes.get(node)
            if held is None:
                raise KeyError(node)
            current = NodeState.parse(held.state)
            if current is not None:
                check_node_transition(node, current, wanted)
            rec = self.store.nodes.update(node, state=wanted.value, drain_reason=reason)
            self.put_node(rec)
        log.info("event=node_state node=%s state=%s", node, state)

    def queue_command(self, node: str, args: CommandArgs, *, command_id: str) -> None:
        kind = command_kind(args)
        if self.store.commands.add(command_id, node=node, kind=kind, args=to_wire(args)):
            record = self.store.commands.get(command_id)
            assert record is not None
            with self.lock:
                self.pending.setdefault(node, []).append(record)
            log.info("event=command_queued command=%s node=%s kind=%s", command_id, node, kind)

    def command_status(self, command_id: str) -> CommandRecord | None:
        return self.store.commands.get(command_id)

    def pending_commands(self, node: str) -> list[CommandRecord]:
        with self.lock:
            return list(self.pending.get(node, ()))
