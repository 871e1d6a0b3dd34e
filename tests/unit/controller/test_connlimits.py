"""Connection and body bounds (controller/connlimits.py) without a server: the connection
table's choice of what to close, requests and body bytes in flight per credential, and the
middleware's answers before any body is read."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from trainguard.controller import connlimits
from trainguard.controller.config import ConnectionsConfig
from trainguard.controller.connlimits import (
    FD_RESERVE,
    ConnectionTable,
    ConnLimits,
    CredentialLimits,
    InFlight,
    conn_limits,
    credential_key,
    open_connection_cap,
)
from trainguard.strict import ConfigError, build

LIMITS = ConnLimits(
    max_open=3,
    header_timeout_s=1.0,
    body_timeout_s=1.0,
    idle_timeout_s=1.0,
    per_credential_requests=2,
    per_credential_body_bytes=100,
    total_body_bytes=150,
)


def test_a_full_table_closes_a_never_answered_connection_before_an_agents() -> None:
    table = ConnectionTable(max_open=3)
    closed: list[str] = []
    table.admit("agent", now=0.0, close=closed.append)
    table.busy("agent")
    table.idle("agent", now=5.0)  # answered a request at t=5
    table.admit("silent-1", now=1.0, close=closed.append)
    table.admit("silent-2", now=2.0, close=closed.append)
    assert table.admit("new", now=6.0, close=closed.append)
    assert closed == ["silent-1"]  # never answered, idle longest
    assert table.admit("new-2", now=7.0, close=closed.append)
    assert closed == ["silent-1", "silent-2"]
    assert len(table) == 3


def test_a_full_table_of_busy_connections_refuses() -> None:
    table = ConnectionTable(max_open=2)
    for c in ("a", "b"):
        table.admit(c, now=0.0, close=lambda _: None)
        table.busy(c)
    assert not table.admit("c", now=1.0, close=lambda _: None)
    table.remove("a")
    assert table.admit("c", now=1.0, close=lambda _: None)


def test_the_connection_cap_stays_below_the_fd_limit() -> None:
    assert open_connection_cap(0, fd_limit=2048) == 2048 - FD_RESERVE
    assert open_connection_cap(5000, fd_limit=2048) == 2048 - FD_RESERVE
    assert open_connection_cap(100, fd_limit=2048) == 100
    assert conn_limits(ConnectionsConfig()).max_open <= open_connection_cap(0)


def test_in_flight_counts_requests_and_bytes_per_credential_and_in_total(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(connlimits, "SMALL_BODY_BYTES", 50)
    f = InFlight(LIMITS)
    assert f.admit("a", 60) is None
    refused = f.admit("a", 60)
    assert refused is not None and refused[0] == 429
    assert refused[2]["limit"] == "api.connections.per_credential_body_bytes"
    assert f.admit("a", 10) is None
    refused = f.admit("a", 0)
    assert refused is not None and refused[2]["limit"] == "api.connections.per_credential_requests"
    assert f.admit("b", 90) is not None  # 70 + 90 > 150 in total
    refused = f.admit("b", 90)
    assert refused is not None and (refused[0], refused[2]["limit"]) == (
        503,
        "api.connections.total_body_bytes",
    )
    assert f.admit("c", 10) is None  # a small body passes the total cap (its own still holds)
    f.release("c", 10)
    f.release("a", 60)
    f.release("a", 10)
    assert f.total_bytes == 0 and f.keys() == 0
    assert f.admit("b", 90) is None


def test_the_credential_is_the_authorization_header_hashed_else_the_peer() -> None:
    a = {"headers": [(b"authorization", b"Bearer secret")], "client": ("10.0.0.1", 5)}
    b = {"headers": [], "client": ("10.0.0.1", 6)}
    assert credential_key(a).startswith("auth:") and "secret" not in credential_key(a)
    assert credential_key(b) == "peer:10.0.0.1"


def _request(auth: bytes, length: int | None) -> dict[str, Any]:
    headers = [(b"authorization", auth)]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    return {"type": "http", "path": "/v1/reports", "headers": headers, "client": ("1.2.3.4", 1)}


def test_the_middleware_answers_before_reading_the_body_and_releases_after() -> None:
    async def run() -> None:
        gate = asyncio.Event()
        calls: list[str] = []

        async def app(scope: Any, receive: Any, send: Any) -> None:
            calls.append(scope["path"])
            await gate.wait()
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

        mw = CredentialLimits(app, limits=LIMITS)
        sent: list[list[dict[str, Any]]] = [[], [], []]
        received: list[int] = []

        def receiver() -> Any:
            async def receive() -> dict[str, Any]:
                received.append(1)
                return {"type": "http.request", "body": b"x" * 60, "more_body": False}

            return receive

        def sender(i: int) -> Any:
            async def send(message: dict[str, Any]) -> None:
                sent[i].append(message)

            return send

        first = asyncio.create_task(mw(_request(b"Bearer t", 60), receiver(), sender(0)))
        await asyncio.sleep(0)
        await mw(_request(b"Bearer t", 60), receiver(), sender(1))  # refused at once
        assert sent[1][0]["status"] == 429 and b"per_credential_body_bytes" in sent[1][1]["body"]
        assert received == []  # no body read for anyone yet
        gate.set()
        await first
        assert sent[0][0]["status"] == 200
        assert mw.in_flight.total_bytes == 0
        await mw(_request(b"Bearer t", 60), receiver(), sender(2))
        assert sent[2][0]["status"] == 200

    asyncio.run(run())


def test_a_body_without_a_declared_length_is_counted_as_it_arrives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(connlimits, "SMALL_BODY_BYTES", 50)

    async def run() -> None:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            while (await receive()).get("more_body"):
                pass
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        chunks = iter([b"x" * 60, b"x" * 60])
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": next(chunks), "more_body": True}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        mw = CredentialLimits(app, limits=LIMITS)
        await mw(_request(b"Bearer t", None), receive, send)
        assert sent[0]["status"] == 429
        assert mw.in_flight.total_bytes == 0

    asyncio.run(run())


@pytest.mark.parametrize(
    ("data", "key"),
    [
        pytest.param({"header_timeout_s": 0}, "header_timeout_s", id="zero-timeout"),
        pytest.param({"per_credential_requests": 0}, "per_credential_requests", id="no-requests"),
        pytest.param(
            {"per_credential_body_bytes": 10, "total_body_bytes": 5},
            "total_body_bytes",
            id="total-below-one",
        ),
    ],
)
def test_bad_connection_settings_fail_at_load(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        build(ConnectionsConfig, data, source="t")
    assert key in str(e.value)
