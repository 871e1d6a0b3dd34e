"""The read side of the controller's API: nodes, spares, incidents, jobs, silences and the
audit log as views, from the live state, the job manager and the store. Changes nothing."""

from __future__ import annotations

from collections.abc import Callable

from trainguard.clock import Clock
from trainguard.controller.errors import BadRequest, NotFound
from trainguard.controller.jobs import JobManager
from trainguard.controller.livestate import JobSeen, LiveState
from trainguard.controller.store import NodeRecord, Store
from trainguard.controller.views import (
    AuditEntry,
    IncidentDetail,
    IncidentView,
    JobView,
    NodeView,
    SilenceView,
)

__all__ = ["QueryService"]


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
    ) -> None:
        self._live = live
        # jobs a scheduler (Slurm) runs beyond the job table: shown instead of their
        # heartbeat-only view
        self._scheduler_jobs = scheduler_jobs
        self._jobs = jobs
        self._store = store
        self._clock = clock
        self._node_silent_after_s = node_silent_after_s

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
        )

    def list_nodes(self) -> list[NodeView]:
        now = self._clock.now()
        counts = self._store.open_incident_counts()
        with self._live.lock:
            return [
                self._node_view(r, now=now, open_counts=counts)
                for _, r in sorted(self._live.nodes.items())
            ]

    def get_node(self, name: str) -> NodeView:
        now = self._clock.now()
        counts = self._store.open_incident_counts()
        with self._live.lock:
            rec = self._live.nodes.get(name)
            if rec is None:
                raise NotFound(f"node {name!r} not found")
            return self._node_view(rec, now=now, open_counts=counts)

    def list_spares(self) -> list[NodeView]:
        return [n for n in self.list_nodes() if n.role == "spare" and n.state == "active"]

    # --- incidents --------------------------------------------------------------------------

    def list_incidents(
        self, *, state: str | None = None, node: str | None = None, limit: int = 100
    ) -> list[IncidentView]:
        if limit < 1:
            raise BadRequest(f"limit must be >= 1, got {limit}")
        return self._store.list_incidents(state=state, node=node, limit=limit)

    def get_incident(self, incident_id: int) -> IncidentDetail:
        incident = self._store.get_incident(incident_id)
        if incident is None:
            raise NotFound(f"incident {incident_id} not found")
        return IncidentDetail(
            incident=incident,
            timeline=tuple(self._store.timeline(incident_id)),
            actions=tuple(self._store.actions_for_incident(incident_id)),
        )

    # --- jobs -------------------------------------------------------------------------------

    @staticmethod
    def _seen_view(name: str, seen: JobSeen) -> JobView:
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
        now = self._clock.now()
        views = {j.name: self._jobs.view(j, now=now) for j in self._jobs.records()}
        for view in self._scheduler_jobs(now=now):
            views.setdefault(view.name, view)
        with self._live.lock:
            for name, seen in self._live.jobs_seen.items():
                if name not in views:
                    views[name] = self._seen_view(name, seen)
        return [views[n] for n in sorted(views)]

    def get_job(self, name: str) -> JobView:
        rec = self._jobs.get(name)
        if rec is not None:
            return self._jobs.view(rec, now=self._clock.now())
        for view in self._scheduler_jobs(now=self._clock.now()):
            if view.name == name:
                return view
        with self._live.lock:
            seen = self._live.jobs_seen.get(name)
            if seen is not None:
                return self._seen_view(name, seen)
        raise NotFound(f"job {name!r} not found")

    # --- silences and audit -----------------------------------------------------------------

    def list_silences(self, *, include_expired: bool = False) -> list[SilenceView]:
        return self._store.list_silences(now=self._clock.now(), include_expired=include_expired)

    def audit_log(self, *, limit: int = 100) -> list[AuditEntry]:
        return self._store.audit_log(limit=limit)
