"""The routes probes and Prometheus use, without auth: /healthz and /metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from trainguard.controller.api.routing import Routes, content, ok

__all__ = ["Health", "add_meta_routes"]


@dataclass(frozen=True)
class Health:
    status: str


def add_meta_routes(routes: Routes, *, metrics_registry: Any = None) -> None:
    """metrics_registry: the prometheus_client CollectorRegistry served at /metrics (default:
    the process-wide registry)."""

    @routes.add(
        "GET",
        "/healthz",
        "meta",
        {200: {"description": "Alive", "content": content(routes.schemas.ref(Health))}},
    )
    async def healthz() -> Response:
        return ok(Health(status="ok"))

    @routes.add(
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
