"""The controller's clockwork: the tick (rules evaluated over the SignalState, decisions fed
to the incident layer, shrunk jobs' grow steps planned) and the threads that run it and the
action steps it schedules.

Threads: `start()` runs a tick thread (evaluation every tick_interval_s) and an action
worker thread (so a slow webhook never delays detection). Rule evaluation does not hold the
live state's lock: while it runs, every change to the SignalState (reports above all) is
queued, whole, and applied in order after it (LiveState), so the engine sees one consistent
state and never half a report, and ingest never waits for a tick.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.clock import Clock
from trainguard.controller.actions.worker import ActionRunner
from trainguard.controller.config import ControllerConfig
from trainguard.controller.errors import BadRequest
from trainguard.controller.growplan import (
    GrowIncident,
    GrowJob,
    GrowNode,
    GrowStep,
    plan_grows,
)
from trainguard.controller.incidents import IncidentManager
from trainguard.controller.jobs import JobManager
from trainguard.controller.jobstate import JobState
from trainguard.controller.lemons import LemonPolicy
from trainguard.controller.livestate import LiveState
from trainguard.controller.metrics import DEFAULT_SPARE_POOL, ControllerMetrics
from trainguard.controller.model import Decision, Target
from trainguard.controller.queries import QueryService
from trainguard.controller.records import NewAction
from trainguard.controller.rules import engine
from trainguard.controller.rules.cost import check_costs, limits_of
from trainguard.controller.rules.engine import EngineMemory, EvalTiming, MemoryEntry
from trainguard.controller.rules.loader import Rule, RuleError, RuleSet, load_rules
from trainguard.controller.rules.overrun import OverrunGuard, disabled_decision
from trainguard.controller.signals import SIGNAL_EVENT_KINDS
from trainguard.controller.stallguard import Stall, StallGuard
from trainguard.controller.store import Store
from trainguard.controller.store.errors import LeaseLost, StoreUnavailable
from trainguard.protocol import Event, ProtocolError, decoder
from trainguard.strict import ConfigError

__all__ = ["TickService", "load_rule_set", "load_rules_within_budget"]

log = logging.getLogger("trainguard.controller")

_EVENT = decoder(Event)  # the stored body of an event is its wire form


@dataclass(frozen=True)
class _RestoredMemory:
    """A restored incident's engine memory, held open until `until` (unix s) has passed and
    every node in `nodes` has reported since the controller started."""

    entry: MemoryEntry
    nodes: frozenset[str]
    until: float


def load_rules_within_budget(config: ControllerConfig) -> RuleSet:
    """The configured rules, each and all within rule_budget's cost (raises RuleError)."""
    rules = load_rules(config.rules)
    check_costs(rules, limits_of(config))
    return rules


def load_rule_set(config: ControllerConfig) -> RuleSet:
    """The configured rules; a bad rule file, or rules over their cost budget, is a
    configuration error (exit 2)."""
    try:
        return load_rules_within_budget(config)
    except RuleError as e:
        raise ConfigError(e.file, f"rule {e.rule}" if e.rule else "rules", e.reason) from None


class TickService:
    """Owns the rules and the engine's memory; evaluates, applies decisions, runs the tick
    and action worker threads, and keeps the gauges that a tick refreshes."""

    def __init__(
        self,
        *,
        config: ControllerConfig,
        clock: Clock,
        rules: RuleSet,
        live: LiveState,
        queries: QueryService,
        jobs: JobManager,
        incidents: IncidentManager,
        runner: ActionRunner,
        store: Store,
        metrics: ControllerMetrics,
        wake: threading.Event,
        can_grow: bool = True,
        expire_job_names: Callable[[float], int] = lambda now: 0,
        lemons: LemonPolicy | None = None,
        keep_spares_warm: Callable[[float], object] = lambda now: None,
        auto_interval: Callable[[float], object] = lambda now: None,
        plan_replacements: Callable[[float], object] = lambda now: None,
        resend_alerts: Callable[[float], object] = lambda now: None,
    ) -> None:
        self._config = config
        self._plan_replacements = plan_replacements  # cloud replacement's planner (aws backend)
        self._resend_alerts = resend_alerts  # AlertResender.resend (HTTP: the worker's thread)
        self._keep_spares_warm = keep_spares_warm  # SparePreflight.keep_warm over the pool
        self._auto_interval = auto_interval  # AutoInterval.tick: auto jobs' checkpoint interval
        self._lemons = lemons  # the hardware incident gauge
        self._expire_job_names = expire_job_names  # ReportService.expire_job_names
        self._can_grow = can_grow  # the backend declares Capability.GROW
        self._clock = clock
        self._rules = rules
        self._live = live
        self._queries = queries
        self._jobs = jobs
        self._incidents = incidents
        self._runner = runner
        self._store = store
        self._metrics = metrics
        self._wake = wake
        self._tick_lock = threading.Lock()  # one evaluation at a time
        self._overruns = OverrunGuard(overrun_ticks=config.rule_budget.overrun_ticks)
        self._started_at = clock.now()
        self._seeded: dict[tuple[str, str], _RestoredMemory] = {}
        self._replay_events()
        self._memory = self._seed_memory()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # monotonic time the tick loop last finished a round (the watchdog's liveness check)
        self._tick_beat: float | None = None
        self._stalls = StallGuard(tick_interval_s=config.tick_interval_s)

    @property
    def rule_count(self) -> int:
        return len(self._rules.rules)

    def rule(self, name: str) -> Rule | None:
        """The loaded rule of this name (the rules of the last good load)."""
        return self._rules.get(name)

    # --- rebuilt after a restart ----------------------------------------------------------

    def _replay_events(self) -> int:
        """Replay the acknowledged events received within `history_s` into the SignalState at
        the times they were received, so the event-driven series (xid_fatal_total,
        gpu_lost_total, nan_total, preemption_total...) are what they were before the
        restart, and an event acknowledged just before a crash is evaluated by the first
        ticks like any other; a node's windows start over at its last passing validation, as
        they did live. history_s is what the SignalState would have held: a rule window
        longer than it is not answered live either."""
        since = self._started_at - self._config.history_s
        rows = self._store.events.received_since(since, kinds=SIGNAL_EVENT_KINDS)
        # a node validated since then had its windows started over there (_node_validated)
        validated = self._store.actions.succeeded_at("validate", since=since)
        live = self._live
        replayed = skipped = 0
        with live.lock:
            for node, received_at, body in rows:
                if node not in live.nodes:
                    skipped += 1  # removed from the inventory since
                    continue
                if node in validated and received_at > validated[node]:
                    del validated[node]
                    live.signals.forget_node_history(node)
                try:
                    event = _EVENT.decode(body)
                except ProtocolError as e:
                    skipped += 1
                    log.warning("event=event_replay_skipped node=%s reason=%s", node, e)
                    continue
                live.signals.replay_event(node, event, at=received_at)
                live.unknown_xids.note_event(
                    node, event, catalog=live.signals.xid_catalog, at=received_at
                )
                replayed += 1
            for node in validated:
                live.signals.forget_node_history(node)
        if rows:
            log.info(
                "event=events_replayed count=%d skipped=%d history_s=%g",
                replayed,
                skipped,
                self._config.history_s,
            )
        return replayed

    def _seed_memory(self) -> EngineMemory:
        """Open incidents become 'firing' engine memory (with when their condition began), so
        one whose condition cleared while the controller was down is resolved by a tick
        instead of staying open, and one that still holds keeps its `since`. Each is held
        open (see `_hold_seeded`) until what its condition reads has been rebuilt."""
        entries: dict[tuple[str, str], MemoryEntry] = {}
        for inc in self._store.incidents.unresolved():
            target = Target(**self._store.incidents.target(inc.id))
            key = (inc.rule, inc.target)
            entries[key] = MemoryEntry(
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
            rule = self._rules.get(inc.rule)
            window_s = rule.condition.longest_window_s() + rule.for_s if rule is not None else 0.0
            nodes = self._nodes_of(target)
            if not nodes:  # nothing to wait for: at least stale_after_s, as for a silent node
                window_s = max(window_s, self._config.stale_after_s)
            self._seeded[key] = _RestoredMemory(
                entry=entries[key], nodes=nodes, until=self._started_at + window_s
            )
        return EngineMemory(entries) if entries else EngineMemory()

    def _nodes_of(self, target: Target) -> frozenset[str]:
        """The nodes whose reports a restored incident's condition reads."""
        if target.node is not None:
            return frozenset({target.node})
        if target.scope == "job" and target.job is not None:
            job = self._store.jobs.get(target.job)
            if job is not None:
                return frozenset(job.attempt_nodes or job.nodes)
        return frozenset()

    def _hold_seeded(self, decisions: list[Decision], *, now: float) -> list[Decision]:
        """After a restart a windowed condition has lost the history it read (a counter that
        rose before the crash shows no increase in the first report after it), so a restored
        incident must not resolve until every node its condition reads has reported again
        AND a full rule window (its longest range plus its `for`) has passed since this
        controller started: only then is "cleared" a verdict over the evidence. Caller holds
        the live state's lock."""
        kept: list[Decision] = []
        held: dict[tuple[str, str], MemoryEntry] = {}
        reported = self._live.reported
        for d in decisions:
            key = (d.rule, d.target.key)
            hold = self._seeded.get(key)
            if hold is None:
                kept.append(d)
                continue
            if now >= hold.until and hold.nodes <= reported:
                del self._seeded[key]  # rebuilt: from now on the engine's verdict stands
                kept.append(d)
                continue
            if d.state == "resolved":
                held[key] = hold.entry
                continue
            kept.append(d)
        if held:
            self._memory = EngineMemory({**self._memory.entries, **held})
        return kept

    # --- threads ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the tick thread and the action worker thread."""
        self._stop.clear()
        self._tick_beat = self._clock.monotonic()
        self._threads = [
            threading.Thread(target=self._tick_loop, name="trainguard-tick", daemon=True),
            threading.Thread(target=self._worker_loop, name="trainguard-actions", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop both threads and wait for them (30 s each at most)."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []

    @property
    def running(self) -> bool:
        return bool(self._threads)

    def ticking(self, *, within_s: float | None = None) -> bool:
        """True while the tick thread runs and finished a round within `within_s` (default
        max(10 s, 10 ticks)): what the systemd watchdog pings depend on."""
        beat = self._tick_beat
        if not self._threads or beat is None:
            return False
        limit_s = max(10.0, 10 * self._config.tick_interval_s) if within_s is None else within_s
        return self._clock.monotonic() - beat <= limit_s

    def _tick_loop(self) -> None:
        interval_s = self._config.tick_interval_s
        while not self._stop.is_set():
            started = self._clock.monotonic()
            try:
                self.tick()
            except (StoreUnavailable, LeaseLost) as e:
                # a store outage (or a lost lease) skips the round: nothing is decided
                # without the store; storewatch.py and ha.py say so once, not every tick
                log.debug("event=tick_skipped reason=%s", type(e).__name__)
            except Exception:
                log.exception("event=tick_error")
            self._tick_beat = self._clock.monotonic()
            self._stop.wait(max(0.0, interval_s - (self._clock.monotonic() - started)))

    def _worker_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self._runner.run_due(now=self._clock.now())
                self._resend_alerts(self._clock.now())
                due = self._runner.next_due_at()
            except StoreUnavailable:
                log.debug("event=action_worker_skipped reason=store_unavailable")
                due = None
            except LeaseLost as e:  # a deposed leader's step: its write refused by the store
                log.warning(
                    "event=action_write_refused reason=LeaseLost detail=%s",
                    str(e).replace(" ", "_"),
                )
                due = None
            except Exception:
                log.exception("event=action_worker_error")
                due = None
            now = self._clock.now()
            wait_s = 1.0 if due is None else min(1.0, max(0.0, due - now))
            if wait_s > 0:
                self._wake.wait(wait_s)

    # --- the tick ---------------------------------------------------------------------------

    def tick(self, *, now: float | None = None) -> None:
        """One round: flush freshness, time out commands, evaluate rules, apply decisions.
        Without `start()` it also runs the due action steps (tests drive it step by step)."""
        given = now
        now = self._clock.now() if now is None else now
        started = time.perf_counter()
        live = self._live
        stall = self._stalls.beat(monotonic=self._clock.monotonic(), now=now)
        if stall is not None:
            now = self._after_stall(stall, now=self._clock.now() if given is None else now)
        live.flush()
        self._expire_commands(now)
        self._jobs.tick(now=now)
        self._expire_job_names(now)
        with self._tick_lock:
            with live.lock:
                live.begin_evaluation()
                rules = self._rules
            try:
                eval_started = time.perf_counter()
                budget = self._config.rule_budget
                timing = EvalTiming(
                    timer=time.perf_counter,
                    rule_budget_s=budget.eval_budget_s,
                    tick_budget_s=budget.tick_budget_s,
                    skip=self._overruns.skip,
                )
                # looked up on the module at each tick (tests substitute engine.evaluate)
                decisions, self._memory = engine.evaluate(
                    rules=rules,
                    signals=live.signals,
                    now=now,
                    memory=self._memory,
                    stale_after_s=self._config.stale_after_s,
                    timing=timing,
                )
                self._metrics.rule_eval_seconds.observe(time.perf_counter() - eval_started)
            finally:
                live.end_evaluation()
            decisions += self._overrun_decisions(timing, rules=rules, now=now)
            with live.lock:
                if self._seeded:
                    decisions = self._hold_seeded(decisions, now=now)
        self.apply_decisions(decisions, now=now)
        self.plan_grows(now=now)
        self._plan_replacements(now)
        self._keep_spares_warm(now)
        self._auto_interval(now)
        if not self.running:
            self._runner.run_due(now=now)
            self._resend_alerts(now)
        self.update_gauges(now)
        self._metrics.tick_seconds.observe(time.perf_counter() - started)

    def _overrun_decisions(
        self, timing: EvalTiming, *, rules: RuleSet, now: float
    ) -> list[Decision]:
        """Count this tick's overruns; each disabled rule's incident decision (firing every
        tick while it stays disabled)."""
        metrics = self._metrics
        for name in timing.cut:
            metrics.rule_overruns_total.labels(rule=name).inc()
            log.warning(
                "event=rule_overrun rule=%s spent_s=%.3f budget_s=%g",
                name,
                timing.spent_s.get(name, 0.0),
                timing.rule_budget_s,
            )
        if timing.deferred:
            metrics.rules_deferred_total.inc(len(timing.deferred))
            log.warning(
                "event=rules_deferred rules=%s tick_budget_s=%g",
                ",".join(timing.deferred),
                timing.tick_budget_s,
            )
        for gone in self._overruns.observe(timing, now=now):
            metrics.rule_disabled.labels(rule=gone.rule).set(1)
            log.error(
                "event=rule_disabled rule=%s ticks=%d spent_s=%.3f budget_s=%g",
                gone.rule,
                gone.ticks,
                gone.spent_s,
                gone.budget_s,
            )
        return [disabled_decision(d, rule=rules.get(d.rule)) for d in self._overruns.disabled()]

    def _after_stall(self, stall: Stall, *, now: float) -> float:
        """The controller itself did not tick for `stall.gap_s`: the nodes that were not
        silent when it stalled get node_silent_after_s from `now` to report again
        (controller.stallguard). Returns the time the tick goes on at."""
        silent_after_s = self._config.node_silent_after_s
        resumed = self._live.resume_ages(at=now, reported_since=stall.last_tick_at - silent_after_s)
        self._metrics.controller_stalls_total.inc()
        log.warning(
            "event=controller_stalled stall_s=%.1f nodes_resumed=%d grace_s=%g",
            stall.gap_s,
            len(resumed),
            silent_after_s,
        )
        return now

    def apply_decisions(self, decisions: Sequence[Decision], *, now: float) -> list[int]:
        """Feed decisions to the incident layer; returns ids of incidents opened."""
        opened = self._incidents.apply(decisions, now=now)
        for incident_id in opened:
            incident = self._store.incidents.get(incident_id)
            if incident is not None:
                self._metrics.incidents_opened_total.labels(rule=incident.rule).inc()
        return opened

    def plan_grows(self, *, now: float) -> list[str]:
        """Write a `grow` step (no incident, key grow:<job>:<attempt>) for each shrunk job
        controller.growplan.plan_grows picks; returns the keys written."""
        jobs: list[GrowJob] = []
        for rec in self._jobs.records():
            if rec.state != JobState.RUNNING:
                continue
            spec = self._jobs.spec(rec)
            if spec.shrink != "world" or len(rec.nodes) * rec.nproc_per_node >= spec.world_size:
                continue
            began = self._store.actions.by_key(rec.attempt_key) if rec.attempt_key else None
            jobs.append(
                GrowJob(
                    name=rec.name,
                    state=rec.state,
                    attempt=rec.attempt,
                    nodes=rec.nodes,
                    nproc_per_node=rec.nproc_per_node,
                    full_world_size=spec.world_size,
                    shrink=spec.shrink,
                    spare_selector=dict(spec.spare_selector),
                    growable=self._can_grow,
                    confirmed_at=began.updated_at
                    if began is not None and began.state == "succeeded"
                    else None,
                )
            )
        if not jobs:
            return []
        nodes = [
            GrowNode(
                name=n.name,
                role=n.role,
                state=n.state,
                reporting=self._jobs.reporting(n.name),
                labels=dict(n.labels),
                job=n.job,
            )
            for n in self._live.all_nodes()
        ]
        steps = [
            GrowStep(kind=a.kind, job=_text(a.params.get("job")), node=_text(a.params.get("node")))
            for a, _ in self._store.actions.open()
        ]
        incidents = [
            GrowIncident(state=i.state, job=i.job, node=i.node)
            for i in self._store.incidents.unresolved()
        ]
        written: list[str] = []
        for grow in plan_grows(
            jobs=jobs,
            nodes=nodes,
            spares=[n for n in nodes if n.role == "spare"],
            open_steps=steps,
            incidents=incidents,
            now=now,
        ):
            if self._store.actions.by_key(grow.key) is not None:
                continue  # at most one grow per job and attempt, whatever became of it
            self._store.actions.add(
                None,
                [
                    NewAction(
                        kind="grow",
                        target=grow.job,
                        idempotency_key=grow.key,
                        params={
                            "job": grow.job,
                            "attempt": grow.attempt,
                            "spares": list(grow.spares),
                            "actor": "controller",
                            "reason": "back to full size",
                        },
                    )
                ],
                ts=now,
            )
            written.append(grow.key)
            log.info(
                "event=grow_planned job=%s attempt=%d ranks_from=%d ranks_to=%d spares=%s",
                grow.job,
                grow.attempt,
                grow.ranks_from,
                grow.ranks_to,
                ",".join(grow.spares),
            )
        if written:
            self._wake.set()
        return written

    def run_actions(self, *, now: float | None = None) -> int:
        """Run due action steps now (what the worker thread does); returns how many ran."""
        return self._runner.run_due(now=self._clock.now() if now is None else now)

    def _expire_commands(self, now: float) -> None:
        timeout_s = self._config.actions.command_timeout_s
        live = self._live
        with live.lock:
            expired = [
                c for cmds in live.pending.values() for c in cmds if now - c.created_at > timeout_s
            ]
        for cmd in expired:
            message = f"no result from the agent within {timeout_s:g} s"
            if self._store.commands.finish(cmd.id, ok=False, result=message):
                self._metrics.commands_timed_out_total.inc()
                log.warning(
                    "event=command_timed_out command=%s node=%s kind=%s", cmd.id, cmd.node, cmd.kind
                )
            with live.lock:
                live.drop_pending(cmd.node, {cmd.id})

    def update_gauges(self, now: float) -> None:
        """Refresh the node, spare, job and incident gauges."""
        live = self._live
        with live.lock:
            counts: dict[tuple[str, str], int] = {}
            for n in live.nodes.values():
                counts[(n.role, n.state)] = counts.get((n.role, n.state), 0) + 1
            silent_after_s = self._config.node_silent_after_s
            reporting = sum(1 for t in live.last_seen.values() if now - t <= silent_after_s)
            spares: dict[str, int] = {}
            for n in live.nodes.values():
                if n.role == "spare" and n.state == "active":  # what list_spares() offers
                    pool = n.labels.get("pool", DEFAULT_SPARE_POOL)
                    spares[pool] = spares.get(pool, 0) + 1
        metrics = self._metrics
        metrics.set_nodes(counts)
        metrics.nodes_reporting.set(reporting)
        metrics.set_spares(spares)
        metrics.set_jobs(self._queries.list_jobs())
        open_counts = self._store.incidents.open_counts()
        metrics.set_node_incidents({n: open_counts.get(n, 0) for n in live.nodes_known()})
        if self._lemons is not None:
            metrics.set_node_hardware_incidents(self._lemons.counts(list(live.nodes_known())))
        severities = {inc.id: inc.severity for inc in self._store.incidents.unresolved()}
        metrics.set_incidents(
            (rule, severities.get(i, "info")) for rule, _, i, _ in self._incidents.open_incidents()
        )

    # --- rules ------------------------------------------------------------------------------

    def reload_rules(self, *, actor: str) -> int:
        """Load the rule files again; a bad file raises BadRequest and the running rules stay."""
        try:
            rules = load_rules_within_budget(self._config)
        except RuleError as e:
            log.warning("event=rules_reload_failed actor=%s error=%s", actor, e)
            raise BadRequest(f"rules not reloaded, the running rules stay: {e}") from None
        live = self._live
        with live.lock:
            old_rules = self._rules
            self._rules = rules
            live.change_signals(live.signals.track, rules.history_needs())
        with self._tick_lock:  # a reload is the fix: disabled rules run again
            enabled = self._overruns.reset()
        for gone in enabled:
            self._metrics.rule_disabled.labels(rule=gone.rule).set(0)
            log.info("event=rule_enabled rule=%s actor=%s", gone.rule, actor)
        if enabled:
            now = self._clock.now()
            resolved = [
                disabled_decision(g, rule=old_rules.get(g.rule), state="resolved") for g in enabled
            ]
            self.apply_decisions(resolved, now=now)
        self._metrics.known_rules(rules.names())
        self._store.audit.record(
            ts=self._clock.now(),
            actor=actor,
            action="reload_rules",
            target="rules",
            detail={"rules": len(rules.rules), "sources": list(rules.sources)},
        )
        log.info("event=rules_reloaded rules=%d actor=%s", len(rules.rules), actor)
        return len(rules.rules)


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
