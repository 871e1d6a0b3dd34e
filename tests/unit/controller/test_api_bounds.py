"""Entry-point bounds of issue 20: a drain reason bounded on every path (422 on the API,
agentctl, incident-made reasons and the Slurm reason cut), the cap on active silences and
`GET /v1/silences` paged."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Histogram

from tests.fakes.controller_service import FakeService
from trainguard.bounds import DRAIN_REASON_MAX_CHARS, bad_drain_reason, clip_drain_reason
from trainguard.clock import FakeClock
from trainguard.controller.api.app import create_app
from trainguard.controller.api.routing import CONTINUE_HEADER
from trainguard.controller.auth import TokenStore
from trainguard.controller.backends.slurm.backend import REASON_PREFIX, trainguard_reason
from trainguard.controller.cli import main as agentctl
from trainguard.controller.cli.errors import EXIT
from trainguard.controller.errors import LimitReached

OP = {"Authorization": "Bearer op-token"}
TOKENS = {"op-token": ("ops-alice", "operator")}


@pytest.fixture
def svc() -> FakeService:
    s = FakeService(clock=FakeClock())
    s.add_node("node-1")
    return s


@pytest.fixture
def client(svc: FakeService) -> TestClient:
    registry = CollectorRegistry()
    app = create_app(
        svc,
        tokens=TokenStore.from_plaintext(TOKENS),  # type: ignore[arg-type]
        max_body_bytes=4 * 1024 * 1024,
        metrics_registry=registry,
        report_latency=Histogram("trainguard_test_report_seconds", "x", registry=registry),
    )
    return TestClient(app, raise_server_exceptions=False)


# --- drain reasons ---------------------------------------------------------------------------


def test_a_drain_reason_over_the_bound_is_a_422_naming_the_field(
    client: TestClient, svc: FakeService
) -> None:
    r = client.post("/v1/nodes/node-1/drain", json={"reason": "x" * (128 * 1024 + 1)}, headers=OP)
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["field"] == "reason"
    assert not any(c.name == "drain" for c in svc.calls)
    ok = client.post(
        "/v1/nodes/node-1/drain", json={"reason": "y" * DRAIN_REASON_MAX_CHARS}, headers=OP
    )
    assert ok.status_code == 200, ok.text


def test_agentctl_refuses_a_drain_reason_over_the_bound_before_sending(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("op-token\n")
    token.chmod(0o600)
    out, err = io.StringIO(), io.StringIO()
    argv = ["drain", "node-1", "--reason", "x" * 5000]
    argv += ["--url", "http://127.0.0.1:9", "--token-file", str(token)]
    code = agentctl(argv, stdin=io.StringIO(), stdout=out, stderr=err)
    assert code == EXIT["usage"], err.getvalue()
    assert "--reason: at most 1024 characters, got 5000" in err.getvalue()


def test_composed_reasons_are_cut_not_refused() -> None:
    assert bad_drain_reason("ok") is None
    long = "incident 7: " + "s" * 200_000
    cut = clip_drain_reason(long)
    assert len(cut) == DRAIN_REASON_MAX_CHARS and cut.endswith("... (cut)")
    assert clip_drain_reason("short") == "short"
    slurm = trainguard_reason(reason=long, rule=None, incident_id=None)
    assert len(slurm) <= DRAIN_REASON_MAX_CHARS and slurm.startswith(REASON_PREFIX)


# --- silences --------------------------------------------------------------------------------


def test_silences_are_paged_with_limit_and_continue(client: TestClient) -> None:
    for i in range(5):
        body = {"rule": f"r{i}", "duration_s": 600}
        assert client.post("/v1/silences", json=body, headers=OP).status_code == 201
    first = client.get("/v1/silences?limit=2", headers=OP)
    assert first.status_code == 200
    ids = [s["id"] for s in first.json()]
    assert len(ids) == 2
    seen = list(ids)
    after = first.headers[CONTINUE_HEADER]
    while True:
        page = client.get(f"/v1/silences?limit=2&continue={after}", headers=OP)
        seen += [s["id"] for s in page.json()]
        if CONTINUE_HEADER not in page.headers:
            break
        after = page.headers[CONTINUE_HEADER]
    assert seen == sorted(seen) and len(seen) == 5
    whole = client.get("/v1/silences", headers=OP)
    assert [s["id"] for s in whole.json()] == seen and CONTINUE_HEADER not in whole.headers


@pytest.mark.parametrize("query", ["limit=0", "limit=10001", "continue=-1"])
def test_silence_page_parameters_are_bounded(client: TestClient, query: str) -> None:
    assert client.get(f"/v1/silences?{query}", headers=OP).status_code == 422


def test_silences_beyond_the_cap_are_refused_naming_the_limit(make_core) -> None:
    c = make_core(api={"max_silences": 2})
    for rule in ("a", "b"):
        c.create_silence(rule=rule, node=None, duration_s=60, comment="", actor="op")
    with pytest.raises(LimitReached) as e:
        c.create_silence(rule="c", node=None, duration_s=60, comment="", actor="op")
    assert "api.max_silences" in str(e.value) and "(2)" in str(e.value)
    assert LimitReached.status == 403
    # an expired or deleted silence makes room
    first = c.list_silences()[0]
    c.delete_silence(first.id, actor="op")
    c.create_silence(rule="c", node=None, duration_s=60, comment="", actor="op")


# --- jobs, incidents and audit: paged like silences ------------------------------------------


def _walk(client: TestClient, path: str, *, limit: int) -> list[object]:
    """Every page of `path`, following CONTINUE_HEADER; each item's key."""
    key = "name" if path == "/v1/jobs" else "id"
    seen: list[object] = []
    params: dict[str, object] = {"limit": limit}
    while True:
        r = client.get(path, params=params, headers=OP)
        assert r.status_code == 200, r.text
        assert len(r.json()) <= limit
        seen += [item[key] for item in r.json()]
        if CONTINUE_HEADER not in r.headers:
            return seen
        params["continue"] = r.headers[CONTINUE_HEADER]


def test_jobs_are_paged_by_name(client: TestClient, svc: FakeService) -> None:
    names = [f"job-{i:02d}" for i in range(7)]
    for name in reversed(names):
        svc.add_job(name)
    assert _walk(client, "/v1/jobs", limit=3) == names
    assert _walk(client, "/v1/jobs", limit=7) == names
    whole = client.get("/v1/jobs", headers=OP)
    assert [j["name"] for j in whole.json()] == names and CONTINUE_HEADER not in whole.headers


def test_incidents_and_audit_are_paged_newest_first(client: TestClient, svc: FakeService) -> None:
    for i in range(1, 8):
        svc.add_incident(id=i, node="node-1", opened_at=1.0)
        svc._audit("ops", "drain", f"node-{i}")
    assert _walk(client, "/v1/incidents", limit=3) == list(range(7, 0, -1))
    assert _walk(client, "/v1/audit", limit=2) == list(range(7, 0, -1))
    r = client.get("/v1/incidents", params={"limit": 7}, headers=OP)
    assert len(r.json()) == 7 and CONTINUE_HEADER not in r.headers


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/incidents", "/v1/audit"])
@pytest.mark.parametrize("query", ["limit=0", "limit=10001"])
def test_list_page_sizes_are_bounded(client: TestClient, path: str, query: str) -> None:
    assert client.get(f"{path}?{query}", headers=OP).status_code == 422


@pytest.mark.parametrize("path", ["/v1/incidents", "/v1/audit"])
def test_an_id_continue_must_be_a_positive_id(client: TestClient, path: str) -> None:
    assert client.get(f"{path}?continue=0", headers=OP).status_code == 422
    assert client.get(f"{path}?continue=x", headers=OP).status_code == 422


def test_the_openapi_document_names_the_continue_header(client: TestClient) -> None:
    doc = client.get("/v1/openapi.json", headers=OP).json()
    for path in ("/v1/jobs", "/v1/incidents", "/v1/audit", "/v1/silences"):
        ok = doc["paths"][path]["get"]["responses"]["200"]
        assert CONTINUE_HEADER in ok["headers"], path
