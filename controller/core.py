"""The Controller: ingest of agent reports, the evaluation tick, incidents, the action worker
and every ControllerService call the API makes.

Hot path: `ingest_report` runs ~2,048 times a second. It writes nothing per report: freshness
lives in memory and is flushed in one batch per tick; only a report carrying new events
writes (one small transaction). Commands ride on the response until a `command_result`
event for their id arrives, so a lost response never loses a command.

Delta reports: an agent that sends `full` may send only what changed since the report the
controller last applied for its instance (`base_seq`); the SignalState keeps the merged
snapshot. A delta the controller cannot apply on top of what it holds (a new controller
process, another instance, a base that is not the last report applied) is still applied for
what it lists, and the response asks for a full report (`want_full`).

Threads: `start()` runs a tick thread (evaluation every tick_interval_s) and an action
worker thread (so a slow webhook never delays detection). In-memory state is guarded by one
lock; the store has its own. Rule evaluation does not hold that lock: while it runs, every
change to the SignalState (reports above all) is queued, whole, and applied in order after
it, so the engine sees one consistent state and never half a report, and ingest never waits
for a tick.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.controller.actions.base import ActionHandler, HandlerRegistry
from trainguard.controller.actions.drain import (
    DrainBackend,
    DrainHandler,
    LocalDrainBackend,
    UndrainHandler,
)
from trainguard.controller.actions.notify import (
    Notifier,
    NotifyHandler,
    build_notifiers,
    channels_for,
)
from trainguard.controller.actions.worker import ActionRunner
from trainguard.controller.config import ControllerConfig
from trainguard.controller.errors import BadRequest, Conflict, NotFound
from trainguard.controller.incidents import IncidentManager
from trainguard.controller.jobs import JobManager, JobSpec
from trainguard.controller.metrics import DEFAULT_SPARE_POOL, ControllerMetrics
from trainguard.controller.model import Decision, Target
from trainguard.controller.safety import Safety
from trainguard.controller.store import (
    CommandRecord,
    CommandResultRow,
    FreshNode,
    NewAction,
    NodeRecord,
    Store,
    StoreError,
)
from trainguard.controller.views import (
    ActionView,
    AuditEntry,
    IncidentDetail,
    IncidentView,
    JobView,
    NodeRole,
    NodeView,
    SilenceView,
)
from trainguard.protocol import Command, FaultSpec, Report, ReportResponse, to_wire
from trainguard.strict import ConfigError

log = logging.getLogger("trainguard.controller")

_RUNNING_JOB_STATES = ("starting", "running", "stopping")
# command_result fields the commands table has columns for; the rest is the result's data
_RESULT_FIELDS = frozenset({"command_id", "kind", "ok", "message"})
_DEFERRED_BATCH = 64  # queued SignalState changes applied per lock hold after a tick


@dataclass
class ActionBackends:
    """Injectable action backends (tests pass recording fakes).

    notifiers None: built from config.notify. drain None: the local backend over this
    controller. handlers: extra step handlers (checkpoint, replace, restart, ...) registered
    over the unavailable defaults.
    """

    notifiers: list[Notifier] | None = None
    drain: DrainBackend | None = None
    handlers: list[ActionHandler] = field(default_factory=list)


@dataclass
class _JobSeen:
    nodes: set[str] = field(default_factory=set)
    ranks: dict[int, int] = field(default_factory=dict)  # rank -> step
    ckpt_step: int | None = None


def _run_deferred(fn: Callable[[], None]) -> None:
    # one bad report must not leave every later one queued behind it
    try:
        fn()
    except Exception:
        log.exception("event=deferred_signal_update_error")


class Controller:
    """Implements controller.service.ControllerService."""

    def __init__(
        self,
        config: ControllerConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        backends: ActionBackends | None = None,
    ) -> None:
        from trainguard.controller.rules.engine import EngineMemory  # noqa: PLC0415
        from trainguard.controller.signals import SignalState  # noqa: PLC0415

        self.config = config
        self.clock = clock
        self.metrics = ControllerMetrics()
        backends = backends or ActionBackends()
        self._lock = threading.RLock()
        # SignalState changes queued while a tick evaluates (see `_signals_do`)
        self._evaluating = False
        self._deferred: list[Callable[[], None]] = []
        self._tick_lock = threading.Lock()  # one evaluation at a time
        try:
            self.store = Store(config.store.path, now=clock.now)
        except StoreError as e:
            # a store the controller cannot use is a deployment problem: exit as bad config
            raise ConfigError("", "store.path", str(e)) from None
        self._rules = self._load_rules()
        self.metrics.known_rules(self._rules.names())
        self.signals = SignalState(xid_catalog=self._load_xid_catalog(), history_s=config.history_s)
        self.signals.track(self._rules.history_needs())
        self._memory = EngineMemory()

        # in-memory node state (the store is written on change, freshness in batches)
        self._nodes: dict[str, NodeRecord] = {n.name: n for n in self.store.list_nodes()}
        self._last_seen: dict[str, float] = {
            n.name: n.last_report_at for n in self._nodes.values() if n.last_report_at
        }
        self._fresh: dict[str, FreshNode] = {}
        self._hwm: dict[str, tuple[str, int]] = {}  # node -> (instance, highest stored id)
        self._node_jobs: dict[str, str | None] = {}
        self._hw_counts: dict[str, tuple[int, int]] = {}  # node -> (gpus, ib ports)
        # node -> (instance, seq of the last report applied whole, None: a full one is needed)
        self._delta_base: dict[str, tuple[str, int | None]] = {}
        self._jobs_seen: dict[str, _JobSeen] = {}
        self._pending: dict[str, list[CommandRecord]] = {}
        for cmd in self.store.pending_commands():
            self._pending.setdefault(cmd.node, []).append(cmd)
        for n in self._nodes.values():
            self.signals.set_node_meta(n.name, role=n.role, state=n.state, job=n.job)

        # jobs (the job table + the live view of ranks and launches)
        self.jobs = JobManager(
            store=self.store,
            nodes=self,
            config=config.jobs,
            node_silent_after_s=config.node_silent_after_s,
            clock_now=clock.now,
            on_state=self._job_state_changed,
        )

        # actions
        self.notifiers = (
            backends.notifiers if backends.notifiers is not None else build_notifiers(config.notify)
        )
        self.registry = HandlerRegistry()
        self.registry.register(
            NotifyHandler(
                notifiers={n.channel: n for n in self.notifiers},
                base_url=config.notify.base_url,
                on_failure=self._notification_failed,
            )
        )
        drain_backend = backends.drain or LocalDrainBackend(
            self,
            stop_grace_s=config.actions.drain_stop_grace_s,
            silent_after_s=config.node_silent_after_s,
        )
        self.registry.register(
            DrainHandler(
                backend=drain_backend,
                ops=self,
                stale_after_s=config.stale_after_s,
                stale_exempt_rules=tuple(config.safety.stale_exempt_rules),
            )
        )
        self.registry.register(UndrainHandler(backend=drain_backend))
        from trainguard.controller.actions.jobsteps import job_handlers  # noqa: PLC0415

        for job_handler in job_handlers(
            self.jobs,
            open_incident_nodes=lambda: set(self.store.open_incident_counts()),
            observe=self._observe_recovery,
        ):
            self.registry.register(job_handler)
        for handler in backends.handlers:
            self.registry.register(handler)
        self.safety = Safety(self.store, config.safety)
        self.safety.job_floor = lambda node: self.jobs.drain_floor_reason(
            node, open_incident_nodes=set(self.store.open_incident_counts())
        )
        self._wake = threading.Event()
        self.incidents = IncidentManager(
            store=self.store,
            safety=self.safety,
            registry=self.registry,
            channels=lambda severity, page: channels_for(
                self.notifiers, severity=severity, page=page
            ),
            on_new_actions=self._wake.set,
            jobs=self.jobs,
        )
        self.runner = ActionRunner(
            store=self.store,
            registry=self.registry,
            config=config.actions,
            listener=self.incidents,
            counter=self.metrics,
            gate=lambda action, now: self.incidents.notification_gate(action, now=now),
        )
        self._started_at = clock.now()
        self._reported: set[str] = set()  # nodes that reported since this process started
        self._seeded: dict[tuple[str, str], Any] = {}
        self._memory = self._seed_memory(EngineMemory)
        self.runner.recover(now=clock.now())
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # monotonic time the tick loop last finished a round (the watchdog's liveness check)
        self._tick_beat: float | None = None
        self._update_gauges(clock.now())

    # --- setup helpers ------------------------------------------------------------------------

    def _load_rules(self) -> Any:
        from trainguard.controller.rules.loader import RuleError, load_rules  # noqa: PLC0415

        try:
            return load_rules(self.config.rules)
        except RuleError as e:
            raise ConfigError(e.file, f"rule {e.rule}" if e.rule else "rules", e.reason) from None

    def _load_xid_catalog(self) -> Any:
        from trainguard.xid_catalog import XidCatalog  # noqa: PLC0415

        return XidCatalog.load(self.config.xid_catalog or None)

    def _seed_memory(self, memory_cls: Any) -> Any:
        """Open incidents become 'firing' engine memory, so one whose condition cleared while
        the controller was down is resolved on the first tick instead of staying open."""
        from trainguard.controller.rules.engine import MemoryEntry  # noqa: PLC0415

        entries: dict[tuple[str, str], Any] = {}
        for inc in self.store.unresolved_incidents():
            target = Target(**self.store.incident_target(inc.id))
            entries[(inc.rule, inc.target)] = MemoryEntry(
                target=target,
                since=inc.opened_at,
                state="firing",
                severity=inc.severity,
                actions=(),
                summary=inc.summary,
                value=None,
                labels={},
                cooldown_s=0.0,
            )
        self._seeded = dict(entries)
        return memory_cls(entries) if entries else memory_cls()

    def _hold_seeded(self, decisions: list[Decision], *, now: float) -> list[Decision]:
        """After a restart the signals are empty: a seeded incident must not resolve before
        its node has reported again (nor, without a node, within stale_after_s of start)."""
        from trainguard.controller.rules.engine import EngineMemory  # noqa: PLC0415

        kept: list[Decision] = []
        held: dict[tuple[str, str], Any] = {}
        in_grace = now - self._started_at < self.config.stale_after_s
        for d in decisions:
            key = (d.rule, d.target.key)
            entry = self._seeded.get(key)
            if entry is None:
                kept.append(d)
                continue
            node = d.target.node
            unseen = node not in self._reported if node is not None else in_grace
            if d.state == "resolved" and unseen:
                held[key] = entry
                continue
            if not unseen or d.state != "resolved":
                del self._seeded[key]
            kept.append(d)
        if held:
            self._memory = EngineMemory({**self._memory.entries, **held})
        return kept

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the tick thread and the action worker thread."""
        if self._threads:
            return
        self._stop.clear()
        self._tick_beat = time.monotonic()
        self._threads = [
            threading.Thread(target=self._tick_loop, name="trainguard-tick", daemon=True),
            threading.Thread(target=self._worker_loop, name="trainguard-actions", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info("event=controller_started store=%s rules=%d", self.store.path, self.rule_count)

    def stop(self) -> None:
        """Stop the threads, flush freshness, close the store."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []
        self._flush()
        self.store.close()
        log.info("event=controller_stopped")

    @property
    def running(self) -> bool:
        return bool(self._threads)

    @property
    def rule_count(self) -> int:
        return len(self._rules.rules)

    def ticking(self, *, within_s: float | None = None) -> bool:
        """True while the tick thread runs and finished a round within `within_s` (default
        max(10 s, 10 ticks)): what the systemd watchdog pings depend on."""
        beat = self._tick_beat
        if not self._threads or beat is None:
            return False
        limit_s = max(10.0, 10 * self.config.tick_interval_s) if within_s is None else within_s
        return time.monotonic() - beat <= limit_s

    def _tick_loop(self) -> None:
        interval_s = self.config.tick_interval_s
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:
                log.exception("event=tick_error")
            self._tick_beat = time.monotonic()
            self._stop.wait(max(0.0, interval_s - (time.monotonic() - started)))

    def _worker_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.runner.run_due(now=self.clock.now())
                due = self.runner.next_due_at()
            except Exception:
                log.exception("event=action_worker_error")
                due = None
            now = self.clock.now()
            wait_s = 1.0 if due is None else min(1.0, max(0.0, due - now))
            if wait_s > 0:
                self._wake.wait(wait_s)

    # --- the tick -----------------------------------------------------------------------------

    def tick(self, *, now: float | None = None) -> None:
        """One round: flush freshness, time out commands, evaluate rules, apply decisions.
        Without `start()` it also runs the due action steps (tests drive it step by step)."""
        from trainguard.controller.rules.engine import evaluate  # noqa: PLC0415

        now = self.clock.now() if now is None else now
        started = time.perf_counter()
        self._flush()
        self._expire_commands(now)
        self.jobs.tick(now=now)
        with self._tick_lock:
            with self._lock:
                self._evaluating = True
                rules = self._rules
            try:
                eval_started = time.perf_counter()
                decisions, self._memory = evaluate(
                    rules=rules,
                    signals=self.signals,
                    now=now,
                    memory=self._memory,
                    stale_after_s=self.config.stale_after_s,
                )
                self.metrics.rule_eval_seconds.observe(time.perf_counter() - eval_started)
            finally:
                self._apply_deferred()
            with self._lock:
                if self._seeded:
                    decisions = self._hold_seeded(decisions, now=now)
        self.apply_decisions(decisions, now=now)
        if not self.running:
            self.runner.run_due(now=now)
        self._update_gauges(now)
        self.metrics.tick_seconds.observe(time.perf_counter() - started)

    def _signals_do(self, fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Change the SignalState now, or after the running evaluation. Caller holds _lock."""
        if self._evaluating:
            self._deferred.append(functools.partial(fn, *args, **kwargs))
        else:
            fn(*args, **kwargs)

    def _apply_deferred(self) -> None:
        """Apply the changes queued during an evaluation, in order, then stop queueing.

        Only this (tick) thread changes the SignalState while `_evaluating` is set, so what
        was queued when the evaluation ended is applied in batches without the lock: ingest
        goes on appending behind it meanwhile. What arrived during that catch-up is applied
        under the lock, which bounds the work even when reports arrive faster than this
        thread applies them (it would never catch up otherwise)."""
        with self._lock:
            backlog = len(self._deferred)
        done = 0
        while done < backlog:
            with self._lock:
                batch = self._deferred[done : done + _DEFERRED_BATCH]
            for fn in batch:
                _run_deferred(fn)
            done += len(batch)
        with self._lock:
            rest = self._deferred[done:]
            self._deferred = []
            for fn in rest:
                _run_deferred(fn)
            self._evaluating = False

    def apply_decisions(self, decisions: Sequence[Decision], *, now: float) -> list[int]:
        """Feed decisions to the incident layer; returns ids of incidents opened."""
        opened = self.incidents.apply(decisions, now=now)
        for incident_id in opened:
            incident = self.store.get_incident(incident_id)
            if incident is not None:
                self.metrics.incidents_opened_total.labels(rule=incident.rule).inc()
        return opened

    def run_actions(self, *, now: float | None = None) -> int:
        """Run due action steps now (what the worker thread does); returns how many ran."""
        return self.runner.run_due(now=self.clock.now() if now is None else now)

    def _flush(self) -> None:
        with self._lock:
            batch = list(self._fresh.values())
            self._fresh.clear()
        if batch:
            self.store.flush_freshness(batch)

    def _expire_commands(self, now: float) -> None:
        timeout_s = self.config.actions.command_timeout_s
        with self._lock:
            expired = [
                c for cmds in self._pending.values() for c in cmds if now - c.created_at > timeout_s
            ]
        for cmd in expired:
            message = f"no result from the agent within {timeout_s:g} s"
            if self.store.finish_command(cmd.id, ok=False, result=message):
                self.metrics.commands_timed_out_total.inc()
                log.warning(
                    "event=command_timed_out command=%s node=%s kind=%s", cmd.id, cmd.node, cmd.kind
                )
            with self._lock:
                self._drop_pending(cmd.node, {cmd.id})

    def _update_gauges(self, now: float) -> None:
        with self._lock:
            counts: dict[tuple[str, str], int] = {}
            for n in self._nodes.values():
                counts[(n.role, n.state)] = counts.get((n.role, n.state), 0) + 1
            silent_after_s = self.config.node_silent_after_s
            reporting = sum(1 for t in self._last_seen.values() if now - t <= silent_after_s)
            spares: dict[str, int] = {}
            for n in self._nodes.values():
                if n.role == "spare" and n.state == "active":  # what list_spares() offers
                    pool = n.labels.get("pool", DEFAULT_SPARE_POOL)
                    spares[pool] = spares.get(pool, 0) + 1
        self.metrics.set_nodes(counts)
        self.metrics.nodes_reporting.set(reporting)
        self.metrics.set_spares(spares)
        self.metrics.set_jobs(self.list_jobs())
        open_counts = self.store.open_incident_counts()
        self.metrics.set_node_incidents({n: open_counts.get(n, 0) for n in self.nodes_known()})
        severities = {inc.id: inc.severity for inc in self.store.unresolved_incidents()}
        self.metrics.set_incidents(
            (rule, severities.get(i, "info")) for rule, _, i, _ in self.incidents.open_incidents()
        )

    def _notification_failed(self, channel: str) -> None:
        self.metrics.notifications_failed_total.labels(channel=channel).inc()

    # --- ingest -------------------------------------------------------------------------------

    def ingest_report(self, report: Report, *, actor: str) -> ReportResponse:
        """Store a node's report; return the acknowledged event id and its pending commands."""
        now = self.clock.now()
        name = report.node
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                node = self.store.add_node(
                    name, role=report.role_hint or "active", labels=dict(report.labels)
                )
                self._nodes[name] = node
                self._signals_do(
                    self.signals.set_node_meta, name, role=node.role, state=node.state, job=node.job
                )
                log.info("event=node_registered node=%s role=%s actor=%s", name, node.role, actor)
            self._last_seen[name] = now
            self._reported.add(name)
            self._fresh[name] = FreshNode(
                name=name,
                last_report_at=now,
                instance=report.instance,
                agent_version=report.agent_version,
                labels=dict(report.labels),
            )
            delta = report.full is False
            want_full = self._check_delta_base(name, report) if report.full is not None else None
            if not delta:
                self._hw_counts[name] = (len(report.gpus), len(report.ib_ports))
            self._note_jobs(name, report)
            self.jobs.note_report(name, report)
            hwm = self._high_water_mark(name, report.instance)
            new_events = []
            if report.events:
                seen: dict[int, Any] = {}
                for e in report.events:
                    if e.id > hwm:
                        seen[e.id] = e
                new_events = [seen[i] for i in sorted(seen)]
            if new_events:
                self._store_events(name, report.instance, new_events)
                hwm = new_events[-1].id
                self._hwm[name] = (report.instance, hwm)
            self._signals_do(self.signals.ingest, report, now=now, new_events=new_events)
            commands = self._commands_for(name, now)
        self.metrics.reports_total.inc()
        return ReportResponse(
            ack_event_id=hwm, commands=commands, server_time=now, want_full=want_full
        )

    def _check_delta_base(self, node: str, report: Report) -> bool | None:
        """Track what the node's delta reports are based on; True: ask for a full report."""
        if report.full:
            self._delta_base[node] = (report.instance, report.seq)
            return None
        base = self._delta_base.get(node)
        if base is not None and base[1] is not None and base == (report.instance, report.base_seq):
            self._delta_base[node] = (report.instance, report.seq)
            return None
        # applied for what it lists (current values), but what it leaves out may differ
        # from what is held: deltas stay refused until a full report arrives
        self._delta_base[node] = (report.instance, None)
        if base is None or base[1] is not None:
            log.info(
                "event=full_report_wanted node=%s instance=%s seq=%d base_seq=%s held=%s",
                node,
                report.instance,
                report.seq,
                report.base_seq,
                "none" if base is None else f"{base[0]}/{base[1]}",
            )
        return True

    def _high_water_mark(self, node: str, instance: str) -> int:
        known = self._hwm.get(node)
        if known is not None and known[0] == instance:
            return known[1]
        # a new agent instance (or a controller restart): ask the store once
        hwm = self.store.max_event_id(node, instance)
        self._hwm[node] = (instance, hwm)
        return hwm

    def _store_events(self, node: str, instance: str, events: Sequence[Any]) -> None:
        results: list[CommandResultRow] = []
        for e in events:
            if e.kind == "command_result":
                command_id = e.data.get("command_id")
                if isinstance(command_id, str):
                    results.append(
                        CommandResultRow(
                            command_id=command_id,
                            ok=bool(e.data.get("ok", False)),
                            message=str(e.data.get("message", "")),
                            data={k: v for k, v in e.data.items() if k not in _RESULT_FIELDS},
                        )
                    )
        self.store.insert_events(
            node,
            instance,
            [(e.id, e.kind, e.ts, to_wire(e)) for e in events],
            command_results=results,
        )
        for e in events:
            self.metrics.events_total.labels(kind=e.kind).inc()
        self.jobs.note_events(node, events, now=self.clock.now())
        if results:
            self._drop_pending(node, {r.command_id for r in results})
            for r in results:
                log.info("event=command_done command=%s node=%s ok=%s", r.command_id, node, r.ok)
            self._wake.set()  # a drain may be waiting on this result

    def _note_jobs(self, node: str, report: Report) -> None:
        running = [j.job for j in report.jobs if j.state in _RUNNING_JOB_STATES]
        if not running and report.ranks:
            running = [report.ranks[0].job]
        self._node_jobs[node] = running[0] if running else None
        for rank in report.ranks:
            seen = self._jobs_seen.setdefault(rank.job, _JobSeen())
            seen.nodes.add(node)
            seen.ranks[rank.rank] = rank.step
            if rank.ckpt_step is not None:
                seen.ckpt_step = max(seen.ckpt_step or 0, rank.ckpt_step)

    def _commands_for(self, node: str, now: float) -> tuple[Command, ...]:
        pending = self._pending.get(node)
        if not pending:
            return ()
        first_time = [c.id for c in pending if c.delivered_at is None]
        if first_time:
            self.store.mark_delivered(first_time)
            self._pending[node] = [
                dataclasses.replace(c, delivered_at=now) if c.delivered_at is None else c
                for c in pending
            ]
        return tuple(Command(id=c.id, kind=c.kind, args=c.args) for c in pending)  # type: ignore[arg-type]

    def _drop_pending(self, node: str, ids: set[str]) -> None:
        cmds = self._pending.get(node)
        if cmds:
            left = [c for c in cmds if c.id not in ids]
            if left:
                self._pending[node] = left
            else:
                del self._pending[node]

    # --- NodeOps (for the local drain backend) ------------------------------------------------

    def node_state(self, node: str) -> str | None:
        with self._lock:
            rec = self._nodes.get(node)
        return rec.state if rec else None

    def node_job(self, node: str) -> str | None:
        with self._lock:
            job = self._node_jobs.get(node)
            rec = self._nodes.get(node)
        return job or (rec.job if rec else None)

    def report_age_s(self, node: str) -> float | None:
        with self._lock:
            t = self._last_seen.get(node)
        return None if t is None else max(0.0, self.clock.now() - t)

    def set_node_state(self, node: str, state: str, *, reason: str | None) -> None:
        with self._lock:
            rec = self.store.update_node(node, state=state, drain_reason=reason)
            self._nodes[node] = rec
            self._signals_do(
                self.signals.set_node_meta, node, role=rec.role, state=rec.state, job=rec.job
            )
        log.info("event=node_state node=%s state=%s", node, state)

    def queue_command(self, node: str, kind: str, args: dict[str, Any], *, command_id: str) -> None:
        if self.store.add_command(command_id, node=node, kind=kind, args=args):
            record = self.store.get_command(command_id)
            assert record is not None
            with self._lock:
                self._pending.setdefault(node, []).append(record)
            log.info("event=command_queued command=%s node=%s kind=%s", command_id, node, kind)

    def command_status(self, command_id: str) -> CommandRecord | None:
        return self.store.get_command(command_id)

    # --- NodeAccess (for the job manager) -----------------------------------------------------

    def node_record(self, node: str) -> NodeRecord | None:
        with self._lock:
            return self._nodes.get(node)

    def all_nodes(self) -> list[NodeRecord]:
        with self._lock:
            return list(self._nodes.values())

    def refresh_node(self, node: str) -> None:
        rec = self.store.get_node(node)
        if rec is None:
            return
        with self._lock:
            self._nodes[node] = rec
            self._signals_do(
                self.signals.set_node_meta, node, role=rec.role, state=rec.state, job=rec.job
            )

    def _job_state_changed(self, job: str, nodes: tuple[str, ...], state: str) -> None:
        with self._lock:
            self._signals_do(self.signals.set_job_meta, job, nodes=nodes, state=state)

    def _observe_recovery(self, phases: dict[str, float], lost_steps: int | None) -> None:
        for phase, seconds in phases.items():
            self.metrics.remediation_phase_seconds.labels(phase=phase).observe(seconds)
        if lost_steps is not None:
            self.metrics.remediation_lost_steps.observe(lost_steps)

    # --- service: nodes -----------------------------------------------------------------------

    def _node_view(self, rec: NodeRecord, *, now: float, open_counts: dict[str, int]) -> NodeView:
        last = self._last_seen.get(rec.name, rec.last_report_at)
        age = None if last is None else max(0.0, now - last)
        gpus, ports = self._hw_counts.get(rec.name, (0, 0))
        return NodeView(
            name=rec.name,
            role=rec.role,  # type: ignore[arg-type]
            state=rec.state,  # type: ignore[arg-type]
            labels=dict(rec.labels),
            last_report_at=last,
            report_age_s=age,
            reporting=age is not None and age <= self.config.node_silent_after_s,
            gpus=gpus,
            ib_ports=ports,
            job=self._node_jobs.get(rec.name) or rec.job,
            open_incidents=open_counts.get(rec.name, 0),
            drain_reason=rec.drain_reason,
            agent_version=self._fresh[rec.name].agent_version
            if rec.name in self._fresh
            else rec.agent_version,
        )

    def list_nodes(self) -> list[NodeView]:
        now = self.clock.now()
        counts = self.store.open_incident_counts()
        with self._lock:
            return [
                self._node_view(r, now=now, open_counts=counts)
                for _, r in sorted(self._nodes.items())
            ]

    def get_node(self, name: str) -> NodeView:
        now = self.clock.now()
        counts = self.store.open_incident_counts()
        with self._lock:
            rec = self._nodes.get(name)
            if rec is None:
                raise NotFound(f"node {name!r} not found")
            return self._node_view(rec, now=now, open_counts=counts)

    def set_role(self, name: str, *, role: NodeRole, actor: str) -> NodeView:
        if role not in ("active", "spare"):
            raise BadRequest(f"role must be 'active' or 'spare', got {role!r}")
        with self._lock:
            if name not in self._nodes:
                raise NotFound(f"node {name!r} not found")
            rec = self.store.update_node(name, role=role)
            self._nodes[name] = rec
            self._signals_do(
                self.signals.set_node_meta, name, role=rec.role, state=rec.state, job=rec.job
            )
        self.store.audit(
            ts=self.clock.now(), actor=actor, action="set_role", target=name, detail={"role": role}
        )
        log.info("event=node_role node=%s role=%s actor=%s", name, role, actor)
        return self.get_node(name)

    def _operator_step(self, kind: str, name: str, *, actor: str, detail: dict[str, Any]) -> None:
        if self.node_state(name) is None:
            raise NotFound(f"node {name!r} not found")
        self._run_operator_step(kind, "node", name, actor=actor, audit=kind, detail=detail)

    def _run_operator_step(
        self, kind: str, scope: str, name: str, *, actor: str, audit: str, detail: dict[str, Any]
    ) -> ActionView:
        """An operator's step on a node or job: audit-logged, written as an action row keyed
        by the audit id (no incident), run now; a failed step is a 400 with its reason."""
        now = self.clock.now()
        audit_id = self.store.audit(ts=now, actor=actor, action=audit, target=name, detail=detail)
        (action_id,) = self.store.add_actions(
            None,
            [
                NewAction(
                    kind=kind,
                    target=name,
                    idempotency_key=f"operator:{kind}:{name}:{audit_id}",
                    params={scope: name, "actor": actor, **detail},
                )
            ],
            ts=now,
        )
        action = self.runner.run_one(action_id, now=now)
        self._wake.set()
        log.info(
            "event=operator_%s %s=%s actor=%s action=%d state=%s",
            audit,
            scope,
            name,
            actor,
            action_id,
            action.state,
        )
        if action.state == "failed":
            raise BadRequest(f"{kind} {name} failed: {action.result}")
        return action

    def drain(self, name: str, *, reason: str, actor: str) -> NodeView:
        self._operator_step("drain", name, actor=actor, detail={"reason": reason})
        return self.get_node(name)

    def undrain(self, name: str, *, actor: str) -> NodeView:
        self._operator_step("undrain", name, actor=actor, detail={})
        return self.get_node(name)

    def list_spares(self) -> list[NodeView]:
        return [n for n in self.list_nodes() if n.role == "spare" and n.state == "active"]

    # --- service: incidents -------------------------------------------------------------------

    def list_incidents(
        self, *, state: str | None = None, node: str | None = None, limit: int = 100
    ) -> list[IncidentView]:
        if limit < 1:
            raise BadRequest(f"limit must be >= 1, got {limit}")
        return self.store.list_incidents(state=state, node=node, limit=limit)

    def get_incident(self, incident_id: int) -> IncidentDetail:
        incident = self.store.get_incident(incident_id)
        if incident is None:
            raise NotFound(f"incident {incident_id} not found")
        return IncidentDetail(
            incident=incident,
            timeline=tuple(self.store.timeline(incident_id)),
            actions=tuple(self.store.actions_for_incident(incident_id)),
        )

    # --- service: jobs ----------------------------------------------------------------------

    def _seen_view(self, name: str, seen: _JobSeen) -> JobView:
        """A job known only from heartbeats (started outside the controller)."""
        return JobView(
            name=name,
            state="running",
            nodes=tuple(sorted(seen.nodes)),
            last_step=max(seen.ranks.values()) if seen.ranks else None,
            ckpt_step=seen.ckpt_step,
            ranks=len(seen.ranks),
        )

    def list_jobs(self) -> list[JobView]:
        now = self.clock.now()
        views = {j.name: self.jobs.view(j, now=now) for j in self.jobs.records()}
        with self._lock:
            for name, seen in self._jobs_seen.items():
                if name not in views:
                    views[name] = self._seen_view(name, seen)
        return [views[n] for n in sorted(views)]

    def get_job(self, name: str) -> JobView:
        rec = self.jobs.get(name)
        if rec is not None:
            return self.jobs.view(rec, now=self.clock.now())
        with self._lock:
            seen = self._jobs_seen.get(name)
            if seen is not None:
                return self._seen_view(name, seen)
        raise NotFound(f"job {name!r} not found")

    def submit_job(self, spec: JobSpec, *, actor: str) -> JobView:
        """Store a job and start its first attempt (through the action framework)."""
        now = self.clock.now()
        with self._lock:
            for node in spec.nodes:
                rec = self._nodes.get(node)
                if rec is None:
                    raise BadRequest(f"nodes: unknown node {node!r} (it has never reported)")
                if rec.state != "active":
                    raise BadRequest(f"nodes: {node} is {rec.state}")
        for node in spec.nodes:
            other = self.jobs.job_of_node(node)
            if other is not None and other.name != spec.name:
                raise Conflict(f"nodes: {node} runs job {other.name} ({other.state})")
        submitted = self.jobs.submit(spec, now=now)
        if submitted is None:
            current = self.jobs.get(spec.name)
            state = current.state if current else "unknown"
            raise Conflict(f"job {spec.name!r} exists and is {state}; stop it first")
        self.jobs.place(
            spec.name,
            nodes=spec.nodes,
            nproc_per_node=spec.nproc_per_node,
            assign=spec.nodes,
            release=(),
        )
        self._job_step("restart", spec.name, actor=actor, detail={"reason": "submit"})
        log.info(
            "event=job_submitted job=%s nodes=%s actor=%s", spec.name, ",".join(spec.nodes), actor
        )
        return self.get_job(spec.name)

    def job_action(self, name: str, kind: str, *, actor: str) -> ActionView:
        """Operator checkpoint / restart / stop of a job, as an audited action step."""
        if kind not in ("checkpoint", "restart", "stop"):
            raise BadRequest(f"unknown job action {kind!r}")
        rec = self.jobs.get(name)
        if rec is None:
            raise NotFound(f"job {name!r} not found")
        if kind == "checkpoint" and rec.state not in ("running", "starting"):
            raise Conflict(f"job {name} is {rec.state}; only a running job can checkpoint")
        if kind == "stop" and rec.state in ("stopped", "completed", "failed"):
            raise Conflict(f"job {name} is already {rec.state}")
        return self._job_step(kind, name, actor=actor, detail={})

    def _job_step(self, kind: str, job: str, *, actor: str, detail: dict[str, Any]) -> ActionView:
        return self._run_operator_step(
            kind, "job", job, actor=actor, audit=f"job_{kind}", detail=detail
        )

    # --- service: silences, faults, audit, rules ----------------------------------------------

    def create_silence(
        self,
        *,
        rule: str | None,
        node: str | None,
        duration_s: float,
        comment: str,
        actor: str,
    ) -> SilenceView:
        if not rule and not node:
            raise BadRequest("a silence needs a rule, a node, or both")
        if not duration_s > 0:
            raise BadRequest(f"duration_s must be > 0, got {duration_s}")
        now = self.clock.now()
        silence = self.store.add_silence(
            rule=rule or None,
            node=node or None,
            created_by=actor,
            created_at=now,
            expires_at=now + duration_s,
            comment=comment,
        )
        touched = self.incidents.apply_silence(silence, now=now)
        self.store.audit(
            ts=now,
            actor=actor,
            action="create_silence",
            target=f"silence:{silence.id}",
            detail={
                "rule": rule,
                "node": node,
                "duration_s": duration_s,
                "comment": comment,
                "open_incidents": touched,
            },
        )
        log.info(
            "event=silence_created silence=%d rule=%s node=%s actor=%s open_incidents=%d",
            silence.id,
            rule,
            node,
            actor,
            len(touched),
        )
        return silence

    def list_silences(self, *, include_expired: bool = False) -> list[SilenceView]:
        return self.store.list_silences(now=self.clock.now(), include_expired=include_expired)

    def delete_silence(self, silence_id: int, *, actor: str) -> None:
        now = self.clock.now()
        if not self.store.delete_silence(silence_id, now=now):
            raise NotFound(f"silence {silence_id} not found")
        self.store.audit(
            ts=now, actor=actor, action="delete_silence", target=f"silence:{silence_id}", detail={}
        )

    def inject_fault(self, node: str, spec: FaultSpec, *, actor: str) -> str:
        if self.node_state(node) is None:
            raise NotFound(f"node {node!r} not found")
        command_id = f"fault-{uuid.uuid4().hex[:12]}"
        self.queue_command(node, "inject_fault", to_wire(spec), command_id=command_id)
        self.store.audit(
            ts=self.clock.now(),
            actor=actor,
            action="inject_fault",
            target=node,
            detail={"command_id": command_id, **to_wire(spec)},
        )
        return command_id

    def audit_log(self, *, limit: int = 100) -> list[AuditEntry]:
        return self.store.audit_log(limit=limit)

    def reload_rules(self, *, actor: str) -> int:
        from trainguard.controller.rules.loader import RuleError, load_rules  # noqa: PLC0415

        try:
            rules = load_rules(self.config.rules)
        except RuleError as e:
            log.warning("event=rules_reload_failed actor=%s error=%s", actor, e)
            raise BadRequest(f"rules not reloaded, the running rules stay: {e}") from None
        with self._lock:
            self._rules = rules
            self._signals_do(self.signals.track, rules.history_needs())
        self.metrics.known_rules(rules.names())
        self.store.audit(
            ts=self.clock.now(),
            actor=actor,
            action="reload_rules",
            target="rules",
            detail={"rules": len(rules.rules), "sources": list(rules.sources)},
        )
        log.info("event=rules_reloaded rules=%d actor=%s", len(rules.rules), actor)
        return len(rules.rules)

    # --- test and tooling helpers -------------------------------------------------------------

    def pending_commands(self, node: str) -> list[CommandRecord]:
        with self._lock:
            return list(self._pending.get(node, ()))

    def nodes_known(self) -> Iterable[str]:
        with self._lock:
            return sorted(self._nodes)


__all__ = ["ActionBackends", "Controller"]
