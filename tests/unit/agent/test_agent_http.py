"""AgentHttpServer on loopback: /metrics, /healthz, and who may inject faults."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from trainguard.agent.metrics import AgentHttpServer, AgentSnapshot, SnapshotCollector
from trainguard.protocol import FaultSpec


class Injector:
    def __init__(self) -> None:
        self.specs: list[FaultSpec] = []

    def __call__(self, spec: FaultSpec) -> dict[str, Any]:
        self.specs.append(spec)
        return {"fault": spec.kind}


def serve(*, inject: Any, healthy: bool = True, address: str = "127.0.0.1") -> AgentHttpServer:
    snap = AgentSnapshot(node="n1", version="0.1.0")
    srv = AgentHttpServer(
        address=address,
        port=0,
        collector=SnapshotCollector(lambda: snap),
        health=lambda: (healthy, "ok" if healthy else "stale: last collect 9.0s ago"),
        inject=inject,
    )
    srv.start()
    return srv


@pytest.fixture
def injector() -> Injector:
    return Injector()


@pytest.fixture
def server(injector: Injector) -> Iterator[AgentHttpServer]:
    srv = serve(inject=injector)
    yield srv
    srv.close()


def url(srv: AgentHttpServer, path: str, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{srv.port}{path}"


def test_metrics_and_healthz(server: AgentHttpServer) -> None:
    r = httpx.get(url(server, "/metrics"), timeout=5)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert 'trainguard_agent_info{node="n1",version="0.1.0"} 1.0' in r.text
    assert httpx.get(url(server, "/healthz"), timeout=5).text == "ok\n"
    assert httpx.get(url(server, "/nope"), timeout=5).status_code == 404


def test_unhealthy_loop_answers_503() -> None:
    srv = serve(inject=None, healthy=False)
    try:
        r = httpx.get(url(srv, "/healthz"), timeout=5)
        assert r.status_code == 503 and r.text.startswith("stale")
    finally:
        srv.close()


def test_loopback_client_can_inject(server: AgentHttpServer, injector: Injector) -> None:
    r = httpx.post(url(server, "/v1/faults"), json={"kind": "thermal", "gpu": 3}, timeout=5)
    assert r.status_code == 200 and r.json() == {"ok": True, "fault": "thermal"}
    assert injector.specs == [FaultSpec(kind="thermal", gpu=3)]


def test_without_sim_backend_fault_endpoint_is_404() -> None:
    srv = serve(inject=None)
    try:
        r = httpx.post(url(srv, "/v1/faults"), json={"kind": "dbe"}, timeout=5)
        assert r.status_code == 404 and "sim" in r.json()["detail"]
    finally:
        srv.close()


def test_oversized_fault_body_is_413(server: AgentHttpServer, injector: Injector) -> None:
    r = httpx.post(url(server, "/v1/faults"), content=b"x" * 70_000, timeout=5)
    assert r.status_code == 413 and injector.specs == []


def _non_loopback_ipv4() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a source address
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def test_non_loopback_client_is_refused_403(injector: Injector) -> None:
    addr = _non_loopback_ipv4()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    srv = serve(inject=injector, address="0.0.0.0")
    try:
        r = httpx.post(url(srv, "/v1/faults", host=addr), json={"kind": "dbe"}, timeout=5)
        assert r.status_code == 403 and "loopback" in r.json()["detail"]
        assert injector.specs == []
    finally:
        srv.close()
