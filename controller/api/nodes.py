"""The node routes: list and read nodes and hot spares, drain and undrain, return (validate)
and retire, set a node's role, and queue a fault for a node's agent (sim backend)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from fastapi import Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from trainguard.bounds import DrainReason
from trainguard.controller.api.requests import Bodies, Guards
from trainguard.controller.api.routing import Routes, ok
from trainguard.controller.auth import Principal
from trainguard.controller.service import ControllerService
from trainguard.controller.views import NodeRole, NodeView
from trainguard.protocol import FaultSpec

__all__ = [
    "CLIENT_HEADER",
    "DrainRequest",
    "RetireRequest",
    "RoleRequest",
    "UndrainRequest",
    "add_node_routes",
]

log = logging.getLogger("trainguard.controller.api")

# The client a request came through (agentctl sends `agentctl`); it names the "via" of a drain
# reason filled in by the API. A short token; anything else counts as no client named.
CLIENT_HEADER = "X-Trainguard-Client"
_CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}")


@dataclass(frozen=True)
class DrainRequest:
    # absent or blank: "drained by <token name> (<role>) via <client>", see _drain_reason
    reason: DrainReason | None = None


@dataclass(frozen=True)
class UndrainRequest:
    # also undo a drain trainguard did not make (an admin's or a health check's, e.g. in Slurm)
    force: bool = False


@dataclass(frozen=True)
class RetireRequest:
    reason: DrainReason  # why it leaves for good (an RMA ticket, the failing part)


@dataclass(frozen=True)
class RoleRequest:
    role: NodeRole


@dataclass(frozen=True)
class FaultAccepted:
    command_id: str


def add_node_routes(
    routes: Routes, *, service: ControllerService, guards: Guards, bodies: Bodies
) -> None:
    schemas = routes.schemas
    reader, writer = guards.reader, guards.writer

    @routes.add(
        "GET", "/v1/nodes", "nodes", routes.answer("All nodes", schemas.array(NodeView), (401, 403))
    )
    async def list_nodes(_: Principal = Depends(reader)) -> Response:
        return ok(await run_in_threadpool(service.list_nodes))

    @routes.add(
        "GET",
        "/v1/nodes/{name}",
        "nodes",
        routes.answer("One node", schemas.ref(NodeView), (401, 403, 404, 422)),
    )
    async def get_node(name: str, _: Principal = Depends(reader)) -> Response:
        return ok(await run_in_threadpool(service.get_node, name))

    node_changed = routes.answer(
        "The node after the change", schemas.ref(NodeView), (400, 401, 403, 404, 409, 413, 422)
    )

    @routes.add(
        "POST",
        "/v1/nodes/{name}/drain",
        "nodes",
        node_changed,
        openapi_extra=routes.request_body(DrainRequest, required=False),
    )
    async def drain(request: Request, name: str, who: Principal = Depends(writer)) -> Response:
        # an empty body is a drain without a reason (`curl -X POST .../drain`)
        req = await bodies.decode(request, DrainRequest, if_empty=DrainRequest())
        reason = _drain_reason(req.reason, who, request.headers.get(CLIENT_HEADER))
        view = await run_in_threadpool(service.drain, name, reason=reason, actor=who.name)
        log.info("event=drain node=%s actor=%s", name, who.name)
        return ok(view)

    @routes.add(
        "POST",
        "/v1/nodes/{name}/undrain",
        "nodes",
        node_changed,
        openapi_extra=routes.request_body(UndrainRequest, required=False),
    )
    async def undrain(request: Request, name: str, who: Principal = Depends(writer)) -> Response:
        req = await bodies.decode(request, UndrainRequest, if_empty=UndrainRequest())
        view = await run_in_threadpool(service.undrain, name, actor=who.name, force=req.force)
        log.info("event=undrain node=%s actor=%s force=%s", name, who.name, req.force)
        return ok(view)

    @routes.add("POST", "/v1/nodes/{name}/return", "nodes", node_changed)
    async def return_node(name: str, who: Principal = Depends(writer)) -> Response:
        # no body: the preflight's settings are the controller's (lifecycle.*)
        view = await run_in_threadpool(service.return_node, name, actor=who.name)
        log.info("event=node_return node=%s actor=%s", name, who.name)
        return ok(view)

    @routes.add(
        "POST",
        "/v1/nodes/{name}/retire",
        "nodes",
        node_changed,
        openapi_extra=routes.request_body(RetireRequest),
    )
    async def retire(request: Request, name: str, who: Principal = Depends(writer)) -> Response:
        req = await bodies.decode(request, RetireRequest)
        view = await run_in_threadpool(service.retire, name, reason=req.reason, actor=who.name)
        log.info("event=node_retire node=%s actor=%s", name, who.name)
        return ok(view)

    @routes.add(
        "PUT",
        "/v1/nodes/{name}/role",
        "nodes",
        node_changed,
        openapi_extra=routes.request_body(RoleRequest),
    )
    async def set_role(request: Request, name: str, who: Principal = Depends(writer)) -> Response:
        req = await bodies.decode(request, RoleRequest)
        view = await run_in_threadpool(service.set_role, name, role=req.role, actor=who.name)
        log.info("event=set_role node=%s role=%s actor=%s", name, req.role, who.name)
        return ok(view)

    @routes.add(
        "POST",
        "/v1/nodes/{name}/faults",
        "nodes",
        openapi_extra=routes.request_body(FaultSpec),
        responses=routes.answer(
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
        spec = await bodies.decode(request, FaultSpec)
        command_id = await run_in_threadpool(service.inject_fault, name, spec, actor=who.name)
        log.info("event=inject_fault node=%s kind=%s actor=%s", name, spec.kind, who.name)
        return ok(FaultAccepted(command_id=command_id), status=202)

    @routes.add(
        "GET",
        "/v1/spares",
        "nodes",
        routes.answer("Hot spares", schemas.array(NodeView), (401, 403)),
    )
    async def list_spares(_: Principal = Depends(reader)) -> Response:
        return ok(await run_in_threadpool(service.list_spares))


def _drain_reason(given: str | None, who: Principal, client: str | None) -> str:
    """The reason a drain records: the one given, else who drained the node and through what
    (the client named in the `X-Trainguard-Client` header, "api" when none or a malformed one)."""
    if given is not None and given.strip():
        return given
    via = client if client is not None and _CLIENT_NAME.fullmatch(client) else "api"
    return f"drained by {who.name} ({who.role}) via {via}"
