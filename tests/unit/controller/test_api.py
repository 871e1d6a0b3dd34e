"""REST API over the recording fake service: routes, roles, errors, limits, wire encoding."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Histogram

from tests.fakes.controller_service import FakeService
from trainguard.clock import FakeClock
from trainguard.controller.api.app import create_app
from trainguard.controller.api.errors import STORE_RETRY_AFTER_S
from trainguard.controller.auth import TokenStore
from trainguard.controller.ckptinterval import advise
from trainguard.controller.failurecost import failure_cost
from trainguard.controller.store.errors import StoreUnavailable
from trainguard.controller.views import JobView
from trainguard.protocol import Event, RankState, Report, encode_json

TOKENS = {
    "op-token": ("ops-alice", "operator"),
    "agent-token": ("agents", "agent"),
    "viewer-token": ("viewer-bob", "viewer"),
}
OP = {"Authorization": "Bearer op-token"}
AGENT = {"Authorization": "Bearer agent-token"}
VIEWER = {"Authorization": "Bearer viewer-token"}


@pytest.fixture
def svc() -> FakeService:
    s = FakeService(clock=FakeClock())
    s.add_node("node-1")
    s.add_node("node-2", role="spare")
    return s


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def client(svc: FakeService, registry: CollectorRegistry) -> TestClient:
    hist = Histogram("trainguard_test_report_seconds", "x", registry=registry)
    app = create_app(
        svc,
        tokens=TokenStore.from_plaintext(TOKENS),  # type: ignore[arg-type]
        max_body_bytes=64 * 1024,
        metrics_registry=registry,
        report_latency=hist,
    )
    return TestClient(app, raise_server_exceptions=False)


def _report(**kw: Any) -> Report:
    base: dict[str, Any] = {"node": "node-9", "instance": "i-1", "seq": 1, "sent_at": 1.0}
    base.update(kw)
    return Report(**base)


def test_report_from_agent_is_ingested_and_answered(client: TestClient, svc: FakeService) -> None:
    events = (Event(id=4, kind="xid", ts=1.0, code=79), Event(id=7, kind="xid", ts=2.0, code=48))
    r = client.post("/v1/reports", content=encode_json(_report(events=events)), headers=AGENT)
    assert r.status_code == 200, r.text
    assert r.json()["ack_event_id"] == 7
    call = svc.calls[-1]
    assert call.method == "ingest_report"
    assert call.kwargs == {"actor": "agents"}
    assert call.args[0].events == events


def test_report_with_nan_loss_reaches_service_as_nan(client: TestClient, svc: FakeService) -> None:
    rank = RankState(job="j", rank=0, step=3, loss=float("nan"))
    r = client.post("/v1/reports", content=encode_json(_report(ranks=(rank,))), headers=AGENT)
    assert r.status_code == 200
    loss = svc.calls[-1].args[0].ranks[0].loss
    assert loss != loss  # NaN


def test_report_latency_is_observed(client: TestClient, registry: CollectorRegistry) -> None:
    client.post("/v1/reports", content=encode_json(_report()), headers=AGENT)
    assert registry.get_sample_value("trainguard_test_report_seconds_count") == 1.0


def test_queued_command_rides_on_report_response(client: TestClient) -> None:
    r = client.post("/v1/nodes/node-1/faults", json={"kind": "dbe", "gpu": 2}, headers=OP)
    assert r.status_code == 202
    cid = r.json()["command_id"]
    r = client.post("/v1/reports", content=encode_json(_report(node="node-1")), headers=AGENT)
    cmds = r.json()["commands"]
    assert [c["id"] for c in cmds] == [cid]
    assert cmds[0]["kind"] == "inject_fault"
    assert cmds[0]["args"]["gpu"] == 2


@pytest.mark.parametrize("kind", ["sdc", "reset_fail"])
def test_the_lifecycle_faults_are_on_the_wire(client: TestClient, kind: str) -> None:
    r = client.post("/v1/nodes/node-1/faults", json={"kind": kind, "gpu": 1}, headers=OP)
    assert r.status_code == 202, r.text
    r = client.post("/v1/nodes/node-1/faults", json={"kind": kind + "x", "gpu": 1}, headers=OP)
    assert 400 <= r.status_code < 500 and "kind" in r.text, r.text


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        pytest.param(
            b'{"node": "n", "instance": "i", "seq": "1", "sent_at": 1}',
            422,
            "seq",
            id="string-for-int",
        ),
        pytest.param(
            b'{"node": "n", "instance": "i", "seq": 1, "sent_at": 1, "x": 1}',
            422,
            "x",
            id="unknown-key",
        ),
        pytest.param(
            b'{"node": "n", "instance": "i", "seq": 1, "sent_at": 1, "gpus": [{"index": 0}]}',
            422,
            "gpus[0].uuid",
            id="nested-missing",
        ),
        pytest.param(
            b'{"node": "n", "instance": "i", "seq": 1, "sent_at": 1, "v": 9}',
            422,
            "v",
            id="wrong-version",
        ),
        pytest.param(b"[1, 2]", 422, "", id="not-an-object"),
        pytest.param(b"{not json", 400, "", id="invalid-json"),
        pytest.param(b"", 400, "", id="empty"),
    ],
)
def test_bad_report_gets_4xx_naming_the_field(
    client: TestClient, svc: FakeService, body: bytes, status: int, field: str
) -> None:
    r = client.post("/v1/reports", content=body, headers=AGENT)
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["error"]
    assert payload["detail"]["field"] == field
    assert "ingest_report" not in svc.methods_called()


def test_oversized_body_is_413_json(client: TestClient) -> None:
    r = client.post("/v1/reports", content=b"x" * (64 * 1024 + 1), headers=AGENT)
    assert r.status_code == 413
    assert r.json()["detail"] == {"max_bytes": 64 * 1024}


def test_oversized_chunked_body_without_length_is_413(client: TestClient) -> None:
    def chunks() -> Any:
        for _ in range(100):
            yield b"x" * 1024

    r = client.post("/v1/reports", content=chunks(), headers=AGENT)
    assert r.status_code == 413


@pytest.mark.parametrize(
    ("method", "path", "headers", "status"),
    [
        pytest.param("GET", "/v1/nodes", {}, 401, id="no-token"),
        pytest.param("GET", "/v1/nodes", {"Authorization": "Bearer nope"}, 401, id="unknown-token"),
        pytest.param("GET", "/v1/nodes", {"Authorization": "Basic b3A6eA=="}, 401, id="not-bearer"),
        pytest.param("GET", "/v1/nodes", AGENT, 403, id="agent-cannot-read"),
        pytest.param("POST", "/v1/reports", VIEWER, 403, id="viewer-cannot-report"),
        pytest.param("POST", "/v1/reports", OP, 403, id="operator-cannot-report"),
        pytest.param("POST", "/v1/nodes/node-1/undrain", VIEWER, 403, id="viewer-cannot-undrain"),
        pytest.param("POST", "/v1/rules/reload", AGENT, 403, id="agent-cannot-reload"),
        pytest.param("DELETE", "/v1/silences/1", VIEWER, 403, id="viewer-cannot-unsilence"),
        pytest.param("GET", "/v1/audit", VIEWER, 200, id="viewer-reads-audit"),
        pytest.param("GET", "/healthz", {}, 200, id="healthz-open"),
        pytest.param("GET", "/metrics", {}, 200, id="metrics-open"),
    ],
)
def test_roles_and_tokens(
    client: TestClient, method: str, path: str, headers: dict[str, str], status: int
) -> None:
    r = client.request(method, path, headers=headers)
    assert r.status_code == status, r.text
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"
        assert "error" in r.json()


def test_drain_and_undrain_record_actor_and_reason(client: TestClient, svc: FakeService) -> None:
    r = client.post("/v1/nodes/node-1/drain", json={"reason": "bad gpu"}, headers=OP)
    assert r.status_code == 200
    assert r.json()["state"] == "drained"
    assert r.json()["drain_reason"] == "bad gpu"
    r = client.post("/v1/nodes/node-1/undrain", headers=OP)
    assert r.json()["state"] == "active"
    audit = client.get("/v1/audit", headers=VIEWER).json()
    assert [(a["actor"], a["action"]) for a in audit] == [
        ("ops-alice", "undrain"),
        ("ops-alice", "drain"),
    ]


def test_retire_and_return_a_node(client: TestClient, svc: FakeService) -> None:
    r = client.post("/v1/nodes/node-2/retire", json={"reason": "RMA 4411"}, headers=OP)
    assert r.status_code == 200, r.text
    assert (r.json()["state"], r.json()["drain_reason"]) == ("retired", "retired: RMA 4411")
    r = client.post("/v1/nodes/node-2/return", headers=OP)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "validating"
    r = client.get("/v1/nodes/node-2", headers=VIEWER)
    assert r.json()["state"] == "active"
    assert r.json()["last_preflight"]["passed"] is True
    audit = client.get("/v1/audit", headers=VIEWER).json()
    assert [(a["actor"], a["action"]) for a in audit][:2] == [
        ("ops-alice", "validate"),
        ("ops-alice", "retire"),
    ]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        pytest.param(None, "reason", id="no-body"),
        pytest.param({}, "reason", id="no-reason"),
        pytest.param({"reason": 7}, "reason", id="reason-not-a-string"),
        pytest.param({"reason": "x" * 5000}, "reason", id="reason-too-long"),
        pytest.param({"reason": "rma", "extra": 1}, "extra", id="unknown-field"),
    ],
)
def test_retire_refuses_bad_input_naming_the_field(
    client: TestClient, svc: FakeService, body: Any, field: str
) -> None:
    r = client.post("/v1/nodes/node-2/retire", json=body, headers=OP)
    assert 400 <= r.status_code < 500, r.text
    assert field in r.text
    assert svc.nodes["node-2"].state == "active"


def test_retire_and_return_need_an_operator(client: TestClient) -> None:
    for path in ("/v1/nodes/node-2/retire", "/v1/nodes/node-2/return"):
        assert client.post(path, json={"reason": "x"}, headers=VIEWER).status_code == 403


def test_return_of_a_node_in_service_is_a_conflict(client: TestClient) -> None:
    r = client.post("/v1/nodes/node-1/return", headers=OP)
    assert r.status_code == 409
    assert "only a drained or retired node returns" in r.json()["error"]


@pytest.mark.parametrize(
    ("body", "headers", "reason"),
    [
        pytest.param(None, {}, "drained by ops-alice (operator) via api", id="no-body-via-api"),
        pytest.param({}, {}, "drained by ops-alice (operator) via api", id="no-reason-via-api"),
        pytest.param(
            {"reason": "  "}, {}, "drained by ops-alice (operator) via api", id="blank-reason"
        ),
        pytest.param(
            {},
            {"X-Trainguard-Client": "agentctl"},
            "drained by ops-alice (operator) via agentctl",
            id="client-header-names-via",
        ),
        pytest.param(
            {},
            {"X-Trainguard-Client": "bad client"},
            "drained by ops-alice (operator) via api",
            id="malformed-client-header-is-api",
        ),
        pytest.param(
            {"reason": "xid 79"}, {"X-Trainguard-Client": "agentctl"}, "xid 79", id="given-kept"
        ),
    ],
)
def test_drain_without_reason_records_who_and_how(
    client: TestClient,
    svc: FakeService,
    body: dict[str, str] | None,
    headers: dict[str, str],
    reason: str,
) -> None:
    r = client.post("/v1/nodes/node-1/drain", json=body, headers={**OP, **headers})
    assert r.status_code == 200, r.text
    assert r.json()["drain_reason"] == reason
    assert svc.calls[-1].kwargs == {"reason": reason, "actor": "ops-alice"}


def test_drain_body_must_still_be_a_drain_request(client: TestClient) -> None:
    r = client.post("/v1/nodes/node-1/drain", json={"reason": 7}, headers=OP)
    assert r.status_code == 422, r.text
    r = client.post("/v1/nodes/node-1/drain", json={"why": "x"}, headers=OP)
    assert r.status_code == 422, r.text


def test_unknown_node_is_404_json(client: TestClient) -> None:
    r = client.post("/v1/nodes/ghost/drain", json={"reason": "x"}, headers=OP)
    assert r.status_code == 404
    assert r.json() == {"error": "node ghost not found", "detail": None}


def test_role_change_validates_role(client: TestClient) -> None:
    assert (
        client.put("/v1/nodes/node-1/role", json={"role": "spare"}, headers=OP).json()["role"]
        == "spare"
    )
    r = client.put("/v1/nodes/node-1/role", json={"role": "boss"}, headers=OP)
    assert r.status_code == 422
    assert r.json()["detail"]["field"] == "role"


def test_spares_lists_only_spares(client: TestClient) -> None:
    assert [n["name"] for n in client.get("/v1/spares", headers=VIEWER).json()] == ["node-2"]


def test_incident_filters_pass_through(client: TestClient, svc: FakeService) -> None:
    svc.add_incident(id=1, node="node-1", state="open")
    svc.add_incident(id=2, node="node-2", state="resolved")
    r = client.get("/v1/incidents?state=open&node=node-1&limit=5", headers=VIEWER)
    assert [i["id"] for i in r.json()] == [1]
    # one more than the page, to tell a full page from the last
    assert svc.calls[-1].kwargs == {
        "state": "open",
        "node": "node-1",
        "limit": 6,
        "before_id": None,
    }
    detail = client.get("/v1/incidents/2", headers=VIEWER).json()
    assert detail["incident"]["state"] == "resolved"
    assert detail["timeline"][0]["kind"] == "opened"


@pytest.mark.parametrize(
    "query",
    [
        pytest.param("state=exploded", id="bad-state"),
        pytest.param("limit=0", id="zero-limit"),
        pytest.param("limit=abc", id="non-int-limit"),
    ],
)
def test_bad_incident_query_is_422(client: TestClient, query: str) -> None:
    r = client.get(f"/v1/incidents?{query}", headers=VIEWER)
    assert r.status_code == 422
    assert r.json()["error"] == "invalid request"


def test_job_with_nan_ettr_is_sent_as_string(client: TestClient, svc: FakeService) -> None:
    svc.jobs["j"] = JobView(name="j", state="running", ettr=float("nan"))
    r = client.get("/v1/jobs/j", headers=VIEWER)
    assert r.status_code == 200
    assert json.loads(r.content)["ettr"] == "NaN"
    assert client.get("/v1/jobs/missing", headers=VIEWER).status_code == 404


def test_job_view_carries_its_checkpoint_interval_and_failure_cost(
    client: TestClient, svc: FakeService
) -> None:
    advice = advise(checkpoint_s=300, restart_s=600, node_mtbf_s=43200, nodes=1, current_s=1800)
    cost = failure_cost(recoveries=[{"phases_s": {"mttr": 360.0}}], gpus=10, step_time_s=None)
    svc.jobs["j"] = JobView(
        name="j", state="running", checkpoint_interval=advice, failure_cost=cost
    )
    got = client.get("/v1/jobs/j", headers=VIEWER).json()
    assert round(got["checkpoint_interval"]["optimal_s"]) == 4893
    assert got["checkpoint_interval"]["current_s"] == 1800
    assert got["failure_cost"]["lost_gpu_hours"] == 1.0
    doc = client.get("/v1/openapi.json").json()["components"]["schemas"]
    assert {"optimal_s", "optimal_waste", "current_waste"} <= set(
        doc["IntervalAdvice"]["properties"]
    )
    assert "lost_gpu_hours" in doc["FailureCost"]["properties"]


def test_silence_lifecycle(client: TestClient, svc: FakeService) -> None:
    body = {"rule": "gpu_dbe", "node": "node-1", "duration_s": 7200, "comment": "rma"}
    r = client.post("/v1/silences", json=body, headers=OP)
    assert r.status_code == 201
    sid = r.json()["id"]
    assert r.json()["created_by"] == "ops-alice"
    assert [s["id"] for s in client.get("/v1/silences", headers=VIEWER).json()] == [sid]
    assert client.delete(f"/v1/silences/{sid}", headers=OP).status_code == 204
    assert client.delete(f"/v1/silences/{sid}", headers=OP).status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"rule": "r", "duration_s": "NaN"}, id="nan-duration"),
        pytest.param({"rule": "r", "duration_s": -1}, id="negative-duration"),
        pytest.param({"duration_s": 60}, id="neither-rule-nor-node"),
    ],
)
def test_bad_silence_is_400(client: TestClient, body: dict[str, Any]) -> None:
    r = client.post("/v1/silences", json=body, headers=OP)
    assert r.status_code == 400, r.text


def test_rules_reload_reports_count_or_error(client: TestClient, svc: FakeService) -> None:
    assert client.post("/v1/rules/reload", headers=OP).json() == {"rules": 3}
    svc.reload_error = "rules/x.yaml: rule bad: unknown signal"
    r = client.post("/v1/rules/reload", headers=OP)
    assert r.status_code == 400
    assert r.json()["error"] == "rules/x.yaml: rule bad: unknown signal"


def test_unexpected_service_failure_is_500_json_and_logs_no_token(
    client: TestClient, svc: FakeService, caplog: pytest.LogCaptureFixture
) -> None:
    def boom() -> None:
        raise RuntimeError("db gone")

    svc.list_jobs = boom  # type: ignore[method-assign]
    with caplog.at_level(logging.DEBUG):
        r = client.get("/v1/jobs", headers=VIEWER)
    assert r.status_code == 500
    assert r.json() == {"error": "internal error", "detail": None}
    assert "viewer-token" not in caplog.text
    assert "event=api_error" in caplog.text


def test_unknown_route_is_json_404(client: TestClient) -> None:
    r = client.get("/v1/nope", headers=VIEWER)
    assert r.status_code == 404
    assert "error" in r.json()


def test_openapi_describes_report_body_and_response(client: TestClient) -> None:
    doc = client.get("/v1/openapi.json").json()
    op = doc["paths"]["/v1/reports"]["post"]
    body_ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body_ref.endswith("/Report")
    report = doc["components"]["schemas"]["Report"]
    assert report["additionalProperties"] is False
    assert set(report["required"]) == {"node", "instance", "seq", "sent_at"}
    # a loss may be NaN (it travels as a string); a temperature is a finite number
    loss = doc["components"]["schemas"]["RankState"]["properties"]["loss"]
    assert {"enum": ["NaN", "Infinity", "-Infinity"], "type": "string"} in loss["anyOf"]
    temp = doc["components"]["schemas"]["GpuSample"]["properties"]["temperature_celsius"]
    assert {"type": "number"} in temp["anyOf"]
    step = doc["components"]["schemas"]["RankState"]["properties"]["step"]
    assert (step["minimum"], step["maximum"]) == (-(2**63), 2**63 - 1)
    resp = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert resp.endswith("/ReportResponse")
    assert "HTTPValidationError" not in doc["components"]["schemas"]


def test_report_ingest_failure_is_500_json(client: TestClient, svc: FakeService) -> None:
    def boom(report: Report, *, actor: str) -> None:
        raise RuntimeError("store is gone")

    svc.ingest_report = boom  # type: ignore[assignment,method-assign]
    r = client.post("/v1/reports", content=encode_json(_report()), headers=AGENT)
    assert r.status_code == 500
    assert r.json() == {"error": "internal error", "detail": None}


@pytest.mark.parametrize(
    ("header", "status"),
    [
        pytest.param("bearer agent-token", 200, id="scheme-any-case"),
        pytest.param("Bearer  agent-token ", 200, id="extra-spaces"),
        pytest.param("Token agent-token", 401, id="other-scheme"),
        pytest.param("Bearer", 401, id="no-credentials"),
    ],
)
def test_report_authorization_header_parsing(client: TestClient, header: str, status: int) -> None:
    r = client.post(
        "/v1/reports", content=encode_json(_report()), headers={"Authorization": header}
    )
    assert r.status_code == status, r.text


LOST = "postgresql://trainguard:***@db:5432/tg: connection lost: server closed the connection"


def _store_lost(*args: Any, **kwargs: Any) -> Any:
    raise StoreUnavailable(LOST)


def _assert_store_unavailable(status: int, body: bytes, headers: Any) -> None:
    assert status == 503
    assert headers["Retry-After"] == str(STORE_RETRY_AFTER_S)
    error = json.loads(body)
    assert "cannot reach its store" in error["error"]
    assert error["detail"] == {"reason": "store_unavailable"}
    assert "db:5432" not in body.decode()  # the URL is for the log, not for the caller


@pytest.mark.parametrize(
    ("method", "path", "attr", "body"),
    [
        pytest.param("GET", "/v1/incidents", "list_incidents", None, id="get-incidents"),
        pytest.param("GET", "/v1/audit", "audit_log", None, id="get-audit"),
        pytest.param("POST", "/v1/nodes/node-1/drain", "drain", {"reason": "x"}, id="post-drain"),
        pytest.param(
            "POST",
            "/v1/silences",
            "create_silence",
            {"rule": "gpu_hot", "duration_s": 60, "comment": "c"},
            id="post-silence",
        ),
    ],
)
def test_a_request_needing_the_unreachable_store_is_503_with_retry_after(
    client: TestClient, svc: FakeService, method: str, path: str, attr: str, body: Any
) -> None:
    setattr(svc, attr, _store_lost)
    r = client.request(method, path, json=body, headers=OP)
    _assert_store_unavailable(r.status_code, r.content, r.headers)


def test_a_report_whose_ingest_finds_no_store_is_503_with_retry_after(
    client: TestClient, svc: FakeService
) -> None:
    svc.ingest_report = _store_lost  # type: ignore[method-assign]
    r = client.post("/v1/reports", content=encode_json(_report()), headers=AGENT)
    _assert_store_unavailable(r.status_code, r.content, r.headers)


def test_a_report_handed_over_by_an_ingest_worker_finds_no_store_is_503(svc: FakeService) -> None:
    svc.ingest_report = _store_lost  # type: ignore[method-assign]
    app: Any = create_app(
        svc,
        tokens=TokenStore.from_plaintext(TOKENS),
        max_body_bytes=64 * 1024,
    )
    status, body, headers = asyncio.run(
        app.report_path.decode_and_ingest(encode_json(_report()), actor="agents", node=None)
    )
    _assert_store_unavailable(status, body, headers)


def test_api_docs_page_is_self_contained_and_lists_the_operations(client: TestClient) -> None:
    page = client.get("/v1/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    # nothing it loads comes from anywhere else: no absolute URL, no external script or style
    assert (
        "http://" not in page.text and "https://" not in page.text and "//" + "cdn" not in page.text
    )
    assert "<script src" not in page.text and "<link" not in page.text
    assert 'fetch("openapi.json")' in page.text  # relative: /v1/openapi.json on this origin
    assert client.get("/v1/openapi.json").json()["paths"]["/v1/nodes"]
