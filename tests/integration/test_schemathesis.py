"""Property-based run of the published OpenAPI document against the API (in-process ASGI).

Every operation gets generated requests (valid reports included: the Report schema is the wire
schema); no response may be a 5xx, and every response must match its documented status code,
content type and schema. Once over the recording fake, once over the real Controller (SQLite
store, shipped rules, not started: no tick thread).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.fakes.controller_service import FakeService
from trainguard.clock import FakeClock
from trainguard.controller.api import create_app
from trainguard.controller.auth import TokenStore
from trainguard.controller.config import ControllerConfig
from trainguard.controller.core import Controller
from trainguard.strict import build

RULES = Path(__file__).parents[2] / "rules"

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


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def _call(case: Any) -> None:
    token = "agent-token" if case.path == "/v1/reports" else "op-token"
    case.call_and_validate(headers={"Authorization": f"Bearer {token}"}, checks=CHECKS)


@schema.parametrize()
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_conforms_to_its_openapi_document(case: Any) -> None:
    _call(case)


def _real_app() -> tuple[Any, Controller, Path]:
    tmp = Path(tempfile.mkdtemp(prefix="tg-schemathesis-"))
    config = build(
        ControllerConfig,
        {
            "store": {"path": str(tmp / "controller.db")},
            "rules": [str(RULES)],
            "safety": {"dry_run": True},
        },
        source="test",
    )
    controller = Controller(config, clock=FakeClock())
    app = create_app(
        controller,
        tokens=TokenStore.from_plaintext(TOKENS),  # type: ignore[arg-type]
        max_body_bytes=256 * 1024,
        metrics_registry=controller.metrics.registry,
    )
    return app, controller, tmp


# built at import because schemathesis needs the schema to parametrize; closed below
REAL_APP, REAL_CONTROLLER, REAL_TMP = _real_app()
real = schemathesis.openapi.from_asgi("/v1/openapi.json", REAL_APP)


@pytest.fixture(scope="module", autouse=True)
def _close_real_controller() -> Iterator[None]:
    yield
    REAL_CONTROLLER.stop()
    shutil.rmtree(REAL_TMP, ignore_errors=True)


@real.parametrize()
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_real_controller_api_conforms_to_its_openapi_document(case: Any) -> None:
    _call(case)
