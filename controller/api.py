"""The controller's REST API (`/v1`): routes, bearer auth by role, body limits, error shape.

The API calls only `ControllerService`. Every body is decoded by the wire decoders of
`trainguard.wire_schemas` (strict, field paths in errors) and every answer is encoded with
`trainguard.protocol.to_wire` (non-finite floats as strings), so no NaN ever reaches JSON. The
OpenAPI document at `/v1/openapi.json` is generated from the same wire schemas.
Errors are always `{"error": "...", "detail": ...}`; bad input gets a 4xx, never a 5xx.

Identity: a report is accepted only for the node its credential speaks for (an agent token's
`node:`, or the node a client certificate names; see `tlsauth`), checked once per report
after decoding, in-process and for reports handed over by ingest workers alike: a mismatch is
a 403 naming both, audited, and nothing is stored. A repeated Authorization header is a 400 on
every route (two credentials in one request would be read differently by different layers).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any, Protocol, TypeVar

from fastapi import Depends, FastAPI, Path, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from trainguard.bounds import INT64_MAX
from trainguard.controller.auth import Permission, Principal, TokenStore
from trainguard.controller.dialect import StoreUnavailable
from trainguard.controller.errors import NotLeader, ServiceError
from trainguard.controller.jobs import JobSpec
from trainguard.controller.service import ControllerService
from trainguard.controller.tlsauth import PEER_NODE_KEY
from trainguard.controller.views import (
    ActionView,
    AuditEntry,
    IncidentDetail,
    IncidentState,
    IncidentView,
    JobView,
    NodeRole,
    NodeView,
    SilenceView,
)
from trainguard.protocol import FaultSpec, ProtocolError, Report, ReportResponse, to_wire
from trainguard.wire_schemas import decoder, json_schema

__all__ = [
    "CLIENT_HEADER",
    "LEADER_HEADER",
    "Leadership",
    "DrainRequest",
    "RoleRequest",
    "SilenceRequest",
    "authenticate_report",
    "create_app",
    "encode_report_response",
]

log = logging.getLogger("trainguard.controller.api")

# The client a request came through (agentctl sends `agentctl`); it names the "via" of a drain
# reason filled in by the API. A short token; anything else counts as no client named.
CLIENT_HEADER = "X-Trainguard-Client"
_CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}")

# On a 503 from a controller that does not lead (HA): the leader's URL, empty while none is
# known. Agents and agentctl switch to it (docs/controller.md, "High availability").
LEADER_HEADER = "X-Trainguard-Leader"
_READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

T = TypeVar("T")
H = TypeVar("H", bound=Callable[..., Any])


class Leadership(Protocol):
    """Whether this controller leads (HA, controller/ha.py): a standby answers every write
    503 with the leader's URL."""

    def is_leader(self) -> bool: ...

    def leader_url(self) -> str: ...

    def retry_after_s(self) -> int: ...


@dataclass(frozen=True)
class DrainRequest:
    # absent or blank: "drained by <token name> (<role>) via <client>", see _drain_reason
    reason: str | None = None


@dataclass(frozen=True)
class UndrainRequest:
    # also undo a drain trainguard did not make (an admin's or a health check's, e.g. in Slurm)
    force: bool = False


@dataclass(frozen=True)
class RoleRequest:
    role: NodeRole


@dataclass(frozen=True)
class SilenceRequest:
    duration_s: float
    rule: str | None = None
    node: str | None = None
    comment: str = ""


@dataclass(frozen=True)
class FaultAccepted:
    command_id: str


@dataclass(frozen=True)
class RulesReloaded:
    rules: int


@dataclass(frozen=True)
class Health:
    status: str


class ApiError(Exception):
    def __init__(
        self, status: int, error: str, detail: Any = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = headers

    def reply(self) -> tuple[int, bytes, dict[str, str] | None]:
        """(status, JSON body, headers): this error as the report path answers it."""
        return self.status, _json_bytes({"error": self.error, "detail": self.detail}), self.headers


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _wire(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    return to_wire(value)


def _ok(value: Any, status: int = 200) -> Response:
    return Response(_json_bytes(_wire(value)), status_code=status, media_type="application/json")


def _error_response(
    status: int, error: str, detail: Any = None, headers: dict[str, str] | None = None
) -> Response:
    body = _json_bytes({"error": error, "detail": detail})
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def not_leader_error(leadership: Leadership, reason: str = "") -> ApiError:
    """The 503 of a write to a controller that does not lead: body and headers name the
    leader (X-Trainguard-Leader; empty while none is known) and when to retry."""
    leader = leadership.leader_url()
    where = f"send writes to the leader, {leader}" if leader else "no leader is known yet"
    return ApiError(
        503,
        f"this controller does not lead: {where}",
        {"leader": leader or None, "reason": reason or "standby"},
        {LEADER_HEADER: leader, "Retry-After": str(leadership.retry_after_s())},
    )


# Retry-After on the 503 of a request that needed the store while it is unreachable
STORE_RETRY_AFTER_S = 2


def store_unavailable_error() -> ApiError:
    """The 503 of a request that needed the store while it cannot be reached (PostgreSQL
    stopped or cut off). The store's URL is the controller's business: the log names it."""
    return ApiError(
        503,
        "this controller cannot reach its store: it writes and acts on nothing until the "
        "store is back; retry",
        {"reason": "store_unavailable"},
        {"Retry-After": str(STORE_RETRY_AFTER_S)},
    )


_UNAUTHORIZED = {"WWW-Authenticate": "Bearer"}

# --- OpenAPI helpers ---------------------------------------------------------------------------

_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"error": {"type": "string"}, "detail": {}},
    "required": ["error"],
    "title": "Error",
}


class _Schemas:
    """Component schemas for the OpenAPI document, generated from the wire dataclasses."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {"Error": _ERROR_SCHEMA}

    def ref(self, cls: type, *, output: bool = True) -> dict[str, Any]:
        """A $ref to `cls`: as a response (`output`, what to_wire writes) or a request body."""
        schema, defs = json_schema(cls, ref_template=_REF, output=output)
        for name, value in [*defs.items(), (cls.__name__, schema)]:
            known = self.components.setdefault(name, value)
            if known != value:
                raise ValueError(f"schema {name} is both a request and a response shape")
        return {"$ref": _REF.format(model=cls.__name__)}

    def array(self, cls: type) -> dict[str, Any]:
        return {"type": "array", "items": self.ref(cls)}


def _content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {
        400: "Bad request",
        401: "Missing or unknown token",
        403: "The token's role may not do this",
        404: "Not found",
        409: "Conflict with the current state",
        413: "Body too large",
        422: "Invalid input (field path and reason in detail)",
    }
    err = _content({"$ref": _REF.format(model="Error")})
    return {c: {"description": text[c], "content": err} for c in codes}


# --- the app -----------------------------------------------------------------------------------


def create_app(
    service: ControllerService,
    *,
    tokens: TokenStore,
    max_body_bytes: int,
    metrics_registry: Any = None,
    report_latency: Any = None,
    ingest_in_threadpool: bool = False,
    leadership: Leadership | None = None,
) -> FastAPI:
    """Build the API over `service`.

    metrics_registry: a prometheus_client CollectorRegistry served at /metrics (default: the
    process-wide registry). report_latency: a Histogram observed (seconds) around decoding and
    ingesting each report. ingest_in_threadpool: run `ingest_report` on one dedicated thread
    instead of inline on the event loop (see BENCHMARKS.md for the measured difference).
    leadership: HA (controller/ha.py): while this controller does not lead, every request
    but GET/HEAD/OPTIONS is answered 503 naming the leader, before anything else is read
    (a report handed over by an ingest worker, whose credential the worker checked: before
    it is decoded).
    """
    app = _Api(
        title="trainguard controller",
        version="1",
        openapi_url="/v1/openapi.json",
        docs_url="/v1/docs",
        redoc_url=None,
    )
    schemas = _Schemas()
    bearer = HTTPBearer(auto_error=False, description="Bearer token from the tokens file")
    report_decoder = decoder(Report)
    # one thread: ingests serialise on the controller's lock anyway, and a pool of threads
    # fighting for it (and the GIL) measured slower
    ingest_executor = (
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ingest")
        if ingest_in_threadpool
        else None
    )

    def require(permission: Permission) -> Callable[..., Awaitable[Principal]]:
        async def check(
            creds: HTTPAuthorizationCredentials | None = Depends(bearer),
        ) -> Principal:
            return _check(tokens, None if creds is None else creds.credentials, permission)

        return check

    reader = require("read")
    writer = require("write")

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        limit = declared.encode() if declared is not None else None
        return await read_limited(limit, request.receive, max_body_bytes)

    async def handle_report(
        scope: Scope, receive: Receive
    ) -> tuple[int, bytes, dict[str, str] | None]:
        """POST /v1/reports without the framework: auth, size limit, decode, ingest."""
        try:
            headers = request_headers(scope["headers"])
            principal = authenticate_report(tokens, headers, scope)
            raw = await read_limited(headers.get(b"content-length"), receive, max_body_bytes)
        except ApiError as e:
            return e.reply()
        return await ingest_body(raw, principal.name, principal.node)

    shared_token_nodes: set[str] = set()  # nodes already warned about (shared agent tokens)

    async def ingest_body(
        raw: bytes, actor: str, node: str | None
    ) -> tuple[int, bytes, dict[str, str] | None]:
        """Decode and ingest the body of a report whose sender is already authenticated as
        `actor`, speaking for `node` (None: a shared agent token), and whose size is within
        the limit: the part of POST /v1/reports after the HTTP layer, shared with the ingest
        worker processes (`trainguard.controller.ingest`)."""
        if leadership is not None and not leadership.is_leader():
            # a report handed over by an ingest worker has not passed `_Api.__call__`: a
            # standby refuses it here, before decoding it, as that refuses one before reading it
            return not_leader_error(leadership).reply()
        try:
            started = time.perf_counter()
            try:
                report = report_decoder.decode_json(raw)
                if report.events:
                    _check_event_ids(report)
            except ProtocolError as e:
                raise _invalid(e) from None
            if node is not None:
                if report.node != node:
                    service.refuse_report(actor=actor, node=report.node, bound_node=node)
                    raise ApiError(
                        403,
                        f"credential {actor} speaks for node {node}, not for node {report.node}",
                        {"credential": actor, "bound_node": node, "node": report.node},
                    )
            elif report.node not in shared_token_nodes:
                shared_token_nodes.add(report.node)
                log.warning(
                    "event=shared_agent_token_used actor=%s node=%s detail=this token may speak "
                    "for any node; bind one token per node (docs/security.md)",
                    actor,
                    report.node,
                )
            if ingest_executor is not None:
                loop = asyncio.get_running_loop()
                resp = await loop.run_in_executor(
                    ingest_executor,
                    functools.partial(service.ingest_report, report, actor=actor),
                )
            else:
                resp = service.ingest_report(report, actor=actor)
            body = encode_report_response(resp)
            if report_latency is not None:
                report_latency.observe(time.perf_counter() - started)
            return 200, body, None
        except ApiError as e:
            return e.reply()
        except NotLeader as e:
            if leadership is None:
                raise
            return not_leader_error(leadership, str(e)).reply()
        except ServiceError as e:
            status = e.status if 400 <= e.status < 500 else 500
            return status, _json_bytes({"error": str(e) or type(e).__name__, "detail": None}), None
        except StoreUnavailable:
            # nothing of the report was stored: the agent keeps its events and sends again
            return store_unavailable_error().reply()

    async def body_of(request: Request, cls: type[T], *, if_empty: T | None = None) -> T:
        """The body decoded as `cls`; `if_empty` (when given) stands for an empty body."""
        raw = await read_body(request)
        if if_empty is not None and not raw.strip():
            return if_empty
        try:
            return decoder(cls).decode_json(raw)
        except ProtocolError as e:
            raise _invalid(e) from None

    def request_body(cls: type, *, required: bool = True) -> dict[str, Any]:
        return {
            "requestBody": {
                "required": required,
                "content": _content(schemas.ref(cls, output=False)),
            }
        }

    def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return fn(*args, **kwargs)

    def answer(
        description: str, schema: dict[str, Any], errors: tuple[int, ...], *, status: int = 200
    ) -> dict[int | str, dict[str, Any]]:
        """A route's documented answers: its success (`status`), then the error codes it gives."""
        ok = {"description": description, "content": _content(schema)}
        return {status: ok, **_errors(*errors)}

    def route(
        method: str,
        path: str,
        tag: str,
        responses: dict[int | str, dict[str, Any]],
        **options: Any,
    ) -> Callable[[H], H]:
        """Register a route the way every route here is: raw `Response` answers (encoded by
        `_ok`) and the documented `responses`."""
        return app.api_route(
            path,
            methods=[method],
            tags=[tag],
            response_class=Response,
            responses=responses,
            **options,
        )

    # --- exception handlers ---

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return _error_response(exc.status, exc.error, exc.detail, exc.headers)

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> Response:
        if isinstance(exc, NotLeader) and leadership is not None:
            err = not_leader_error(leadership, str(exc))
            return _error_response(err.status, err.error, err.detail, err.headers)
        status = exc.status if 400 <= exc.status < 500 else 500
        return _error_response(status, str(exc) or type(exc).__name__)

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(_: Request, exc: StoreUnavailable) -> Response:
        err = store_unavailable_error()
        return _error_response(err.status, err.error, err.detail, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        detail = [
            {"field": ".".join(str(p) for p in err.get("loc", ())), "reason": err.get("msg", "")}
            for err in exc.errors()
        ]
        return _error_response(422, "invalid request", detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers) if exc.headers else None
        return _error_response(exc.status_code, str(exc.detail), None, headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # method and path only: headers (Authorization) and bodies are never logged
        log.error(
            "event=api_error method=%s path=%s error=%s",
            request.method,
            request.url.path,
            type(exc).__name__,
            exc_info=exc,
        )
        return _error_response(500, "internal error")

    # --- health and metrics (no auth: probes and Prometheus scrape them) ---

    @route(
        "GET",
        "/healthz",
        "meta",
        {200: {"description": "Alive", "content": _content(schemas.ref(Health))}},
    )
    async def healthz() -> Response:
        return _ok(Health(status="ok"))

    @route(
        "GET",
        "/metrics",
        "meta",
        {
            200: {
                "description": "Prometheus text exposition",
                "content": {"text/plain": {"schema": {"type": "string"}}},
            }
        },
    )
    async def metrics() -> Response:
        body = generate_latest(metrics_registry if metrics_registry is not None else REGISTRY)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    # --- reports (agents) ---

    @route(
        "POST",
        "/v1/reports",
        "agents",
        openapi_extra=request_body(Report),
        responses=answer(
            "Acknowledged events and commands for the node",
            schemas.ref(ReportResponse),
            (400, 401, 403, 413, 422),
        ),
    )
    async def post_report(
        request: Request,
        _: HTTPAuthorizationCredentials | None = Depends(bearer),
    ) -> Response:
        # served by _Api.__call__ (the report fast path); this route documents it and
        # serves the same way if the fast path is ever bypassed
        status, body, headers = await handle_report(request.scope, request.receive)
        return Response(body, status_code=status, media_type="application/json", headers=headers)

    # --- nodes ---

    @route("GET", "/v1/nodes", "nodes", answer("All nodes", schemas.array(NodeView), (401, 403)))
    async def list_nodes(_: Principal = Depends(reader)) -> Response:
        return _ok(await run_in_threadpool(service.list_nodes))

    @route(
        "GET",
        "/v1/nodes/{name}",
        "nodes",
        answer("One node", schemas.ref(NodeView), (401, 403, 404, 422)),
    )
    async def get_node(name: str, _: Principal = Depends(reader)) -> Response:
        return _ok(await run_in_threadpool(service.get_node, name))

    node_changed = answer(
        "The node after the change", schemas.ref(NodeView), (400, 401, 403, 404, 409, 413, 422)
    )

    @route(
        "POST",
        "/v1/nodes/{name}/drain",
        "nodes",
        node_changed,
        openapi_extra=request_body(DrainRequest, required=False),
    )
    async def drain(request: Request, name: str, who: Principal = Depends(writer)) -> Response:
        # an empty body is a drain without a reason (`curl -X POST .../drain`)
        req = await body_of(request, DrainRequest, if_empty=DrainRequest())
        reason = _drain_reason(req.reason, who, request.headers.get(CLIENT_HEADER))
        view = await run_in_threadpool(call, service.drain, name, reason=reason, actor=who.name)
        log.info("event=drain node=%s actor=%s", name, who.name)
        return _ok(view)

    @route(
        "POST",
        "/v1/nodes/{name}/undrain",
        "nodes",
        node_changed,
        openapi_extra=request_body(UndrainRequest, required=False),
    )
    async def undrain(request: Request, name: str, who: Principal = Depends(writer)) -> Response:
        req = await body_of(request, UndrainRequest, if_empty=UndrainRequest())
        view = await run_in_threadpool(call, service.undrain, name, actor=who.name, force=req.force)
        log.info("event=undrain node=%s actor=%s force=%s", name, who.name, req.force)
        return _ok(view)

    @route(
        "PUT",
        "/v1/nodes/{name}/role",
        "nodes",
        node_changed,
        openapi_extra=request_body(RoleRequest),
    )
    async def set_role(request: Request, name: str, who: Principal = Depends(writer)) -> Response:
        req = await body_of(request, RoleRequest)
        view = await run_in_threadpool(call, service.set_role, name, role=req.role, actor=who.name)
        log.info("event=set_role node=%s role=%s actor=%s", name, req.role, who.name)
        return _ok(view)

    @route(
        "POST",
        "/v1/nodes/{name}/faults",
        "nodes",
        openapi_extra=request_body(FaultSpec),
        responses=answer(
            "Fault queued for the node's agent (sim backend only)",
            schemas.ref(FaultAccepted),
            (400, 401, 403, 404, 409, 413, 422),
            status=202,
        ),
        status_code=202,
    )
    async def inject_fault(
        request: Request, name: str, who: Principal = Depends(writer)
    ) -> Response:
        spec = await body_of(request, FaultSpec)
        command_id = await run_in_threadpool(call, service.inject_fault, name, spec, actor=who.name)
        log.info("event=inject_fault node=%s kind=%s actor=%s", name, spec.kind, who.name)
        return _ok(FaultAccepted(command_id=command_id), status=202)

    @route("GET", "/v1/spares", "nodes", answer("Hot spares", schemas.array(NodeView), (401, 403)))
    async def list_spares(_: Principal = Depends(reader)) -> Response:
        return _ok(await run_in_threadpool(service.list_spares))

    # --- incidents ---

    @route(
        "GET",
        "/v1/incidents",
        "incidents",
        answer("Incidents, newest first", schemas.array(IncidentView), (401, 403, 422)),
    )
    async def list_incidents(
        state: IncidentState | None = None,
        node: str | None = None,
        limit: int = Query(100, ge=1, le=10_000),
        _: Principal = Depends(reader),
    ) -> Response:
        return _ok(
            await run_in_threadpool(
                call, service.list_incidents, state=state, node=node, limit=limit
            )
        )

    @route(
        "GET",
        "/v1/incidents/{incident_id}",
        "incidents",
        answer(
            "An incident with its timeline and actions",
            schemas.ref(IncidentDetail),
            (401, 403, 404, 422),
        ),
    )
    async def get_incident(
        incident_id: Annotated[int, Path(ge=1, le=INT64_MAX)], _: Principal = Depends(reader)
    ) -> Response:
        return _ok(await run_in_threadpool(service.get_incident, incident_id))

    # --- jobs ---

    @route("GET", "/v1/jobs", "jobs", answer("All jobs", schemas.array(JobView), (401, 403)))
    async def list_jobs(_: Principal = Depends(reader)) -> Response:
        return _ok(await run_in_threadpool(service.list_jobs))

    @route(
        "GET",
        "/v1/jobs/{name}",
        "jobs",
        answer("One job", schemas.ref(JobView), (401, 403, 404, 422)),
    )
    async def get_job(name: str, _: Principal = Depends(reader)) -> Response:
        return _ok(await run_in_threadpool(service.get_job, name))

    @route(
        "POST",
        "/v1/jobs",
        "jobs",
        openapi_extra=request_body(JobSpec),
        responses=answer(
            "The job, starting", schemas.ref(JobView), (400, 401, 403, 409, 413, 422), status=201
        ),
        status_code=201,
    )
    async def submit_job(request: Request, who: Principal = Depends(writer)) -> Response:
        spec = await body_of(request, JobSpec)
        view = await run_in_threadpool(call, service.submit_job, spec, actor=who.name)
        log.info("event=job_submit job=%s actor=%s", spec.name, who.name)
        return _ok(view, status=201)

    def job_step(kind: str) -> Callable[..., Awaitable[Response]]:
        async def handler(name: str, who: Principal = Depends(writer)) -> Response:
            view = await run_in_threadpool(call, service.job_action, name, kind, actor=who.name)
            log.info("event=job_%s job=%s actor=%s action=%s", kind, name, who.name, view.id)
            return _ok(view, status=202)

        return handler

    for kind in ("checkpoint", "restart", "stop"):
        route(
            "POST",
            f"/v1/jobs/{{name}}/{kind}",
            "jobs",
            answer(
                f"The {kind} step, as recorded",
                schemas.ref(ActionView),
                (400, 401, 403, 404, 409, 422),
                status=202,
            ),
            status_code=202,
            name=f"job_{kind}",
            summary=f"{kind.capitalize()} a job (an audited action step; poll the job)",
        )(job_step(kind))

    # --- silences ---

    @route(
        "GET",
        "/v1/silences",
        "silences",
        answer("Silences", schemas.array(SilenceView), (401, 403, 422)),
    )
    async def list_silences(
        include_expired: bool = False, _: Principal = Depends(reader)
    ) -> Response:
        return _ok(
            await run_in_threadpool(call, service.list_silences, include_expired=include_expired)
        )

    @route(
        "POST",
        "/v1/silences",
        "silences",
        openapi_extra=request_body(SilenceRequest),
        responses=answer(
            "The new silence", schemas.ref(SilenceView), (400, 401, 403, 413, 422), status=201
        ),
        status_code=201,
    )
    async def create_silence(request: Request, who: Principal = Depends(writer)) -> Response:
        req = await body_of(request, SilenceRequest)
        if not math.isfinite(req.duration_s) or req.duration_s <= 0:
            raise ApiError(400, "duration_s must be a positive number", {"field": "duration_s"})
        view = await run_in_threadpool(
            call,
            service.create_silence,
            rule=req.rule,
            node=req.node,
            duration_s=req.duration_s,
            comment=req.comment,
            actor=who.name,
        )
        log.info("event=silence_created silence=%s actor=%s", view.id, who.name)
        return _ok(view, status=201)

    @route(
        "DELETE",
        "/v1/silences/{silence_id}",
        "silences",
        {204: {"description": "Deleted"}, **_errors(401, 403, 404, 422)},
        status_code=204,
    )
    async def delete_silence(
        silence_id: Annotated[int, Path(ge=1, le=INT64_MAX)], who: Principal = Depends(writer)
    ) -> Response:
        await run_in_threadpool(call, service.delete_silence, silence_id, actor=who.name)
        log.info("event=silence_deleted silence=%s actor=%s", silence_id, who.name)
        return Response(status_code=204)

    # --- audit and rules ---

    @route(
        "GET",
        "/v1/audit",
        "audit",
        answer("Audit log, newest first", schemas.array(AuditEntry), (401, 403, 422)),
    )
    async def audit(
        limit: int = Query(100, ge=1, le=10_000), _: Principal = Depends(reader)
    ) -> Response:
        return _ok(await run_in_threadpool(call, service.audit_log, limit=limit))

    @route(
        "POST",
        "/v1/rules/reload",
        "rules",
        answer("Rules reloaded", schemas.ref(RulesReloaded), (400, 401, 403)),
    )
    async def reload_rules(who: Principal = Depends(writer)) -> Response:
        count = await run_in_threadpool(call, service.reload_rules, actor=who.name)
        log.info("event=rules_reloaded rules=%s actor=%s", count, who.name)
        return _ok(RulesReloaded(rules=count))

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title,
            version=app.version,
            description="trainguard controller API. Errors are JSON {error, detail}.",
            routes=app.routes,
        )
        _fix_openapi(doc, schemas.components)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
    app.report_handler = handle_report
    app.report_ingest = ingest_body
    app.leadership = leadership
    return app


def _check(tokens: TokenStore, token: str | None, permission: Permission) -> Principal:
    if not token:
        raise ApiError(401, "missing bearer token", headers=_UNAUTHORIZED)
    principal = tokens.authenticate(token)
    if principal is None:
        raise ApiError(401, "unknown token", headers=_UNAUTHORIZED)
    if not principal.may(permission):
        raise ApiError(403, f"role {principal.role} may not {permission}", {"role": principal.role})
    return principal


def _drain_reason(given: str | None, who: Principal, client: str | None) -> str:
    """The reason a drain records: the one given, else who drained the node and through what
    (the client named in the `X-Trainguard-Client` header, "api" when none or a malformed one)."""
    if given is not None and given.strip():
        return given
    via = client if client is not None and _CLIENT_NAME.fullmatch(client) else "api"
    return f"drained by {who.name} ({who.role}) via {via}"


def request_headers(raw: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """A request's headers as a dict (names are lower case in ASGI); 400 when Authorization
    is repeated: one layer reading the first and another the last would let a request carry
    two credentials."""
    headers = dict(raw)
    if len(headers) < len(raw) and sum(1 for k, _ in raw if k == b"authorization") > 1:
        raise ApiError(400, "repeated Authorization header: send one", {"header": "Authorization"})
    return headers


def authenticate_report(tokens: TokenStore, headers: dict[bytes, bytes], scope: Scope) -> Principal:
    """Who posts a report: the bearer token when an Authorization header is sent, else the
    node named by the connection's verified client certificate (mutual TLS), else 401."""
    header = headers.get(b"authorization")
    if header is None:
        state = scope.get("state")
        node = state.get(PEER_NODE_KEY) if state else None
        if node is not None:
            return Principal(name=f"cert:{node}", role="agent", node=node)
    return authenticate(tokens, header, "report")


def authenticate(tokens: TokenStore, header: bytes | None, permission: Permission) -> Principal:
    """The Authorization header's bearer token checked for `permission` (as HTTPBearer reads
    it: scheme case-insensitive, anything but "Bearer <token>" counts as no token)."""
    token = None
    if header:
        scheme, _, credentials = header.decode("latin-1").strip().partition(" ")
        if scheme.lower() == "bearer":
            token = credentials.strip()
    return _check(tokens, token, permission)


async def read_limited(declared: bytes | None, receive: Receive, max_bytes: int) -> bytes:
    """The request body; 413 when it (or its declared length) exceeds `max_bytes`."""
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, "body too large", {"max_bytes": max_bytes})
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(400, "client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, "body too large", {"max_bytes": max_bytes})
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


_JSON_HEADER = (b"content-type", b"application/json")


class _Api(FastAPI):
    """FastAPI with the report fast path: POST /v1/reports is served before the framework's
    middleware stack, routing and dependency injection, which at 2,048 reports a second
    were a visible share of a core. Everything else goes through FastAPI unchanged."""

    report_handler: Any = None
    # (raw body, actor, node) -> (status, body, extra headers): reports handed over by ingest
    # workers
    report_ingest: Any = None
    leadership: Leadership | None = None

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
        handle = self.report_handler
        if (
            handle is None
            or scope["type"] != "http"
            or scope["path"] != "/v1/reports"
            or scope["method"] != "POST"
        ):
            if scope["type"] == "http":
                try:
                    request_headers(scope["headers"])
                except ApiError as e:
                    await _send_error(send, e)
                    return
            await super().__call__(scope, receive, send)
            return
        try:
            status, body, extra = await handle(scope, receive)
        except Exception as exc:  # what the framework's error handler would answer
            log.error(
                "event=api_error method=POST path=/v1/reports error=%s",
                type(exc).__name__,
                exc_info=exc,
            )
            status, body, extra = (
                500,
                _json_bytes({"error": "internal error", "detail": None}),
                None,
            )
        headers = [_JSON_HEADER, (b"content-length", b"%d" % len(body))]
        if extra:
            headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, e: ApiError) -> None:
    body = _json_bytes({"error": e.error, "detail": e.detail})
    headers = [_JSON_HEADER, (b"content-length", b"%d" % len(body))]
    if e.headers:
        headers += [(k.lower().encode(), v.encode()) for k, v in e.headers.items()]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def encode_report_response(resp: ReportResponse) -> bytes:
    """The response as `to_wire` + compact JSON write it; the usual answer (no commands, a
    finite server time) is formatted directly, which is most of the encoding's cost saved
    on a path taken 2,048 times a second."""
    if resp.commands or resp.job_attempts or not math.isfinite(resp.server_time):
        return _json_bytes(to_wire(resp))
    want = b',"want_full":true' if resp.want_full else b""
    if resp.want_full is False:
        want = b',"want_full":false'
    return b'{"ack_event_id":%d,"commands":[],"server_time":%s%s,"v":%d}' % (
        resp.ack_event_id,
        repr(resp.server_time).encode(),
        want,
        resp.v,
    )


_EVENT_ID_MAX = 2**63 - 1  # the store keeps event ids as 64-bit signed integers


def _check_event_ids(report: Report) -> None:
    for i, e in enumerate(report.events):
        if e.id > _EVENT_ID_MAX:
            raise ProtocolError(f"events[{i}].id", f"out of range: at most {_EVENT_ID_MAX}")


def _invalid(e: ProtocolError) -> ApiError:
    if e.reason.startswith("invalid JSON"):
        return ApiError(400, "invalid JSON", {"field": e.field, "reason": e.reason})
    return ApiError(422, "invalid body", {"field": e.field, "reason": e.reason})


def _fix_openapi(doc: dict[str, Any], components: dict[str, Any]) -> None:
    """Put the wire schemas in, and make FastAPI's own 422 entries describe our error shape."""
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    comps.update(components)
    error_content = _content({"$ref": _REF.format(model="Error")})
    for path_item in doc.get("paths", {}).values():
        for op in path_item.values():
            responses = op.get("responses", {})
            if "422" in responses:
                responses["422"]["content"] = error_content
