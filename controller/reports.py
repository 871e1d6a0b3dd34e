"""Ingest of agent reports, the controller's hot path, and the commands that ride on their
responses.

`ingest_report` runs ~2,048 times a second. It writes nothing per report: freshness lives in
memory and is flushed in one batch per tick; only a report carrying new events writes (one
small transaction). Commands ride on the response until a `command_result` event for their
id arrives, so a lost response never loses a command.

Delta reports: an agent that sends `full` may send only what changed since the report the
controller last applied for its instance (`base_seq`); the SignalState keeps the merged
snapshot. A delta the controller cannot apply on top of what it holds (a new controller
process, another instance, a base that is not the last report applied) is still applied for
what it lists, and the response asks for a full report (`want_full`).

A node's role is the controller's inventory: a new node starts active whatever its report's
`role_hint` says (the hint stays in the signal state only); only an operator makes a node a
spare. A node that reports a live process of an older attempt of a job than the job's current
one is told the current attempt (`job_attempts`), and its agent stops the stale processes:
the report path's half of the fencing (controller.jobs, docs/jobs.md). A report from a new
node when `max_nodes` are registered is refused
(LimitReached, nothing stored). A report refused because its credential speaks for another node
(`refuse_report`) stores nothing but an audit entry (at most one a minute per credential and
node, so a misconfigured agent does not flood the audit log).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

from trainguard.clock import Clock
from trainguard.controller.actions.lifecycle import preflight_summary
from trainguard.controller.errors import LimitReached
from trainguard.controller.jobnames import JobNames, job_names_of, without_jobs
from trainguard.controller.jobs import JobManager
from trainguard.controller.jobscope import JobScope, Refusal, SchedulerScope
from trainguard.controller.livestate import JobSeen, LiveState
from trainguard.controller.metrics import ControllerMetrics
from trainguard.controller.records import CommandResultRow, FreshNode
from trainguard.controller.store import Store
from trainguard.protocol import Command, EventKind, Report, ReportResponse, to_wire

__all__ = ["ReportService"]

log = logging.getLogger("trainguard.controller")

_RUNNING_JOB_STATES = ("starting", "running", "stopping")
# command_result fields the commands table has columns for; the rest is the result's data
_RESULT_FIELDS = frozenset({"command_id", "kind", "ok", "message"})
# a refused report is audited at most once per (credential, claimed node) in this window
_REFUSAL_AUDIT_EVERY_S = 60.0


class ReportService:
    """Takes agent reports into the live state, the SignalState, the job manager and (new
    events only) the store; answers with the acknowledged event id and pending commands."""

    def __init__(
        self,
        *,
        live: LiveState,
        jobs: JobManager,
        store: Store,
        metrics: ControllerMetrics,
        clock: Clock,
        wake: threading.Event,
        max_nodes: int = 10_000,
        scheduler: SchedulerScope | None = None,
        job_names: JobNames | None = None,
        fast_reports_s: float = 0.0,
        fast_reports_window_s: float = 5.0,
        fast_reports_max_nodes: int = 128,
        remediating: Callable[[], bool] = lambda: False,
    ) -> None:
        # the budget of job names the job table does not hold (controller.jobnames)
        self.job_names = job_names or JobNames(
            max_per_node=64,
            max_total=10_000,
            expire_after_s=900.0,
            is_known=lambda job: jobs.get(job) is not None,
        )
        self._names_audited: dict[str, float] = {}  # node -> last audited refusal of names
        self._max_nodes = max_nodes  # a report from a new node beyond it is refused
        self._limit_logged_at = float("-inf")
        self._live = live
        self._jobs = jobs
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._wake = wake
        # the live state's lock, containers and gate, held here directly: one attribute
        # lookup each on the hot path, as when they were this object's own
        self._lock = live.lock
        self._signals = live.signals
        self._change_signals = live.change_signals
        self._nodes = live.nodes
        self._last_seen = live.last_seen
        self._reported = live.reported
        self._fresh = live.fresh
        self._hw_counts = live.hw_counts
        self._unknown_xids = live.unknown_xids
        self._xid_catalog = live.signals.xid_catalog
        self._node_jobs = live.node_jobs
        self._jobs_seen = live.jobs_seen
        self._pending = live.pending
        self._hwm: dict[str, tuple[str, int]] = {}  # node -> (instance, highest stored id)
        # node -> (instance, seq of the last report applied whole, None: a full one is needed)
        self._delta_base: dict[str, tuple[str, int | None]] = {}
        self._refusals: dict[tuple[str, str], float] = {}  # (actor, node) -> last audited at
        self._refusals_lock = threading.Lock()
        self._scope = JobScope(job_record=jobs.get, scheduler=scheduler)
        # (node, job, reason) -> when a refused item was last audited
        self._scope_audited: dict[tuple[str, str, str], float] = {}
        # fast reports (`report_in_s`): node -> until when it reports every fast_reports_s
        self._fast_s = fast_reports_s
        self._fast_window_s = fast_reports_window_s
        self._fast_max_nodes = fast_reports_max_nodes
        self._remediating = remediating
        self._fast_until: dict[str, float] = {}

    def refuse_report(self, *, actor: str, node: str, bound_node: str) -> None:
        """Record a report for `node` refused because `actor`'s credential speaks for
        `bound_node` only: a log line, the refusal counter and (rate-bounded) an audit entry.
        Nothing about either node is stored."""
        now = self._clock.now()
        self._metrics.reports_refused_total.inc()
        key = (actor, node)
        with self._refusals_lock:
            last = self._refusals.get(key)
            if last is not None and now - last < _REFUSAL_AUDIT_EVERY_S:
                return
            if len(self._refusals) > 10_000:
                self._refusals.clear()
            self._refusals[key] = now
        log.warning(
            "event=report_refused reason=node_mismatch actor=%s node=%s bound_node=%s",
            actor,
            node,
            bound_node,
        )
        self._store.audit.record(
            ts=now,
            actor=actor,
            action="report_refused",
            target=node,
            detail={"reason": "credential bound to another node", "bound_node": bound_node},
        )

    def ingest_report(self, report: Report, *, actor: str) -> ReportResponse:
        """Store a node's report; return the acknowledged event id and its pending commands."""
        now = self._clock.now()
        name = report.node
        refused: list[Refusal] = []
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                if len(self._nodes) >= self._max_nodes:
                    if now - self._limit_logged_at >= _REFUSAL_AUDIT_EVERY_S:
                        self._limit_logged_at = now
                        log.warning(
                            "event=node_limit_reached node=%s max_nodes=%d actor=%s",
                            name,
                            self._max_nodes,
                            actor,
                        )
                    raise LimitReached(
                        f"node limit reached: api.max_nodes is {self._max_nodes}; "
                        f"node {name} is not registered"
                    )
                # a report's role_hint never makes a spare: an operator does (set_role)
                node = self._store.nodes.add(name, role="active", labels=dict(report.labels))
                self._nodes[name] = node
                self._change_signals(
                    self._signals.set_node_meta,
                    name,
                    role=node.role,
                    state=node.state,
                    job=node.job,
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
            if report.ranks:
                report = self._scope.check_ranks(report, now=now, refused=refused)
            delta = report.full is False
            want_full = self._check_delta_base(name, report) if report.full is not None else None
            if not delta:
                self._hw_counts[name] = (len(report.gpus), len(report.ib_ports))
            refused_names = self._admit_job_names(name, report, now=now, actor=actor)
            if refused_names:
                report = without_jobs(report, refused_names)
            self._note_jobs(name, report)
            self._jobs.note_report(name, report, now=now)
            stale = self._jobs.stale_attempts(report.jobs) if report.jobs else None
            hwm = self._high_water_mark(name, report.instance)
            new_events = []
            if report.events:
                seen: dict[int, Any] = {}
                for e in report.events:
                    if e.id > hwm:
                        seen[e.id] = e
                new_events = [seen[i] for i in sorted(seen)]
            if new_events:
                # a refused event is acknowledged (never resent) but neither stored nor read
                last_id = new_events[-1].id
                new_events = self._scope.check_events(name, new_events, now=now, refused=refused)
                for e in new_events:
                    self._unknown_xids.note_event(name, e, catalog=self._xid_catalog, at=now)
                if new_events:
                    self._store_events(name, report.instance, new_events, refused=refused_names)
                hwm = last_id
                self._hwm[name] = (report.instance, hwm)
                if refused_names:  # stored, but kept out of the live view
                    new_events = [e for e in new_events if e.job not in refused_names]
            self._change_signals(self._signals.ingest, report, now=now, new_events=new_events)
            commands = self._commands_for(name, now)
            spare = self._keeps_standby(name, report)
            report_in_s = self._report_in(name, now, commands=bool(commands), spare=spare)
        if refused:
            self._refuse_items(refused, actor=actor, now=now)
        self._metrics.reports_total.inc()
        return ReportResponse(
            ack_event_id=hwm,
            commands=commands,
            server_time=now,
            want_full=want_full,
            job_attempts=stale,
            spare=spare,
            report_in_s=report_in_s,
        )

    def _keeps_standby(self, name: str, report: Report) -> bool:
        """`ReportResponse.spare`: the node is a spare, or it replaces a lost node of a job
        recovered in process and runs none of the job's ranks yet (placed by the replace
        step, its standby about to be assigned: an answer saying "not a spare" then would
        stop the very standby the restart step assigns). Caller holds the lock."""
        rec = self._nodes.get(name)
        if rec is None:
            return False
        if rec.role == "spare":
            return True
        if rec.job is None:
            return False
        job = self._jobs.get(rec.job)
        # the cheap test first: most jobs are not recovered in process, and the node lists
        # of a large job are long
        if job is None or not (job.spec.get("recovery") or {}).get("in_process"):
            return False
        if not job.attempt_nodes or name in job.attempt_nodes or name not in job.nodes:
            return False
        return not any(r.job == job.name for r in report.ranks) and not any(
            p.job == job.name and p.state != "exited" for p in report.jobs
        )

    def _report_in(self, node: str, now: float, *, commands: bool, spare: bool) -> float | None:
        """`report_in_s` for this answer: fast while the controller acts on the node (a
        command rides on the answer, or did within the window), and for a spare while a
        remediation step is open; None (the agent's own interval) otherwise, and for a node
        beyond `fast_reports_max_nodes` fast at once. Caller holds the lock."""
        if not self._fast_s:
            return None
        until = self._fast_until.get(node)
        if until is not None and now >= until and not commands:
            del self._fast_until[node]
            until = None
        if not commands and until is None and not (spare and self._remediating()):
            return None
        if until is None and not self._fast_place(now):
            return None  # the budget of fast nodes is spent: the agent's own interval
        if commands or until is None:
            self._fast_until[node] = now + self._fast_window_s
        return self._fast_s

    def _fast_place(self, now: float) -> bool:
        """Whether one more node may report fast; forgets expired ones when at the cap."""
        if len(self._fast_until) < self._fast_max_nodes:
            return True
        for name in [n for n, until in self._fast_until.items() if until <= now]:
            del self._fast_until[name]
        return len(self._fast_until) < self._fast_max_nodes

    def _refuse_items(self, refused: list[Refusal], *, actor: str, now: float) -> None:
        """Count the items the scope check refused; audit and log each (node, job, reason)
        at most once a minute."""
        for r in refused:
            self._metrics.report_items_refused_total.labels(reason=r.reason).inc()
            key = (r.node, r.job, r.reason)
            with self._refusals_lock:
                last = self._scope_audited.get(key)
                if last is not None and now - last < _REFUSAL_AUDIT_EVERY_S:
                    continue
                if len(self._scope_audited) > 10_000:
                    self._scope_audited.clear()
                self._scope_audited[key] = now
            log.warning(
                "event=report_item_refused reason=%s node=%s job=%s item=%s detail=%s",
                r.reason,
                r.node,
                r.job,
                r.what.replace(" ", "_"),
                r.detail.replace(" ", "_"),
            )
            self._store.audit.record(
                ts=now,
                actor=actor,
                action="report_item_refused",
                target=r.job,
                detail={"node": r.node, "reason": r.reason, "item": r.what, "why": r.detail},
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
        hwm = self._store.events.max_event_id(node, instance)
        self._hwm[node] = (instance, hwm)
        return hwm

    def _store_events(
        self, node: str, instance: str, events: Sequence[Any], *, refused: Collection[str] = ()
    ) -> None:
        results: list[CommandResultRow] = []
        for e in events:
            if e.kind == EventKind.COMMAND_RESULT:
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
            elif e.kind == EventKind.PREFLIGHT_RESULT:
                # the preflight command's result: ok = passed, the checks kept in its data
                command_id = e.data.get("command_id")
                checks = e.data.get("checks")
                if isinstance(command_id, str) and isinstance(checks, list):
                    passed = e.data.get("passed") is True
                    results.append(
                        CommandResultRow(
                            command_id=command_id,
                            ok=passed,
                            message=preflight_summary(checks, passed=passed),
                            data={k: v for k, v in e.data.items() if k != "command_id"},
                        )
                    )
        self._store.events.insert(
            node,
            instance,
            [(e.id, e.kind, e.ts, to_wire(e)) for e in events],
            command_results=results,
        )
        for e in events:
            self._metrics.events_total.labels(kind=e.kind).inc()
        if refused:
            events = [e for e in events if e.job not in refused]
        self._jobs.note_events(node, events, now=self._clock.now())
        if results:
            self._live.drop_pending(node, {r.command_id for r in results})
            for r in results:
                log.info("event=command_done command=%s node=%s ok=%s", r.command_id, node, r.ok)
            self._wake.set()  # a drain may be waiting on this result

    def _admit_job_names(self, node: str, report: Report, *, now: float, actor: str) -> set[str]:
        """The job names of `report` beyond the node's budget (controller.jobnames): counted,
        logged and audited at most once a minute per node. Caller holds the lock."""
        refused = self.job_names.admit(node, job_names_of(report), now=now).refused
        if not refused:
            return set()
        for reason in refused.values():
            self._metrics.job_names_refused_total.labels(reason=reason).inc()
        last = self._names_audited.get(node)
        if last is None or now - last >= _REFUSAL_AUDIT_EVERY_S:
            if len(self._names_audited) > 10_000:
                self._names_audited.clear()
            self._names_audited[node] = now
            reasons = sorted(set(refused.values()))
            log.warning(
                "event=job_names_refused node=%s count=%d reasons=%s actor=%s",
                node,
                len(refused),
                ",".join(reasons),
                actor,
            )
            self._store.audit.record(
                ts=now,
                actor=actor,
                action="job_names_refused",
                target=node,
                detail={
                    "reasons": reasons,
                    "refused": len(refused),
                    "example": min(refused),
                    "max_unknown_jobs_per_node": self.job_names.max_per_node,
                    "max_unknown_jobs": self.job_names.max_total,
                },
            )
        return set(refused)

    def expire_job_names(self, now: float) -> int:
        """Forget the job names no node reported for the budget's expiry time that the job
        table does not hold: the seen-jobs view, the job manager's live view and the
        SignalState's job. The tick calls this; returns how many were forgotten."""
        with self._lock:
            gone = self.job_names.expire(now=now)
            for job in gone:
                self._jobs_seen.pop(job, None)
                self._jobs.forget_live(job)
                self._change_signals(self._signals.forget_job, job)
        if gone:
            log.info("event=job_names_expired count=%d", len(gone))
        return len(gone)

    def _note_jobs(self, node: str, report: Report) -> None:
        running = [j.job for j in report.jobs if j.state in _RUNNING_JOB_STATES]
        if not running and report.ranks:
            running = [report.ranks[0].job]
        self._node_jobs[node] = running[0] if running else None
        replaced: set[str] = set()
        for rank in report.ranks:
            seen = self._jobs_seen.setdefault(rank.job, JobSeen())
            seen.nodes.add(node)
            if rank.job not in replaced:  # this report's ranks replace the node's last ones
                replaced.add(rank.job)
                seen.ranks_of[node] = {}
            seen.ranks_of[node][rank.rank] = rank.step
            if rank.ckpt_step is not None:
                seen.ckpt_step = max(seen.ckpt_step or 0, rank.ckpt_step)

    def _commands_for(self, node: str, now: float) -> tuple[Command, ...]:
        pending = self._pending.get(node)
        if not pending:
            return ()
        first_time = [c.id for c in pending if c.delivered_at is None]
        if first_time:
            self._store.commands.mark_delivered(first_time)
            self._pending[node] = [
                dataclasses.replace(c, delivered_at=now) if c.delivered_at is None else c
                for c in pending
            ]
        return tuple(Command(id=c.id, kind=c.kind, args=c.args) for c in pending)  # type: ignore[arg-type]
