"""The silence routes: list, create and delete silences (a rule or a node kept quiet for a
while)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from trainguard.bounds import INT64_MAX
from trainguard.controller.api.errors import ApiError
from trainguard.controller.api.requests import Bodies, Guards
from trainguard.controller.api.routing import Routes, error_answers, ok, page
from trainguard.controller.auth import Principal
from trainguard.controller.service import ControllerService
from trainguard.controller.views import SilenceView

__all__ = ["SilenceRequest", "add_silence_routes"]

log = logging.getLogger("trainguard.controller.api")


def _id(view: SilenceView) -> int:
    return view.id


@dataclass(frozen=True)
class SilenceRequest:
    duration_s: float
    rule: str | None = None
    node: str | None = None
    comment: str = ""


def add_silence_routes(
    routes: Routes, *, service: ControllerService, guards: Guards, bodies: Bodies
) -> None:
    schemas = routes.schemas
    reader, writer = guards.reader, guards.writer

    @routes.add(
        "GET",
        "/v1/silences",
        "silences",
        routes.answer("Silences", schemas.array(SilenceView), (401, 403, 422), paged=True),
    )
    async def list_silences(
        include_expired: bool = False,
        limit: int = Query(1000, ge=1, le=10_000),
        after_id: int = Query(0, alias="continue", ge=0, le=INT64_MAX),
        _: Principal = Depends(reader),
    ) -> Response:
        # by id; a full page names where the next starts (X-Trainguard-Continue: ?continue=)
        views = await run_in_threadpool(service.list_silences, include_expired=include_expired)
        return page([v for v in views if v.id > after_id][: limit + 1], limit=limit, key=_id)

    @routes.add(
        "POST",
        "/v1/silences",
        "silences",
        openapi_extra=routes.request_body(SilenceRequest),
        responses=routes.answer(
            "The new silence", schemas.ref(SilenceView), (400, 401, 403, 413, 422), status=201
        ),
        status_code=201,
    )
    async def create_silence(request: Request, who: Principal = Depends(writer)) -> Response:
        req = await bodies.decode(request, SilenceRequest)
        if not math.isfinite(req.duration_s) or req.duration_s <= 0:
            raise ApiError(400, "duration_s must be a positive number", {"field": "duration_s"})
        view = await run_in_threadpool(
            service.create_silence,
            rule=req.rule,
            node=req.node,
            duration_s=req.duration_s,
            comment=req.comment,
            actor=who.name,
        )
        log.info("event=silence_created silence=%s actor=%s", view.id, who.name)
        return ok(view, status=201)

    @routes.add(
        "DELETE",
        "/v1/silences/{silence_id}",
        "silences",
        {204: {"description": "Deleted"}, **error_answers(401, 403, 404, 422)},
        status_code=204,
    )
    async def delete_silence(
        silence_id: Annotated[int, Path(ge=1, le=INT64_MAX)], who: Principal = Depends(writer)
    ) -> Response:
        await run_in_threadpool(service.delete_silence, silence_id, actor=who.name)
        log.info("event=silence_deleted silence=%s actor=%s", silence_id, who.name)
        return Response(status_code=204)
