"""The controller's facade: everything the REST API (and so agentctl) can ask of it.

The API layer depends only on this Protocol. `Controller` (controller/composition.py) and
`HaController` (controller/ha.py) implement it, method by method, as does the tests'
FakeService; tests/unit/controller/test_service_protocol.py keeps them complete.
Every mutating call takes `actor` (the token's name) for the audit log.
"""

from __future__ import annotations

from typing import Protocol

from trainguard.controller.jobs import JobSpec
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
from trainguard.protocol import FaultSpec, Report, ReportResponse


class ControllerService(Protocol):
    def ingest_report(self, report: Report, *, actor: str) -> ReportResponse:
        """Store a node's report; return acknowledged event id + pending commands."""

    def refuse_report(self, *, actor: str, node: str, bound_node: str) -> None:
        """Audit a report for `node` refused because `actor` speaks for `bound_node` only."""

    def list_nodes(self) -> list[NodeView]: ...

    def get_node(self, name: str) -> NodeView:
        """Raises NotFound."""

    def set_role(self, name: str, *, role: NodeRole, actor: str) -> NodeView:
        """Mark a node active or hot spare. Raises NotFound."""

    def drain(self, name: str, *, reason: str, actor: str) -> NodeView:
        """Drain a node (stop its job processes, keep it out of scheduling). Raises NotFound,
        Conflict (already drained is NOT a conflict: idempotent)."""

    def undrain(self, name: str, *, actor: str, force: bool = False) -> NodeView: ...

    def return_node(self, name: str, *, actor: str) -> NodeView:
        """Validate a drained or retired node (a preflight) and bring it back into service on
        a pass; answers at once with the node `validating`. Raises NotFound, BadRequest."""

    def retire(self, name: str, *, reason: str, actor: str) -> NodeView:
        """Take a node out of service for good (an RMA) with the reason. Raises NotFound,
        BadRequest."""

    def list_spares(self) -> list[NodeView]: ...

    def list_incidents(
        self,
        *,
        state: str | None = None,
        node: str | None = None,
        limit: int = 100,
        before_id: int | None = None,
    ) -> list[IncidentView]: ...

    def get_incident(self, incident_id: int) -> IncidentDetail: ...

    def list_jobs(self) -> list[JobView]: ...

    def get_job(self, name: str) -> JobView: ...

    def submit_job(self, spec: JobSpec, *, actor: str) -> JobView:
        """Store a job and start its first attempt. Raises BadRequest (unknown or drained
        node), Conflict (the name or a node is taken by an active job)."""

    def job_action(self, name: str, kind: str, *, actor: str) -> ActionView:
        """Operator checkpoint / restart / stop of a job as an audited action step (it keeps
        running in the background). Raises NotFound, Conflict (e.g. stop of a stopped job)."""

    def create_silence(
        self,
        *,
        rule: str | None,
        node: str | None,
        duration_s: float,
        comment: str,
        actor: str,
    ) -> SilenceView:
        """Raises BadRequest if neither rule nor node is given or duration_s <= 0."""

    def list_silences(self, *, include_expired: bool = False) -> list[SilenceView]: ...

    def delete_silence(self, silence_id: int, *, actor: str) -> None: ...

    def inject_fault(self, node: str, spec: FaultSpec, *, actor: str) -> str:
        """Queue an inject_fault command for the node's agent; returns the command id."""

    def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        """Newest first; `before_id`: only entries older than it (the next page)."""

    def reload_rules(self, *, actor: str) -> int:
        """Reload rule files; returns the number of rules. Raises BadRequest (keeps the old
        rules) when a file is bad."""
