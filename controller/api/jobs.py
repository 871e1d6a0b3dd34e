"""The job routes: list, read and submit jobs, and an operator's checkpoint / restart / stop of
a job as an audited action step."""

from __future__ import annotations

import bisect
import logging
from collections.abc import Awaitable, Callable

from fastapi import Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from trainguard.controller.api.requests import Bodies, Guards
from trainguard.controller.api.routing import Routes, ok, page
from trainguard.controller.auth import Principal
from trainguard.controller.jobs import JobSpec
from trainguard.controller.service import ControllerService
from trainguard.controller.views import ActionView, JobView

__all__ = ["JOB_STEPS", "add_job_routes"]

log = logging.getLogger("trainguard.controller.api")

# the operator's job steps, each POST /v1/jobs/{name}/<step>
JOB_STEPS = ("checkpoint", "restart", "stop")


def add_job_routes(
    routes: Routes, *, service: ControllerService, guards: Guards, bodies: Bodies
) -> None:
    schemas = routes.schemas
    reader, writer = guards.reader, guards.writer

    @routes.add(
        "GET",
        "/v1/jobs",
        "jobs",
        routes.answer("Jobs, by name", schemas.array(JobView), (401, 403, 422), paged=True),
    )
    async def list_jobs(
        limit: int = Query(1000, ge=1, le=10_000),
        after: str | None = Query(None, alias="continue", max_length=1024),
        _: Principal = Depends(reader),
    ) -> Response:
        # by name; a full page names where the next starts (X-Trainguard-Continue: ?continue=)
        views = await run_in_threadpool(service.list_jobs)
        start = 0 if after is None else bisect.bisect_right([v.name for v in views], after)
        return page(views[start : start + limit + 1], limit=limit, key=lambda v: v.name)

    @routes.add(
        "GET",
        "/v1/jobs/{name}",
        "jobs",
        routes.answer("One job", schemas.ref(JobView), (401, 403, 404, 422)),
    )
    async def get_job(name: str, _: Principal = Depends(reader)) -> Response:
        return ok(await run_in_threadpool(service.get_job, name))

    @routes.add(
        "POST",
        "/v1/jobs",
        "jobs",
        openapi_extra=routes.request_body(JobSpec),
        responses=routes.answer(
            "The job, starting", schemas.ref(JobView), (400, 401, 403, 409, 413, 422), status=201
        ),
        status_code=201,
    )
    async def submit_job(request: Request, who: Principal = Depends(writer)) -> Response:
        spec = await bodies.decode(request, JobSpec)
        view = await run_in_threadpool(service.submit_job, spec, actor=who.name)
        log.info("event=job_submit job=%s actor=%s", spec.name, who.name)
        return ok(view, status=201)

    def job_step(kind: str) -> Callable[..., Awaitable[Response]]:
        async def handler(name: str, who: Principal = Depends(writer)) -> Response:
            view = await run_in_threadpool(service.job_action, name, kind, actor=who.name)
            log.info("event=job_%s job=%s actor=%s action=%s", kind, name, who.name, view.id)
            return ok(view, status=202)

        return handler

    for kind in JOB_STEPS:
        routes.add(
            "POST",
            f"/v1/jobs/{{name}}/{kind}",
            "jobs",
            routes.answer(
                f"The {kind} step, as recorded",
                schemas.ref(ActionView),
                (400, 401, 403, 404, 409, 422),
                status=202,
            ),
            status_code=202,
            name=f"job_{kind}",
            summary=f"{kind.capitalize()} a job (an audited action step; poll the job)",
        )(job_step(kind))
