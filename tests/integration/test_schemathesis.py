"""Property-based run of the published OpenAPI document against the API (in-process ASGI).

Every operation gets generated requests (valid reports included: the Report schema is the wire
schema); no response may be a 5xx, and every response must match its documented status code,
content type and schema. Once over the recording fake, once over the real Controller (SQLite
store, shipped rules, not started: no tick thread). Then once more over the real Controller
with one value of each generated request (a body leaf or an id in the path) replaced by an
integer outside int64 or a non-finite or huge float: never a 5xx, and /metrics still renders.
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
from hypothesis import strategies as st
from prometheus_client import generate_latest
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.fakes.controller_service import FakeService
from trainguard.clock import FakeClock
from trainguard.controller.api.app import create_app
from trainguard.controller.auth import TokenStore
from trainguard.controller.composition import Controller
from trainguard.controller.config import ControllerConfig
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


# what the red-team pass sent: integers past int64 (10**400 breaks float()), non-finite floats
# (as the wire writes them: JSON has no NaN) and huge finite ones
EXTREMES = [2**63, -(2**63) - 1, 10**400, "Infinity", "-Infinity", "NaN", 1e308, -1e308]


def _leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _leaves(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _leaves(v, (*path, i))]
    return [path] if path else []


@real.given(data=st.data())
@real.parametrize()
@settings(
    max_examples=8,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_real_controller_never_answers_5xx_to_values_outside_the_bounds(
    case: Any, data: st.DataObject
) -> None:
    extreme = data.draw(st.sampled_from(EXTREMES), label="extreme")
    ids = sorted(k for k in (case.path_parameters or {}) if k.endswith("_id"))
    leaves = _leaves(case.body) if isinstance(case.body, dict | list) else []
    if ids and (not leaves or data.draw(st.booleans(), label="in the path")):
        key = data.draw(st.sampled_from(ids), label="path parameter")
        case.path_parameters[key] = str(extreme).lower()
    elif leaves:
        path = data.draw(st.sampled_from(leaves), label="body leaf")
        target = case.body
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = extreme
    token = "agent-token" if case.path == "/v1/reports" else "op-token"
    case.call_and_validate(
        headers={"Authorization": f"Bearer {token}"}, checks=[not_a_server_error]
    )
    assert generate_latest(REAL_CONTROLLER.metrics.registry)
