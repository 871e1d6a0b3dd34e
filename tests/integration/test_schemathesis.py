"""Property-based run of the published OpenAPI document against the API (in-process ASGI).

Every operation gets generated requests (valid reports included: the Report schema is the wire
schema); no response may be a 5xx, and every response must match its documented status code,
content type and schema.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from agent.clock import FakeClock
from controller.api import create_app
from controller.auth import TokenStore
from tests.fakes.controller_service import FakeService

TOKENS = {"op-token": ("ops", "operator"), "agent-token": ("agents", "agent")}


def _app() -> Any:
    svc = FakeService(clock=FakeClock())
    svc.add_node("node-1", gpus=8)
    svc.add_node("node-2", role="spare")
    svc.add_incident(id=1, node="node-1")
    svc.add_job("llama", nodes=("node-1",), ettr=float("nan"))
    svc.create_silence(rule="gpu_dbe", node=None, duration_s=60, comment="", actor="ops")
    return create_app(
        svc,
        tokens=TokenStore.from_plaintext(TOKENS),  # type: ignore[arg-type]
        max_body_bytes=256 * 1024,
    )


APP = _app()
schema = schemathesis.openapi.from_asgi("/v1/openapi.json", APP)


@schema.parametrize()
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_conforms_to_its_openapi_document(case: Any) -> None:
    token = "agent-token" if case.path == "/v1/reports" else "op-token"
    case.call_and_validate(
        headers={"Authorization": f"Bearer {token}"},
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
