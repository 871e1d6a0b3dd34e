"""The audit route: the audit log, newest first, a page at a time."""

from __future__ import annotations

from fastapi import Depends, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from trainguard.bounds import INT64_MAX
from trainguard.controller.api.requests import Guards
from trainguard.controller.api.routing import Routes, page
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
        routes.answer(
            "Audit log, newest first",
            routes.schemas.array(AuditEntry),
            (401, 403, 422),
            paged=True,
        ),
    )
    async def audit(
        limit: int = Query(100, ge=1, le=10_000),
        before_id: int | None = Query(None, alias="continue", ge=1, le=INT64_MAX),
        _: Principal = Depends(reader),
    ) -> Response:
        # newest first; a full page names where the next starts (X-Trainguard-Continue)
        entries = await run_in_threadpool(service.audit_log, limit=limit + 1, before_id=before_id)
        return page(entries, limit=limit, key=lambda e: e.id)
