"""An ingest worker process (`python -m trainguard.controller.ingest --worker N ...`): serves
the inherited API socket with uvicorn, does the receive stage of `POST /v1/reports` (the
credential, an agent token or client certificate, and the body limit) and hands the raw body,
with the node that credential speaks for, to the core over its channel; every other request
is forwarded whole. A repeated Authorization header is answered 400 here, on every route. It
exits at EOF on its channel and, on Linux, when the core dies.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from trainguard.controller.auth import TokenStore
from trainguard.controller.connlimits import ConnLimits, CredentialLimits, bounded
from trainguard.controller.ingest.frames import (
    ANSWER_MAX_BYTES,
    KIND_ANSWER,
    KIND_HTTP,
    KIND_READY,
    KIND_REPORT,
    KIND_TOKENS,
    FrameError,
    Headers,
    decode_answer,
    encode_frame,
    encode_handover,
    encode_http,
    error_answer,
    json_headers,
    read_frame,
)
from trainguard.controller.runtime import new_event_loop, setup_logging
from trainguard.controller.tlsauth import uvicorn_tls_options

__all__ = ["CoreChannel", "WorkerApp", "main"]

log = logging.getLogger("trainguard.controller.ingest")


class CoreChannel:
    """The worker's end of the channel: requests out, answers matched back by id."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._pending: dict[int, asyncio.Future[tuple[int, Headers, bytes]]] = {}
        self._next_id = 0
        self.tokens: Any = None
        self.tokens_changed = asyncio.Event()
        self.closed = asyncio.Event()

    def send(self, kind: int, payload: bytes) -> None:
        self._writer.write(encode_frame(kind, 0, payload))

    async def request(self, kind: int, payload: bytes) -> tuple[int, Headers, bytes]:
        if self.closed.is_set():
            return error_answer(503, "controller unavailable")
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        request_id = self._next_id
        future: asyncio.Future[tuple[int, Headers, bytes]] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[request_id] = future
        self._writer.write(encode_frame(kind, request_id, payload))
        if self._writer.transport.get_write_buffer_size() > 4 * 1024 * 1024:
            await self._writer.drain()
        return await future

    async def read_loop(self, *, max_frame_bytes: int) -> None:
        try:
            while True:
                kind, request_id, payload = await read_frame(
                    self._reader, max_bytes=max_frame_bytes
                )
                if kind == KIND_ANSWER:
                    future = self._pending.pop(request_id, None)
                    if future is not None and not future.done():
                        future.set_result(decode_answer(payload))
                elif kind == KIND_TOKENS:
                    self.tokens = TokenStore(json.loads(payload))
                    self.tokens_changed.set()
                else:
                    raise FrameError(f"frame kind {kind} is not sent by the core")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except FrameError as e:
            log.error("event=ingest_channel_error detail=%s", e)
        finally:
            self.closed.set()
            for future in self._pending.values():
                if not future.done():
                    future.set_result(error_answer(503, "controller unavailable"))
            self._pending.clear()


class WorkerApp:
    """The worker's ASGI app: reports are checked here and handed over; the rest forwarded."""

    def __init__(self, channel: CoreChannel, *, max_body_bytes: int) -> None:
        self._channel = channel
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if _repeated_authorization(scope["headers"]):
            status, headers, body = error_answer(
                400, "repeated Authorization header: send one", {"header": "Authorization"}
            )
        elif scope["path"] == "/v1/reports" and scope["method"] == "POST":
            status, headers, body = await self._report(scope, receive)
        else:
            status, headers, body = await self._forward(scope, receive)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _report(self, scope: Any, receive: Any) -> tuple[int, Headers, bytes]:
        # defers fastapi (which the api package imports) to the first report: an idle worker
        # stays small
        from trainguard.controller.api.errors import ApiError  # noqa: PLC0415
        from trainguard.controller.api.requests import (  # noqa: PLC0415
            authenticate_report,
            read_limited,
            request_headers,
        )

        try:
            # the same checks, in the same order, with the same answers as the core's own
            headers = request_headers(scope["headers"])
            principal = authenticate_report(self._channel.tokens, headers, scope)
            raw = await read_limited(headers.get(b"content-length"), receive, self._max_body_bytes)
        except ApiError as e:
            body = json.dumps({"error": e.error, "detail": e.detail}, separators=(",", ":"))
            return e.status, json_headers(body.encode(), e.headers), body.encode()
        payload = encode_handover(principal.name, principal.node, raw)
        return await self._channel.request(KIND_REPORT, payload)

    async def _forward(self, scope: Any, receive: Any) -> tuple[int, Headers, bytes]:
        # at most one byte past the limit is read and handed on: the core's app then answers
        # 413 itself, after its own authentication, as it would without workers
        chunks: list[bytes] = []
        size = 0
        while size <= self._max_body_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return error_answer(400, "client disconnected")
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)[: self._max_body_bytes + 1]
        meta = {
            "method": scope["method"],
            "path": scope["path"],
            "raw_path": (scope.get("raw_path") or scope["path"].encode()).decode("latin-1"),
            "query_string": scope.get("query_string", b"").decode("latin-1"),
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]],
            "scheme": scope.get("scheme", "http"),
            "http_version": scope.get("http_version", "1.1"),
            "client": list(scope["client"]) if scope.get("client") else None,
            "server": list(scope["server"]) if scope.get("server") else None,
        }
        return await self._channel.request(KIND_HTTP, encode_http(meta, body))


def _repeated_authorization(raw: list[tuple[bytes, bytes]]) -> bool:
    return sum(1 for k, _ in raw if k == b"authorization") > 1


_term_requested = False


def _note_term(signum: int, frame: Any) -> None:
    global _term_requested
    _term_requested = True


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the core dies (Linux); exit now if it already has."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        raise SystemExit(0)


async def _worker(args: argparse.Namespace) -> int:
    # defers uvicorn (heavy) to the worker process: importing this module does not need it
    import uvicorn  # noqa: PLC0415

    listen = socket.socket(fileno=args.listen_fd)
    chan = socket.socket(fileno=args.channel_fd)
    reader, writer = await asyncio.open_unix_connection(sock=chan)
    channel = CoreChannel(reader, writer)
    reading = asyncio.create_task(channel.read_loop(max_frame_bytes=ANSWER_MAX_BYTES))
    waits = {
        asyncio.create_task(channel.tokens_changed.wait()),
        asyncio.create_task(channel.closed.wait()),
    }
    await asyncio.wait(waits, timeout=30.0, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    if channel.tokens is None:
        log.error("event=ingest_worker_no_tokens worker=%d", args.worker)
        reading.cancel()
        return 1
    tls = uvicorn_tls_options(
        cert_file=args.tls_cert_file,
        key_file=args.tls_key_file,
        client_ca_file=args.tls_client_ca_file,
    )
    app: Any = WorkerApp(channel, max_body_bytes=args.max_body_bytes)
    keep_alive_s = 75
    if args.conn_limits is not None:  # the core's api.connections (controller/connlimits.py)
        limits = ConnLimits(**json.loads(args.conn_limits))
        app, tls = CredentialLimits(app, limits=limits), bounded(tls, limits)
        keep_alive_s = math.ceil(limits.idle_timeout_s)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=keep_alive_s,
            **tls,
        )
    )

    async def exit_on_eof() -> None:
        await channel.closed.wait()
        server.should_exit = True
        # in-flight requests were answered 503; do not wait on slow clients for long
        asyncio.get_running_loop().call_later(5.0, os._exit, 0)

    watcher = asyncio.create_task(exit_on_eof())
    # SIGTERM kills at once until here (nothing to drain yet); from now on uvicorn takes it
    # for a graceful stop, and what comes before it does or after it re-raises is only noted
    signal.signal(signal.SIGTERM, _note_term)
    serving = asyncio.create_task(server.serve(sockets=[listen]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.01)
    if server.started:
        if _term_requested:
            server.should_exit = True
        channel.send(KIND_READY, json.dumps({"pid": os.getpid()}).encode())
    await serving
    watcher.cancel()
    reading.cancel()
    writer.close()
    return 0 if server.started else 1


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainguard.controller.ingest",
        description="trainguard controller ingest worker (started by the controller itself)",
    )
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--listen-fd", type=int, required=True)
    p.add_argument("--channel-fd", type=int, required=True)
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--max-body-bytes", type=int, required=True)
    p.add_argument("--log-level", default="info")
    p.add_argument("--tls-cert-file", default=None)
    p.add_argument("--tls-key-file", default=None)
    p.add_argument("--tls-client-ca-file", default=None)
    p.add_argument("--conn-limits", default=None, help="connlimits.ConnLimits as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    _die_with_parent(args.parent_pid)
    setup_logging(args.log_level)
    # the core owns reloads and Ctrl-C: it stops its workers itself
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop = new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        code = loop.run_until_complete(_worker(args))
    finally:
        loop.close()
    log.info("event=ingest_worker_exit worker=%d code=%d", args.worker, code)
    return code
