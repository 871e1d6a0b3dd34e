"""The incident routes: list incidents (by state, node) and read one with its timeline."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from trainguard.bounds import INT64_MAX
from trainguard.controller.api.requests import Guards
from trainguard.controller.api.routing import Routes, ok, page
from trainguard.controller.auth import Principal
from trainguard.controller.service import ControllerService
from trainguard.controller.views import IncidentDetail, IncidentState, IncidentView

__all__ = ["add_incident_routes"]


def add_incident_routes(routes: Routes, *, service: ControllerService, guards: Guards) -> None:
    schemas = routes.schemas
    reader = guards.reader

    @routes.add(
        "GET",
        "/v1/incidents",
        "incidents",
        routes.answer(
            "Incidents, newest first", schemas.array(IncidentView), (401, 403, 422), paged=True
        ),
    )
    async def list_incidents(
        state: IncidentState | None = None,
        node: str | None = None,
        limit: int = Query(100, ge=1, le=10_000),
        before_id: int | None = Query(None, alias="continue", ge=1, le=INT64_MAX),
        _: Principal = Depends(reader),
    ) -> Response:
        # newest first; a full page names where the next starts (X-Trainguard-Continue)
        views = await run_in_threadpool(
            service.list_incidents, state=state, node=node, limit=limit + 1, before_id=before_id
        )
        return page(views, limit=limit, key=lambda v: v.id)

    @routes.add(
        "GET",
        "/v1/incidents/{incident_id}",
        "incidents",
        routes.answer(
            "An incident with its timeline and actions",
            schemas.ref(IncidentDetail),
            (401, 403, 404, 422),
        ),
    )
    async def get_incident(
        incident_id: Annotated[int, Path(ge=1, le=INT64_MAX)], _: Principal = Depends(reader)
    ) -> Response:
        return ok(await run_in_threadpool(service.get_incident, incident_id))
