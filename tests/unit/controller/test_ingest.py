"""controller.ingest: the channel's frames, and forwarded requests run through the real app."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest

from tests.fakes.controller_service import FakeService
from trainguard.clock import FakeClock
from trainguard.controller.api.app import create_app
from trainguard.controller.auth import TokenStore
from trainguard.controller.composition import Controller
from trainguard.controller.config import ConfigError, load_config
from trainguard.controller.ingest.frames import (
    ANSWER_MAX_BYTES,
    HEADER,
    JSON_BODY,
    KIND_ANSWER,
    KIND_HTTP,
    KIND_REPORT,
    FrameError,
    decode_answer,
    decode_handover,
    decode_http,
    encode_answer,
    encode_frame,
    encode_handover,
    encode_http,
    read_frame,
)
from trainguard.controller.ingest.frontend import IngestFrontend, _FrameQueue, _Slot, call_asgi
from trainguard.controller.ingest.worker import CoreChannel as _CoreChannel
from trainguard.protocol import Report, encode_json


@pytest.mark.parametrize("workers", [-1, 65], ids=["negative", "above-64"])
def test_ingest_workers_out_of_range_fails_naming_the_key(tmp_path: Any, workers: int) -> None:
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(f"api: {{ingest_workers: {workers}}}\n")
    with pytest.raises(ConfigError, match=r"api\.ingest_workers"):
        load_config(str(cfg))


def test_ingest_workers_default_and_flag_override(tmp_path: Any) -> None:
    cfg = tmp_path / "controller.yaml"
    cfg.write_text("{}\n")
    assert load_config(str(cfg)).api.ingest_workers == 0
    assert load_config(str(cfg), overrides={"api.ingest_workers": 3}).api.ingest_workers == 3


def test_ingest_workers_go_with_ha_in_the_file_and_by_flag(tmp_path: Any) -> None:
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(
        "store: {url: 'postgresql://tg@db/tg'}\n"
        "ha: {enabled: true, advertise_url: 'http://ctl-1:8800'}\n"
        "api: {ingest_workers: 2}\n"
    )
    config = load_config(str(cfg))
    assert config.ha.enabled and config.api.ingest_workers == 2
    assert load_config(str(cfg), overrides={"api.ingest_workers": 4}).api.ingest_workers == 4


def test_frames_round_trip() -> None:
    frame = encode_frame(KIND_REPORT, 7, encode_handover("agent-n1", "n1", b'{"v":1}'))
    length, kind, request_id = HEADER.unpack(frame[: HEADER.size])
    assert (length, kind, request_id) == (len(frame) - HEADER.size, KIND_REPORT, 7)
    assert decode_handover(frame[HEADER.size :]) == ("agent-n1", "n1", b'{"v":1}')
    # a shared agent token speaks for no one node
    assert decode_handover(encode_handover("agents", None, b"{}")) == ("agents", None, b"{}")

    meta = {"method": "GET", "path": "/v1/nodes", "headers": [["x", "y"]]}
    assert decode_http(encode_http(meta, b"body")) == (meta, b"body")

    headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
    assert decode_answer(encode_answer(401, headers, b"{}")) == (401, headers, b"{}")
    assert decode_answer(encode_answer(200, [], b"")) == (200, [], b"")
    # a JSON answer travels without headers; the worker adds them
    assert decode_answer(encode_answer(200, [], b"{}", flags=JSON_BODY)) == (
        200,
        [(b"content-type", b"application/json"), (b"content-length", b"2")],
        b"{}",
    )


@pytest.mark.parametrize(
    ("decode", "payload", "reason"),
    [
        pytest.param(decode_handover, b"\x00", "shorter", id="report-short"),
        pytest.param(decode_handover, b"\x00\x09ab", "runs past", id="report-actor-past-end"),
        pytest.param(decode_handover, b"\x00\x01a\x00\x05b", "node name runs past", id="node-past"),
        pytest.param(decode_http, b"\x00\x00\x00\x10{}", "runs past", id="http-head-past-end"),
        pytest.param(decode_http, b"\x00\x00\x00\x01{", "not JSON", id="http-head-not-json"),
        pytest.param(decode_http, b"\x00\x00\x00\x02[]", "not an object", id="http-head-list"),
        pytest.param(decode_answer, b"\x00\xc8\x00\x00\x00\x00\x09", "run past", id="answer-past"),
        pytest.param(decode_answer, b"\x00\xc8", "shorter", id="answer-short"),
    ],
)
def test_malformed_payloads_are_frame_errors(decode: Any, payload: bytes, reason: str) -> None:
    with pytest.raises(FrameError, match=reason):
        decode(payload)


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        pytest.param(HEADER.pack(0, 99, 1), "unknown frame kind", id="unknown-kind"),
        pytest.param(HEADER.pack(1 << 20, KIND_ANSWER, 1), "exceeds", id="too-large"),
    ],
)
def test_read_frame_refuses_bad_frames(frame: bytes, reason: str) -> None:
    async def read() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(frame)
        reader.feed_eof()
        await read_frame(reader, max_bytes=1024)

    with pytest.raises(FrameError, match=reason):
        asyncio.run(read())


def test_the_worker_takes_answers_larger_than_the_request_body_limit() -> None:
    """A GET of every incident can be megabytes: the worker's channel must pass it whole."""
    big = b"[" + b"0," * (3 * 1024 * 1024) + b"0]"

    async def run() -> tuple[int, bytes]:
        core_end, worker_end = socket.socketpair()
        core_end.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=worker_end)
        channel = _CoreChannel(reader, writer)
        reading = asyncio.create_task(channel.read_loop(max_frame_bytes=ANSWER_MAX_BYTES))
        asking = asyncio.create_task(channel.request(KIND_HTTP, b"ignored"))
        loop = asyncio.get_running_loop()
        header = await loop.sock_recv(core_end, HEADER.size)
        _, _, request_id = HEADER.unpack(header)
        answer = encode_frame(KIND_ANSWER, request_id, encode_answer(200, [], big, flags=JSON_BODY))
        await loop.sock_sendall(core_end, answer)
        status, _, body = await asyncio.wait_for(asking, timeout=10)
        core_end.close()
        await asyncio.wait_for(reading, timeout=10)
        writer.close()
        return status, body

    status, body = asyncio.run(run())
    assert (status, len(body)) == (200, len(big))


def test_read_frame_at_eof_raises_incomplete_read() -> None:
    async def read() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(encode_frame(KIND_ANSWER, 3, b"abc")[:-1])
        reader.feed_eof()
        await read_frame(reader, max_bytes=1024)

    with pytest.raises(asyncio.IncompleteReadError):
        asyncio.run(read())


@pytest.fixture
def app(tmp_path: Any) -> Any:
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules: []\n")
    config = load_config(
        None,
        overrides={
            "store.path": str(tmp_path / "c.db"),
            "rules": [str(rules)],
            "api.tokens_file": str(tmp_path / "tokens.yaml"),
        },
    )
    controller = Controller(config, clock=FakeClock(1_000.0))
    tokens = TokenStore.from_plaintext({"op": ("ops", "operator"), "ag": ("agents", "agent")})
    try:
        yield create_app(controller, tokens=tokens, max_body_bytes=4096, metrics_registry=None)
    finally:
        controller.stop()


def _meta(method: str, path: str, *, token: str | None = None, query: str = "") -> dict[str, Any]:
    headers = [["host", "x"]]
    if token is not None:
        headers.append(["authorization", f"Bearer {token}"])
    return {"method": method, "path": path, "query_string": query, "headers": headers}


def test_forwarded_requests_get_the_apps_answers(app: Any) -> None:
    async def run() -> list[tuple[int, dict[bytes, bytes], Any]]:
        out = []
        for meta in (
            _meta("GET", "/healthz"),
            _meta("GET", "/v1/nodes"),
            _meta("GET", "/v1/nodes", token="ag"),
            _meta("GET", "/v1/incidents", token="op", query="limit=0"),
            _meta("GET", "/v1/nodes", token="op"),
        ):
            status, headers, body = await call_asgi(app, meta, b"")
            out.append((status, dict(headers), json.loads(body)))
        return out

    health, no_token, agent, bad_query, nodes = asyncio.run(run())
    assert health[:1] == (200,) and health[2] == {"status": "ok"}
    assert no_token[0] == 401 and no_token[1][b"www-authenticate"] == b"Bearer"
    assert agent[0] == 403
    assert bad_query[0] == 422 and bad_query[2]["detail"][0]["field"] == "query.limit"
    assert nodes == (200, nodes[1], [])
    assert nodes[1][b"content-type"] == b"application/json"


def test_a_handed_over_body_is_decoded_and_ingested(app: Any) -> None:
    body = encode_json(Report(node="node-3", instance="i", seq=1, sent_at=1_000.0))

    async def run() -> tuple[Any, Any, Any]:
        ok = await app.report_path.decode_and_ingest(body, actor="agent-node-3", node="node-3")
        invalid = await app.report_path.decode_and_ingest(
            b'{"v": 1}', actor="agent-node-3", node="node-3"
        )
        status, _, listed = await call_asgi(app, _meta("GET", "/v1/nodes", token="op"), b"")
        return ok, invalid, (status, json.loads(listed))

    ok, invalid, (status, nodes) = asyncio.run(run())
    assert ok[0] == 200 and json.loads(ok[1])["ack_event_id"] == 0
    assert invalid[0] == 422 and json.loads(invalid[1])["error"] == "invalid body"
    assert status == 200 and [n["name"] for n in nodes] == ["node-3"]


def test_report_handed_over_for_another_node_is_refused_and_audited(app: Any) -> None:
    body = encode_json(Report(node="node-2", instance="i", seq=1, sent_at=1_000.0))

    async def run() -> tuple[Any, Any, Any]:
        refused = await app.report_path.decode_and_ingest(body, actor="agent-node-1", node="node-1")
        _, _, listed = await call_asgi(app, _meta("GET", "/v1/nodes", token="op"), b"")
        _, _, audit = await call_asgi(app, _meta("GET", "/v1/audit", token="op"), b"")
        return refused, json.loads(listed), json.loads(audit)

    refused, nodes, audit = asyncio.run(run())
    assert refused[0] == 403
    error = json.loads(refused[1])
    assert "agent-node-1" in error["error"] and "node-1" in error["error"]
    assert "node-2" in error["error"]
    assert nodes == []
    assert [(a["actor"], a["action"], a["target"]) for a in audit] == [
        ("agent-node-1", "report_refused", "node-2")
    ]


class _Leadership:
    """HA leadership as the app asks it: a standby naming `leader` until `leading` is set."""

    def __init__(self, *, leader: str) -> None:
        self.leader = leader
        self.leading = False

    def is_leader(self) -> bool:
        return self.leading

    def leader_url(self) -> str:
        return "http://ctl-2:8800" if self.leading else self.leader

    def retry_after_s(self) -> int:
        return 2


def test_a_standby_answers_what_its_workers_hand_over_503_naming_the_leader() -> None:
    """Across the real channel, as a worker sees the answers: on a standby a report (for the
    credential's own node or another) and a forwarded write are 503 with the leader's URL
    and Retry-After, and none reaches the service; a forwarded read is served; once this
    controller leads, the same report is ingested."""
    svc = FakeService(clock=FakeClock(1_000.0))
    svc.add_node("node-1")
    leadership = _Leadership(leader="http://ctl-1:8800")
    tokens = TokenStore.from_plaintext({"op": ("ops", "operator"), "ag": ("agents", "agent")})
    app = create_app(
        svc,  # type: ignore[arg-type]
        tokens=tokens,
        max_body_bytes=4096,
        leadership=leadership,
    )
    frontend = IngestFrontend(app, workers=1, tokens=tokens, max_body_bytes=4096)
    report = encode_json(Report(node="node-1", instance="i", seq=1, sent_at=1_000.0))
    drain = _meta("POST", "/v1/nodes/node-1/drain", token="op")

    async def run() -> tuple[list[Any], list[str], Any]:
        core_end, worker_end = socket.socketpair()
        loop = asyncio.get_running_loop()
        _, queue = await loop.create_unix_connection(
            lambda: _FrameQueue(max_frame_bytes=1 << 20), sock=core_end
        )
        serving = asyncio.create_task(frontend._serve_channel(_Slot(index=0), queue))
        reader, writer = await asyncio.open_unix_connection(sock=worker_end)
        channel = _CoreChannel(reader, writer)
        reading = asyncio.create_task(channel.read_loop(max_frame_bytes=ANSWER_MAX_BYTES))
        refused = [
            await channel.request(KIND_REPORT, encode_handover("agent-node-1", "node-1", report)),
            await channel.request(KIND_REPORT, encode_handover("agent-node-2", "node-2", report)),
            await channel.request(KIND_HTTP, encode_http(drain, b"{}")),
        ]
        read = await channel.request(
            KIND_HTTP, encode_http(_meta("GET", "/v1/nodes", token="op"), b"")
        )
        called_as_standby = svc.methods_called()
        leadership.leading = True
        ingested = await channel.request(
            KIND_REPORT, encode_handover("agent-node-1", "node-1", report)
        )
        writer.close()
        await asyncio.wait_for(serving, timeout=10)  # EOF on the channel ends the serving
        await asyncio.wait_for(reading, timeout=10)
        return [*refused, read], called_as_standby, ingested

    answers, called_as_standby, ingested = asyncio.run(run())
    *refused, (read_status, _, _) = answers
    for status, headers, body in refused:
        assert status == 503, body
        named = dict(headers)
        assert named[b"x-trainguard-leader"] == b"http://ctl-1:8800"
        assert named[b"retry-after"] == b"2"
        assert named[b"content-type"] == b"application/json"
        assert json.loads(body)["detail"]["leader"] == "http://ctl-1:8800"
    assert read_status == 200
    assert called_as_standby == ["list_nodes"]  # no write reached the service
    assert ingested[0] == 200 and json.loads(ingested[2])["commands"] == []
    assert svc.methods_called()[-1] == "ingest_report"
