"""A node speaks only for itself: reports through an agent credential bound to one node, over
the real API and the real controller core (store, live state, commands)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.builders import Reporter
from trainguard.clock import FakeClock
from trainguard.command_args import StartJobArgs, StopJobArgs
from trainguard.controller.api.app import create_app
from trainguard.controller.api.errors import ApiError
from trainguard.controller.api.requests import authenticate_report, request_headers
from trainguard.controller.auth import Principal, TokenStore
from trainguard.controller.composition import Controller
from trainguard.controller.tlsauth import PEER_NODE_KEY, cert_node
from trainguard.protocol import Event, encode_json

TOKENS: dict[str, tuple[str, ...]] = {
    "op-token": ("ops", "operator"),
    "n1-token": ("agent-node-1", "agent", "node-1"),
    "n2-token": ("agent-node-2", "agent", "node-2"),
    "shared-token": ("agents", "agent"),
}
OP = {"Authorization": "Bearer op-token"}
N1 = {"Authorization": "Bearer n1-token"}
N2 = {"Authorization": "Bearer n2-token"}


@pytest.fixture
def core(make_core: Callable[..., Controller]) -> Controller:
    return make_core()


@pytest.fixture
def client(core: Controller) -> Iterator[TestClient]:
    app = create_app(core, tokens=TokenStore.from_plaintext(TOKENS), max_body_bytes=64 * 1024)  # type: ignore[arg-type]
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _post(client: TestClient, report: Any, headers: dict[str, str]) -> Any:
    return client.post("/v1/reports", content=encode_json(report), headers=headers)


def test_node_token_reports_for_its_own_node(client: TestClient, core: Controller) -> None:
    r = _post(client, Reporter("node-1").report(now=1.0), N1)
    assert r.status_code == 200, r.text
    assert core.get_node("node-1").reporting


def test_forged_dbe_for_another_node_is_403_audited_and_stores_nothing(
    client: TestClient, core: Controller, core_clock: FakeClock
) -> None:
    assert _post(client, Reporter("node-2").report(now=core_clock.now()), N2).status_code == 200
    core.queue_command("node-2", StopJobArgs(job="j"), command_id="cmd-n2")
    forged = Reporter("node-2", instance="evil").report(
        now=core_clock.now(),
        dbe=1,
        events=(
            Event(id=1, kind="xid", ts=1.0, code=79),
            Event(id=2, kind="command_result", ts=1.0, data={"command_id": "cmd-n2", "ok": True}),
        ),
    )
    r = _post(client, forged, N1)
    assert r.status_code == 403
    body = r.json()
    for name in ("agent-node-1", "node-1", "node-2"):
        assert name in body["error"]
    assert body["detail"] == {
        "credential": "agent-node-1",
        "bound_node": "node-1",
        "node": "node-2",
    }
    core.tick()
    # nothing of the forged report reached node-2: no events, no DBE, its command still
    # pending and undelivered to the forger, no incident, not drained
    assert core.store.events.count("node-2") == 0
    status = core.command_status("cmd-n2")
    assert status is not None and status.done_at is None
    assert [c.id for c in core.pending_commands("node-2")] == ["cmd-n2"]
    assert core.get_node("node-2").state == "active"
    assert core.list_incidents() == []
    audit = core.audit_log(limit=10)
    assert [(a.actor, a.action, a.target) for a in audit] == [
        ("agent-node-1", "report_refused", "node-2")
    ]
    assert audit[0].detail["bound_node"] == "node-1"
    assert core.metrics.reports_refused_total._value.get() == 1


def test_command_poll_for_another_node_gets_no_command(
    client: TestClient, core: Controller, core_clock: FakeClock
) -> None:
    assert _post(client, Reporter("node-2").report(now=core_clock.now()), N2).status_code == 200
    start = StartJobArgs(
        job="j",
        attempt=1,
        command=["train.py"],
        nproc_per_node=1,
        nnodes=1,
        rdzv_endpoint="10.0.0.2:29500",
        rdzv_id="j-1",
        env={"SECRET": "x"},
    )
    core.queue_command("node-2", start, command_id="cmd-start")
    r = _post(client, Reporter("node-2").report(now=core_clock.now()), N1)
    assert r.status_code == 403
    assert "commands" not in r.json() and "SECRET" not in r.text
    status = core.command_status("cmd-start")
    assert status is not None and status.delivered_at is None


def test_ghost_node_is_not_registered(client: TestClient, core: Controller) -> None:
    r = _post(client, Reporter("ghost-7", role="spare").report(now=1.0), N1)
    assert r.status_code == 403
    assert core.list_nodes() == [] and core.list_spares() == []
    assert client.get("/v1/nodes/ghost-7", headers=OP).status_code == 404


def test_refusals_are_audited_at_most_once_a_minute_per_credential_and_node(
    client: TestClient, core: Controller, core_clock: FakeClock
) -> None:
    for _ in range(5):
        assert _post(client, Reporter("node-2").report(now=1.0), N1).status_code == 403
    core_clock.advance(61.0)
    assert _post(client, Reporter("node-2").report(now=1.0), N1).status_code == 403
    assert [a.action for a in core.audit_log(limit=10)] == ["report_refused"] * 2
    assert core.metrics.reports_refused_total._value.get() == 6


def test_role_hint_spare_does_not_make_a_spare(client: TestClient, core: Controller) -> None:
    assert _post(client, Reporter("node-1", role="spare").report(now=1.0), N1).status_code == 200
    assert client.get("/v1/spares", headers=OP).json() == []
    assert client.get("/v1/nodes/node-1", headers=OP).json()["role"] == "active"
    r = client.put("/v1/nodes/node-1/role", json={"role": "spare"}, headers=OP)
    assert r.status_code == 200
    assert [n["name"] for n in client.get("/v1/spares", headers=OP).json()] == ["node-1"]


def test_shared_agent_token_speaks_for_any_node_with_a_warning_once_per_node(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    shared = {"Authorization": "Bearer shared-token"}
    with caplog.at_level(logging.WARNING, logger="trainguard.controller.api"):
        for node in ("node-5", "node-5", "node-6"):
            assert _post(client, Reporter(node).report(now=1.0), shared).status_code == 200
    warned = [r.getMessage() for r in caplog.records if "shared_agent_token_used" in r.message]
    assert len(warned) == 2
    assert "node=node-5" in warned[0] and "node=node-6" in warned[1]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param("POST", "/v1/reports", id="reports"),
        pytest.param("GET", "/v1/nodes", id="nodes"),
        pytest.param("POST", "/v1/nodes/node-1/drain", id="drain"),
    ],
)
def test_repeated_authorization_header_is_400_on_every_route(
    client: TestClient, core: Controller, method: str, path: str
) -> None:
    body = encode_json(Reporter("node-1").report(now=1.0))
    # the operator's token last: a layer reading the last header would let it through
    headers = [("authorization", "Bearer n1-token"), ("authorization", "Bearer op-token")]
    r = client.request(method, path, content=body, headers=headers)
    assert r.status_code == 400
    assert "Authorization" in r.json()["error"]
    assert r.json()["detail"] == {"header": "Authorization"}
    assert core.list_nodes() == []


def test_repeated_other_headers_are_fine() -> None:
    headers = request_headers([(b"accept", b"a"), (b"accept", b"b"), (b"authorization", b"x")])
    assert headers[b"authorization"] == b"x"


def test_client_certificate_node_authenticates_as_that_nodes_agent() -> None:
    tokens = TokenStore.from_plaintext(TOKENS)
    scope = {"state": {PEER_NODE_KEY: "node-1"}}
    assert authenticate_report(tokens, {}, scope) == Principal("cert:node-1", "agent", "node-1")
    # a bearer token, when sent, is the credential
    headers = {b"authorization": b"Bearer n2-token"}
    assert authenticate_report(tokens, headers, scope).node == "node-2"
    with pytest.raises(ApiError) as e:
        authenticate_report(tokens, {}, {"state": {}})
    assert e.value.status == 401


@pytest.mark.parametrize(
    ("cert", "node"),
    [
        pytest.param({"subject": ((("commonName", "node-1"),),)}, "node-1", id="cn"),
        pytest.param(
            {
                "subject": ((("organizationName", "x"),), (("commonName", "node-1"),)),
                "subjectAltName": (("DNS", "node-1.cluster.example"),),
            },
            "node-1",
            id="cn-wins-over-san",
        ),
        pytest.param({"subjectAltName": (("DNS", "node-3"),)}, "node-3", id="one-dns-san"),
        pytest.param(
            {"subjectAltName": (("DNS", "node-3"), ("DNS", "node-4"))}, None, id="two-dns-sans"
        ),
        pytest.param(
            {"subject": ((("commonName", "a"),), (("commonName", "b"),))}, None, id="two-cns"
        ),
        pytest.param({"subjectAltName": (("IP Address", "10.0.0.1"),)}, None, id="ip-san-only"),
        pytest.param({}, None, id="no-certificate"),
        pytest.param(None, None, id="none"),
    ],
)
def test_certificate_names_one_node(cert: Any, node: str | None) -> None:
    assert cert_node(cert) == node
