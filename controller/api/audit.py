"""The audit route: the audit log, newest first."""

from __future__ import annotations

from fastapi import Depends, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from trainguard.controller.api.requests import Guards
from trainguard.controller.api.routing import Routes, ok
from trainguard.controller.auth import Principal
from trainguard.controller.service import ControllerService
from trainguard.controller.views import AuditEntry

__all__ = ["add_audit_routes"]


def add_audit_routes(routes: Routes, *, service: ControllerService, guards: Guards) -> None:
    reader = guards.reader

    @routes.add(
        "GET",
        "/v1/audit",
        "audit",
        routes.answer("Audit log, newest first", routes.schemas.array(AuditEntry), (401, 403, 422)),
    )
    async def audit(
        limit: int = Query(100, ge=1, le=10_000), _: Principal = Depends(reader)
    ) -> Response:
        return ok(await run_in_threadpool(service.audit_log, limit=limit))
