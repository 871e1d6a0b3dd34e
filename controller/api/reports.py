"""POST /v1/reports, the hot path (every node, every second), in three stages named the same
here, in the ingest workers and in docs/controller.md:

- **receive** (`ReportPath.receive`): the HTTP part: one Authorization header, the sender's
  credential (a bearer token with the report permission, or a client certificate naming a
  node), the body within the size limit. An ingest worker does this stage itself and hands the
  body over.
- **decode** (`ReportPath.decode`): the body's bytes into a checked `Report` for the node the
  credential speaks for (a mismatch is a 403 naming both, audited, and nothing is stored).
- **ingest** (`ControllerService.ingest_report`): the service stores it and answers the
  acknowledged event id and the commands for the node.

`ReportPath.decode_and_ingest` runs the last two for a body received here or by an ingest
worker, and encodes the answer. The route is served before the framework (see app.py); the
route registered here documents it and serves it the same way if that is ever bypassed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials
from starlette.types import Receive, Scope

from trainguard.controller.api.errors import (
    ApiError,
    Leadership,
    invalid_body,
    json_bytes,
    not_leader_error,
    service_error_reply,
    store_unavailable_error,
)
from trainguard.controller.api.requests import (
    Guards,
    authenticate_report,
    read_limited,
    request_headers,
)
from trainguard.controller.api.routing import Routes
from trainguard.controller.auth import TokenStore
from trainguard.controller.errors import NotLeader, ServiceError
from trainguard.controller.service import ControllerService
from trainguard.controller.store.errors import LeaseLost, StoreUnavailable
from trainguard.protocol import ProtocolError, Report, ReportResponse, to_wire
from trainguard.wire_schemas import decoder

__all__ = ["Reply", "ReportPath", "add_report_routes", "encode_report_response"]

log = logging.getLogger("trainguard.controller.api")

# (status, JSON body, extra headers): what the report path answers
Reply = tuple[int, bytes, dict[str, str] | None]

_EVENT_ID_MAX = 2**63 - 1  # the store keeps event ids as 64-bit signed integers


class ReportPath:
    """The report path's stages over one service (see the module's docstring).

    report_latency: a Histogram observed (seconds) around decoding and ingesting each report.
    ingest_in_threadpool: run the ingest stage on one dedicated thread instead of inline on
    the event loop (see BENCHMARKS.md for the measured difference). leadership: while this
    controller does not lead, a handed-over body is refused before it is decoded.
    """

    def __init__(
        self,
        service: ControllerService,
        *,
        tokens: TokenStore,
        max_body_bytes: int,
        report_latency: Any = None,
        ingest_in_threadpool: bool = False,
        leadership: Leadership | None = None,
    ) -> None:
        self._service = service
        self._tokens = tokens
        self._max_body_bytes = max_body_bytes
        self._report_latency = report_latency
        self._leadership = leadership
        self._decoder = decoder(Report)
        # one thread: ingests serialise on the controller's lock anyway, and a pool of threads
        # fighting for it (and the GIL) measured slower
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-ingest")
            if ingest_in_threadpool
            else None
        )
        self._shared_token_nodes: set[str] = set()  # nodes already warned about

    async def receive(self, scope: Scope, receive: Receive) -> Reply:
        """Stage 1, without the framework: one Authorization header, the credential, the
        body within the limit; then decode and ingest it."""
        try:
            headers = request_headers(scope["headers"])
            principal = authenticate_report(self._tokens, headers, scope)
            raw = await read_limited(headers.get(b"content-length"), receive, self._max_body_bytes)
        except ApiError as e:
            return e.reply()
        return await self.decode_and_ingest(raw, actor=principal.name, node=principal.node)

    async def decode_and_ingest(self, raw: bytes, *, actor: str, node: str | None) -> Reply:
        """Stages 2 and 3 for a body whose sender is already authenticated as `actor`,
        speaking for `node` (None: a shared agent token), and whose size is within the
        limit: received here, or by an ingest worker (`trainguard.controller.ingest`)."""
        leadership = self._leadership
        if leadership is not None and not leadership.is_leader():
            # a body handed over by an ingest worker has not passed the app's leadership
            # check: a standby refuses it here, before decoding it, as that refuses one
            # before reading it
            return not_leader_error(leadership).reply()
        try:
            started = time.perf_counter()
            report = self.decode(raw, actor=actor, node=node)
            if self._executor is not None:
                loop = asyncio.get_running_loop()
                resp = await loop.run_in_executor(
                    self._executor,
                    functools.partial(self._service.ingest_report, report, actor=actor),
                )
            else:
                resp = self._service.ingest_report(report, actor=actor)
            body = encode_report_response(resp)
            if self._report_latency is not None:
                self._report_latency.observe(time.perf_counter() - started)
            return 200, body, None
        except ApiError as e:
            return e.reply()
        except (NotLeader, LeaseLost) as e:
            if leadership is None:
                raise
            return not_leader_error(leadership, str(e)).reply()
        except ServiceError as e:
            return service_error_reply(e)
        except StoreUnavailable:
            # nothing of the report was stored: the agent keeps its events and sends again
            return store_unavailable_error().reply()

    def decode(self, raw: bytes, *, actor: str, node: str | None) -> Report:
        """Stage 2: the body as a checked Report for the node `actor` speaks for. Raises
        ApiError: 400 (not JSON), 422 (invalid), 403 (another node's report, audited)."""
        try:
            report = self._decoder.decode_json(raw)
            if report.events:
                _check_event_ids(report)
        except ProtocolError as e:
            raise invalid_body(e) from None
        if node is not None:
            if report.node != node:
                self._service.refuse_report(actor=actor, node=report.node, bound_node=node)
                raise ApiError(
                    403,
                    f"credential {actor} speaks for node {node}, not for node {report.node}",
                    {"credential": actor, "bound_node": node, "node": report.node},
                )
        elif report.node not in self._shared_token_nodes:
            self._shared_token_nodes.add(report.node)
            log.warning(
                "event=shared_agent_token_used actor=%s node=%s detail=this token may speak "
                "for any node; bind one token per node (docs/security.md)",
                actor,
                report.node,
            )
        return report


def add_report_routes(routes: Routes, *, path: ReportPath, guards: Guards) -> None:
    schemas = routes.schemas

    @routes.add(
        "POST",
        "/v1/reports",
        "agents",
        openapi_extra=routes.request_body(Report),
        responses=routes.answer(
            "Acknowledged events and commands for the node",
            schemas.ref(ReportResponse),
            (400, 401, 403, 413, 422),
        ),
    )
    async def post_report(
        request: Request,
        _: HTTPAuthorizationCredentials | None = Depends(guards.bearer),
    ) -> Response:
        # served by the app before the framework (the report fast path); this route
        # documents it and serves the same way if the fast path is ever bypassed
        status, body, headers = await path.receive(request.scope, request.receive)
        return Response(body, status_code=status, media_type="application/json", headers=headers)


def encode_report_response(resp: ReportResponse) -> bytes:
    """The response as `to_wire` + compact JSON write it; the usual answer (no commands, a
    finite server time) is formatted directly, which is most of the encoding's cost saved
    on a path taken 2,048 times a second."""
    if (
        resp.commands
        or resp.job_attempts
        or resp.report_in_s is not None
        or not math.isfinite(resp.server_time)
    ):
        return json_bytes(to_wire(resp))
    want = b',"want_full":true' if resp.want_full else b""
    if resp.want_full is False:
        want = b',"want_full":false'
    spare = b""
    if resp.spare is not None:
        spare = b',"spare":true' if resp.spare else b',"spare":false'
    return b'{"ack_event_id":%d,"commands":[],"server_time":%s%s%s,"v":%d}' % (
        resp.ack_event_id,
        repr(resp.server_time).encode(),
        want,
        spare,
        resp.v,
    )


def _check_event_ids(report: Report) -> None:
    for i, e in enumerate(report.events):
        if e.id > _EVENT_ID_MAX:
            raise ProtocolError(f"events[{i}].id", f"out of range: at most {_EVENT_ID_MAX}")
