"""The controller's REST API app: `create_app` builds it from the route modules (one per
resource) over one `ControllerService`, and `ApiApp` serves POST /v1/reports before the
framework and refuses writes to a controller that does not lead.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from trainguard.controller.api.audit import add_audit_routes
from trainguard.controller.api.docs_page import add_docs_page
from trainguard.controller.api.errors import (
    ApiError,
    Leadership,
    install_error_handlers,
    json_bytes,
    not_leader_error,
)
from trainguard.controller.api.incidents import add_incident_routes
from trainguard.controller.api.jobs import add_job_routes
from trainguard.controller.api.meta import add_meta_routes
from trainguard.controller.api.nodes import add_node_routes
from trainguard.controller.api.reports import ReportPath, add_report_routes
from trainguard.controller.api.requests import Bodies, Guards, request_headers
from trainguard.controller.api.routing import Routes, Schemas, install_openapi
from trainguard.controller.api.rules import add_rule_routes
from trainguard.controller.api.silences import add_silence_routes
from trainguard.controller.auth import TokenStore
from trainguard.controller.service import ControllerService

__all__ = ["ApiApp", "create_app"]

log = logging.getLogger("trainguard.controller.api")

_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_JSON_HEADER = (b"content-type", b"application/json")


def create_app(
    service: ControllerService,
    *,
    tokens: TokenStore,
    max_body_bytes: int,
    metrics_registry: Any = None,
    report_latency: Any = None,
    ingest_in_threadpool: bool = False,
    leadership: Leadership | None = None,
) -> ApiApp:
    """Build the API over `service`.

    metrics_registry: a prometheus_client CollectorRegistry served at /metrics (default: the
    process-wide registry). report_latency, ingest_in_threadpool: see `ReportPath`.
    leadership: HA (controller/ha.py): while this controller does not lead, every request
    but GET/HEAD/OPTIONS is answered 503 naming the leader, before anything else is read
    (a report handed over by an ingest worker, whose credential the worker checked: before
    it is decoded).
    """
    report_path = ReportPath(
        service,
        tokens=tokens,
        max_body_bytes=max_body_bytes,
        report_latency=report_latency,
        ingest_in_threadpool=ingest_in_threadpool,
        leadership=leadership,
    )
    app = ApiApp(
        report_path=report_path,
        leadership=leadership,
        title="trainguard controller",
        version="1",
        openapi_url="/v1/openapi.json",
        docs_url=None,  # FastAPI's page loads Swagger UI from a CDN: ours is self-contained
        redoc_url=None,
    )
    schemas = Schemas()
    routes = Routes(app, schemas)
    guards = Guards(tokens)
    bodies = Bodies(max_body_bytes=max_body_bytes)
    install_error_handlers(app, leadership=leadership)
    # the order the OpenAPI document lists them in
    add_meta_routes(routes, metrics_registry=metrics_registry)
    add_report_routes(routes, path=report_path, guards=guards)
    add_node_routes(routes, service=service, guards=guards, bodies=bodies)
    add_incident_routes(routes, service=service, guards=guards)
    add_job_routes(routes, service=service, guards=guards, bodies=bodies)
    add_silence_routes(routes, service=service, guards=guards, bodies=bodies)
    add_audit_routes(routes, service=service, guards=guards)
    add_rule_routes(routes, service=service, guards=guards)
    install_openapi(app, schemas)
    add_docs_page(app)
    return app


class ApiApp(FastAPI):
    """FastAPI with the report fast path: POST /v1/reports is served before the framework's
    middleware stack, routing and dependency injection, which at 2,048 reports a second
    were a visible share of a core. Everything else goes through FastAPI unchanged.

    `report_path` is also where the ingest workers' handed-over reports enter
    (`report_path.decode_and_ingest`, controller/ingest/frontend.py)."""

    def __init__(
        self, *, report_path: ReportPath, leadership: Leadership | None, **options: Any
    ) -> None:
        super().__init__(**options)
        self.report_path = report_path
        self.leadership = leadership

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        leadership = self.leadership
        if (
            leadership is not None
            and scope["type"] == "http"
            and scope["method"] not in _READ_METHODS
            and not leadership.is_leader()
        ):
            await _send_error(send, not_leader_error(leadership))
            return
        if scope["type"] != "http" or scope["path"] != "/v1/reports" or scope["method"] != "POST":
            if scope["type"] == "http":
                try:
                    request_headers(scope["headers"])
                except ApiError as e:
                    await _send_error(send, e)
                    return
            await super().__call__(scope, receive, send)
            return
        try:
            status, body, extra = await self.report_path.receive(scope, receive)
        except Exception as exc:  # what the framework's error handler would answer
            log.error(
                "event=api_error method=POST path=/v1/reports error=%s",
                type(exc).__name__,
                exc_info=exc,
            )
            status, body, extra = (
                500,
                json_bytes({"error": "internal error", "detail": None}),
                None,
            )
        headers = [_JSON_HEADER, (b"content-length", b"%d" % len(body))]
        if extra:
            headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, e: ApiError) -> None:
    body = json_bytes({"error": e.error, "detail": e.detail})
    headers = [_JSON_HEADER, (b"content-length", b"%d" % len(body))]
    if e.headers:
        headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
