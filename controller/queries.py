"""The read side of the controller's API: nodes, spares, incidents, jobs, silences and the
audit log as views, from the live state, the job manager and the store. Changes nothing.

While the store cannot be reached (PostgreSQL stopped or cut off) reads go on from memory:
nodes and jobs are in memory anyway; what comes from the store (incidents, silences, the
audit log, the nodes' open-incident counts) is answered with the last answer read for the
same question, and only a question never answered before fails (503)."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

from trainguard.clock import Clock
from trainguard.controller.ckptadvisor import CheckpointAdvisor
from trainguard.controller.ckptauto import AutoInterval
from trainguard.controller.errors import BadRequest, NotFound
from trainguard.controller.jobs import JobManager
from trainguard.controller.lemons import LemonPolicy
from trainguard.controller.livestate import JobSeen, LiveState
from trainguard.controller.records import NodeRecord
from trainguard.controller.store import Store
from trainguard.controller.store.errors import StoreUnavailable
from trainguard.controller.views import (
    AuditEntry,
    IncidentDetail,
    IncidentView,
    JobView,
    NodeView,
    PreflightView,
    SilenceView,
    StandbyView,
    TimelineEntry,
)
from trainguard.kinds import CommandKind

__all__ = ["LastAnswers", "QueryService"]

log = logging.getLogger("trainguard.controller.queries")

T = TypeVar("T")


class LastAnswers:
    """The last answer the store gave to each recent question, kept to answer it again while
    the store cannot be reached. Bounded: the `max_entries` most recently asked questions."""

    def __init__(self, *, max_entries: int = 256) -> None:
        self._max_entries = max_entries
        self._answers: OrderedDict[Hashable, object] = OrderedDict()
        self._lock = threading.Lock()
        self.served_total = 0  # answers served from memory

    def ask(self, key: Hashable, read: Callable[[], T]) -> T:
        """`read()`, remembered under `key`; when it raises StoreUnavailable, the answer
        remembered under `key` (or the error when there is none)."""
        try:
            answer = read()
        except StoreUnavailable:
            with self._lock:
                if key not in self._answers:
                    raise
                self._answers.move_to_end(key)
                self.served_total += 1
                kept = self._answers[key]
            log.debug("event=read_from_memory question=%s", key)
            return kept  # type: ignore[return-value]
        with self._lock:
            self._answers[key] = answer
            self._answers.move_to_end(key)
            while len(self._answers) > self._max_entries:
                self._answers.popitem(last=False)
        return answer


class QueryService:
    """What `GET` answers (see controller.service.ControllerService)."""

    def __init__(
        self,
        *,
        live: LiveState,
        jobs: JobManager,
        store: Store,
        clock: Clock,
        node_silent_after_s: float,
        scheduler_jobs: Callable[..., list[JobView]] = lambda *, now: [],
        lemons: LemonPolicy | None = None,
        advisor: CheckpointAdvisor | None = None,
        auto_interval: AutoInterval | None = None,
    ) -> None:
        self._live = live
        self._advisor = advisor  # each job's checkpoint interval, current against optimal
        self._auto_interval = auto_interval  # auto jobs' interval decisions
        self._lemons = lemons  # the hardware incident history `describe node` shows
        # jobs a scheduler (Slurm) runs beyond the job table: shown instead of their
        # heartbeat-only view
        self._scheduler_jobs = scheduler_jobs
        self._jobs = jobs
        self._store = store
        self._clock = clock
        self._node_silent_after_s = node_silent_after_s
        self.last_answers = LastAnswers()

    # --- nodes ------------------------------------------------------------------------------

    def _node_view(self, rec: NodeRecord, *, now: float, open_counts: dict[str, int]) -> NodeView:
        live = self._live
        last = live.last_seen.get(rec.name, rec.last_report_at)
        age = None if last is None else max(0.0, now - last)
        gpus, ports = live.hw_counts.get(rec.name, (0, 0))
        return NodeView(
            name=rec.name,
            role=rec.role,  # type: ignore[arg-type]
            state=rec.state,  # type: ignore[arg-type]
            labels=dict(rec.labels),
            last_report_at=last,
            report_age_s=age,
            reporting=age is not None and age <= self._node_silent_after_s,
            gpus=gpus,
            ib_ports=ports,
            job=live.node_jobs.get(rec.name) or rec.job,
            open_incidents=open_counts.get(rec.name, 0),
            drain_reason=rec.drain_reason,
            agent_version=live.fresh[rec.name].agent_version
            if rec.name in live.fresh
            else rec.agent_version,
            unknown_xids=live.unknown_xids.of(rec.name),
        )

    def _open_counts(self) -> dict[str, int]:
        return self.last_answers.ask(("open_incident_counts",), self._store.incidents.open_counts)

    def list_nodes(self) -> list[NodeView]:
        now = self._clock.now()
        counts = self._open_counts()
        with self._live.lock:
            return [
                self._node_view(r, now=now, open_counts=counts)
                for _, r in sorted(self._live.nodes.items())
            ]

    def get_node(self, name: str) -> NodeView:
        now = self._clock.now()
        counts = self._open_counts()
        with self._live.lock:
            rec = self._live.nodes.get(name)
            if rec is None:
                raise NotFound(f"node {name!r} not found")
            view = self._node_view(rec, now=now, open_counts=counts)
        # the store's part of a node's view: the last answer while the store is away, and left
        # out (not a 503 for the whole node, which memory holds) when there is none
        try:
            preflight = self.last_answers.ask(
                ("last_preflight", name), lambda: self._last_preflight(name)
            )
        except StoreUnavailable:
            preflight = None
        lemons = self._lemons
        try:
            history = (
                self.last_answers.ask(("hardware_incidents", name), lambda: lemons.history(name))
                if lemons is not None
                else ()
            )
        except StoreUnavailable:
            history = ()
        held = self._jobs.standby(name)
        standby = None if held is None else StandbyView(module=held.module, ready=held.ready)
        return dataclasses.replace(
            view, last_preflight=preflight, hardware_incidents=history, standby=standby
        )

    def _last_preflight(self, node: str) -> PreflightView | None:
        cmd = self._store.commands.last_done(node, kind=CommandKind.PREFLIGHT.value)
        if cmd is None or cmd.done_at is None:
            return None
        checks = cmd.data.get("checks")
        duration = cmd.data.get("duration_s")
        return PreflightView(
            command_id=cmd.id,
            passed=bool(cmd.ok),
            summary=cmd.result,
            done_at=cmd.done_at,
            checks=tuple(c for c in checks if isinstance(c, dict))
            if isinstance(checks, list)
            else (),
            duration_s=float(duration) if isinstance(duration, int | float) else None,
        )

    def list_spares(self) -> list[NodeView]:
        return [n for n in self.list_nodes() if n.role == "spare" and n.state == "active"]

    # --- incidents --------------------------------------------------------------------------

    def list_incidents(
        self,
        *,
        state: str | None = None,
        node: str | None = None,
        limit: int = 100,
        before_id: int | None = None,
    ) -> list[IncidentView]:
        if limit < 1:
            raise BadRequest(f"limit must be >= 1, got {limit}")
        return self.last_answers.ask(
            ("incidents", state, node, limit, before_id),
            lambda: self._store.incidents.find(
                state=state, node=node, limit=limit, before_id=before_id
            ),
        )

    def get_incident(self, incident_id: int) -> IncidentDetail:
        def read() -> IncidentDetail | None:
            incident = self._store.incidents.get(incident_id)
            if incident is None:
                return None
            return self._incident_cost(
                IncidentDetail(
                    incident=incident,
                    timeline=tuple(self._store.incidents.timeline(incident_id)),
                    actions=tuple(self._store.actions.for_incident(incident_id)),
                )
            )

        detail = self.last_answers.ask(("incident", incident_id), read)
        if detail is None:
            raise NotFound(f"incident {incident_id} not found")
        return detail

    # --- jobs -------------------------------------------------------------------------------

    def _with_advice(self, view: JobView) -> JobView:
        """The job's checkpoint interval advice and failure cost (controller.ckptadvisor)."""
        if self._advisor is None:
            return view
        return dataclasses.replace(
            view,
            checkpoint_interval=self._advisor.advice(view.name, nodes=len(view.nodes)),
            failure_cost=self._advisor.job_cost(view.name, gpus=view.world_size or view.ranks),
        )

    def _incident_cost(self, detail: IncidentDetail) -> IncidentDetail:
        """The cost of the incident's restart or rollback to its job (store reads: called
        inside the remembered read)."""
        outputs = [
            self._store.actions.output(a.id)
            for a in detail.actions
            if a.kind in ("restart", "rollback") and a.state == "succeeded"
        ]
        job = detail.incident.job or next(
            (str(o["job"]) for o in outputs if isinstance(o.get("job"), str)), None
        )
        if self._advisor is None or job is None or not outputs:
            return detail
        rec = self._jobs.get(job)
        gpus = len(rec.nodes) * rec.nproc_per_node if rec is not None else 0
        cost = self._advisor.incident_cost(job=job, outputs=outputs, gpus=gpus)
        return detail if cost is None else dataclasses.replace(detail, cost=cost)

    def _with_ckpt_health(self, view: JobView) -> JobView:
        age_s, failures = self._jobs.checkpoint_health(view.name)
        return dataclasses.replace(view, ckpt_age_s=age_s, ckpt_failures=failures)

    @staticmethod
    def _seen_view(name: str, seen: JobSeen) -> JobView:
        """A job known only from heartbeats (started outside the controller)."""
        ranks = seen.ranks
        return JobView(
            name=name,
            state="running",
            nodes=tuple(sorted(seen.nodes)),
            last_step=max(ranks.values()) if ranks else None,
            ckpt_step=seen.ckpt_step,
            ranks=len(ranks),
        )

    def list_jobs(self) -> list[JobView]:
        now = self._clock.now()
        views = {j.name: self._jobs.view(j, now=now) for j in self._jobs.records()}
        for view in self._scheduler_jobs(now=now):
            views.setdefault(view.name, view)
        with self._live.lock:
            seen_only = [
                self._seen_view(name, seen)
                for name, seen in self._live.jobs_seen.items()
                if name not in views
            ]
        # outside the live lock: the ranks' checkpoint health takes the job manager's lock
        for view in seen_only:
            views[view.name] = self._with_ckpt_health(view)
        return [self._with_advice(views[n]) for n in sorted(views)]

    def get_job(self, name: str) -> JobView:
        return self._with_interval_source(self._with_advice(self._job_view(name)))

    def _with_interval_source(self, view: JobView) -> JobView:
        """Where the job's periodic interval comes from (its spec's checkpoint block) and, for
        `auto`, the interval the controller set and its changes (controller.ckptauto)."""
        rec = self._jobs.get(view.name)
        if rec is None:
            return view
        ck = self._jobs.spec(rec).checkpoint
        if ck is None or ck.interval is None:
            return view
        if not ck.auto or self._auto_interval is None:
            return dataclasses.replace(
                view,
                checkpoint_interval_source="auto" if ck.auto else "fixed",
                checkpoint_every_steps=ck.start_every_steps,
            )
        decisions = self._auto_interval.history(view.name)
        changes = tuple(
            TimelineEntry(
                ts=d.ts,
                kind="checkpoint_interval",
                message=f"every {d.every_steps} steps (was {d.before or '-'})",
                data={"every_steps": d.every_steps, "before": d.before, "key": d.key},
            )
            for d in decisions
        )
        return dataclasses.replace(
            view,
            checkpoint_interval_source="auto",
            checkpoint_every_steps=decisions[0].every_steps if decisions else ck.start_every_steps,
            checkpoint_interval_changes=changes,
        )

    def _job_view(self, name: str) -> JobView:
        rec = self._jobs.get(name)
        if rec is not None:
            return self._jobs.view(rec, now=self._clock.now())
        for view in self._scheduler_jobs(now=self._clock.now()):
            if view.name == name:
                return view
        with self._live.lock:
            seen = self._live.jobs_seen.get(name)
            seen_view = None if seen is None else self._seen_view(name, seen)
        if seen_view is not None:
            return self._with_ckpt_health(seen_view)
        raise NotFound(f"job {name!r} not found")

    # --- silences and audit -----------------------------------------------------------------

    def list_silences(self, *, include_expired: bool = False) -> list[SilenceView]:
        return self.last_answers.ask(
            ("silences", include_expired),
            lambda: self._store.silences.find(
                now=self._clock.now(), include_expired=include_expired
            ),
        )

    def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        return self.last_answers.ask(
            ("audit", limit, before_id),
            lambda: self._store.audit.recent(limit=limit, before_id=before_id),
        )
