"""Ingest workers: N processes that serve the controller's HTTP port and hand reports to it.

With `api.ingest_workers: N` (N > 0) the controller process (the core) binds the listening
socket and starts N worker processes (`python -m trainguard.controller.ingest`) that inherit it and
accept on it. A worker parses HTTP and, for `POST /v1/reports`, checks the bearer token
(agent role, 401/403 as the core answers them) and the body limit (413), then hands the raw
body (bytes) to the core over its own unix socket pair; the core decodes and ingests it
exactly as it does its own requests and sends back the response bytes. Every other request
(API, agentctl, /metrics, /healthz) is forwarded whole, and the core runs it through its
ASGI app in-process, so there is one API implementation.

Channel: one SOCK_STREAM socket pair per worker, frames of `!IBI` (payload length, kind,
request id) followed by the payload; request ids pair answers with requests, so forwarded
API calls may answer out of order while reports keep their order. Nothing is pickled.

Lifetime: a worker exits when its channel reaches EOF (the core is gone or dropped it) and,
on Linux, is sent SIGTERM when the core dies (parent-death signal), so no worker outlives
the core. The core restarts a worker that exits while it is serving (with a backoff when it
keeps crashing) and, on shutdown, sends SIGTERM to every worker, answers what they still
hand over, and kills any that has not exited after a grace period. Tokens travel from the
core to the workers as SHA-256 hashes at every (re)start and on `IngestFrontend.set_tokens`;
tokens are never logged.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ANSWER_MAX_BYTES",
    "JSON_BODY",
    "HEADER",
    "KIND_ANSWER",
    "KIND_HTTP",
    "KIND_READY",
    "KIND_REPORT",
    "KIND_TOKENS",
    "FrameError",
    "IngestFrontend",
    "decode_answer",
    "decode_http",
    "decode_report",
    "encode_answer",
    "encode_frame",
    "encode_http",
    "encode_report",
    "main",
]

log = logging.getLogger("trainguard.controller.ingest")

# payload length, kind, request id
HEADER = struct.Struct("!IBI")
KIND_TOKENS = 1  # core -> worker: JSON [[name, role, sha256 hex], ...]
KIND_READY = 2  # worker -> core: JSON {"pid": ...}, once it accepts connections
KIND_REPORT = 3  # worker -> core: actor name, raw report body
KIND_HTTP = 4  # worker -> core: any other request, whole
KIND_ANSWER = 5  # core -> worker: status, headers, body
_KINDS = frozenset({KIND_TOKENS, KIND_READY, KIND_REPORT, KIND_HTTP, KIND_ANSWER})
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_ANSWER = struct.Struct("!HBI")  # status, flags, length of the JSON header list
# answer flag: the body is JSON; the worker adds content-type and content-length itself (the
# usual report answer travels without a header list to encode and parse)
JSON_BODY = 1
# frames queued in the core for one worker before it stops reading that worker's channel
_QUEUE_HIGH, _QUEUE_LOW = 512, 64
# answers written to a worker in one go at most: a long batch must not hold the first back
_FLUSH_EVERY = 32
# reports ingested back to back before the GIL is handed to the tick thread (~2-5 ms)
_YIELD_EVERY = 16
# room for a forwarded request's method, path, query and headers beyond the body limit
_META_ALLOWANCE_BYTES = 1024 * 1024
# largest frame a worker takes from the core: answers are not bound by the request body limit
# (a GET of every incident or node can be megabytes), only guarded against a corrupt length
ANSWER_MAX_BYTES = 1 << 30

Headers = list[tuple[bytes, bytes]]


class FrameError(ValueError):
    """A channel frame that is not what the protocol allows: the channel is dropped."""


def encode_frame(kind: int, request_id: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind, request_id) + payload


def encode_report(actor: str, body: bytes) -> bytes:
    name = actor.encode()
    return _U16.pack(len(name)) + name + body


def decode_report(payload: bytes) -> tuple[str, bytes]:
    if len(payload) < _U16.size:
        raise FrameError("report frame shorter than its header")
    (n,) = _U16.unpack_from(payload)
    if _U16.size + n > len(payload):
        raise FrameError("report frame: actor name runs past the frame")
    return payload[2 : 2 + n].decode(), payload[2 + n :]


def encode_http(meta: dict[str, Any], body: bytes) -> bytes:
    head = json.dumps(meta, separators=(",", ":")).encode()
    return _U32.pack(len(head)) + head + body


def decode_http(payload: bytes) -> tuple[dict[str, Any], bytes]:
    if len(payload) < _U32.size:
        raise FrameError("http frame shorter than its header")
    (n,) = _U32.unpack_from(payload)
    if _U32.size + n > len(payload):
        raise FrameError("http frame: request head runs past the frame")
    try:
        meta = json.loads(payload[4 : 4 + n])
    except ValueError as e:
        raise FrameError(f"http frame: request head is not JSON ({e})") from None
    if not isinstance(meta, dict):
        raise FrameError("http frame: request head is not an object")
    return meta, payload[4 + n :]


def encode_answer(status: int, headers: Headers, body: bytes, *, flags: int = 0) -> bytes:
    head = b""
    if headers:
        head = json.dumps([[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers]).encode()
    return _ANSWER.pack(status, flags, len(head)) + head + body


def decode_answer(payload: bytes) -> tuple[int, Headers, bytes]:
    """(status, the response's headers, body); JSON_BODY adds content-type and length."""
    if len(payload) < _ANSWER.size:
        raise FrameError("answer frame shorter than its header")
    status, flags, n = _ANSWER.unpack_from(payload)
    start = _ANSWER.size
    if start + n > len(payload):
        raise FrameError("answer frame: headers run past the frame")
    headers: Headers = []
    if n:
        headers = [
            (k.encode("latin-1"), v.encode("latin-1"))
            for k, v in json.loads(payload[start : start + n])
        ]
    body = payload[start + n :]
    if flags & JSON_BODY:
        headers = _json_headers(body) + headers
    return status, headers, body


async def read_frame(reader: asyncio.StreamReader, *, max_bytes: int) -> tuple[int, int, bytes]:
    """(kind, request id, payload); IncompleteReadError at EOF, FrameError on a bad frame."""
    length, kind, request_id = HEADER.unpack(await reader.readexactly(HEADER.size))
    if kind not in _KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes exceeds {max_bytes}")
    return kind, request_id, await reader.readexactly(length)


def _json_headers(body: bytes, extra: dict[str, str] | None = None) -> Headers:
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if extra:
        headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
    return headers


def _error(status: int, error: str, detail: Any = None) -> tuple[int, Headers, bytes]:
    body = json.dumps({"error": error, "detail": detail}, separators=(",", ":")).encode()
    return status, _json_headers(body), body


# --- the core's side -----------------------------------------------------------------------------


class _FrameQueue(asyncio.Protocol):
    """The core's end of one worker's channel: whole frames parsed as bytes arrive, queued
    for `IngestFrontend._serve_channel`, which is woken once per batch rather than per frame.
    Reading pauses while the queue is long, so a slow core pushes back on its workers."""

    def __init__(self, *, max_frame_bytes: int) -> None:
        self.frames: collections.deque[tuple[int, int, bytes]] = collections.deque()
        self.wakeup = asyncio.Event()
        self.lost = False
        self.error: FrameError | None = None
        self._max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._transport: asyncio.Transport | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end_of_data = 0, len(buf)
        while end_of_data - pos >= HEADER.size:
            length, kind, request_id = HEADER.unpack_from(buf, pos)
            if kind not in _KINDS or length > self._max_frame_bytes:
                self.error = FrameError(
                    f"unknown frame kind {kind}"
                    if kind not in _KINDS
                    else f"frame of {length} bytes exceeds {self._max_frame_bytes}"
                )
                assert self._transport is not None
                self._transport.close()
                break
            end = pos + HEADER.size + length
            if end > end_of_data:
                break
            self.frames.append((kind, request_id, bytes(buf[pos + HEADER.size : end])))
            pos = end
        if pos:
            del buf[:pos]
        if len(self.frames) > _QUEUE_HIGH and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self.wakeup.set()

    def consumed(self) -> None:
        """The queue was worked off: read again if reading was paused."""
        if self._paused and len(self.frames) < _QUEUE_LOW and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.wakeup.set()

    def write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


@dataclass
class _Slot:
    """One worker position: its current process and channel, restarted in place."""

    index: int
    popen: subprocess.Popen[bytes] | None = None
    channel: _FrameQueue | None = None
    ready: bool = False
    started_at: float = 0.0
    restarts: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class IngestFrontend:
    """Serves the API port through `workers` ingest processes. Shaped like the part of
    `uvicorn.Server` that `controller.main` drives: `await serve(sockets=[sock])` runs until
    `should_exit` is set; `started` turns true once every worker accepts connections."""

    def __init__(
        self,
        app: Any,
        *,
        workers: int,
        tokens: Any,
        max_body_bytes: int,
        tls_cert_file: str | None = None,
        tls_key_file: str | None = None,
        log_level: str = "info",
        ready_timeout_s: float = 60.0,
        stop_grace_s: float = 10.0,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.started = False
        self.should_exit = False
        self._app = app
        self._ingest: Callable[[bytes, str], Awaitable[tuple[int, bytes, dict[str, str] | None]]]
        self._ingest = app.report_ingest
        self._tokens = tokens
        self._max_body_bytes = max_body_bytes
        self._max_frame_bytes = max_body_bytes + _META_ALLOWANCE_BYTES
        self._tls = (tls_cert_file, tls_key_file)
        self._log_level = log_level
        self._ready_timeout_s = ready_timeout_s
        self._stop_grace_s = stop_grace_s
        self._slots = [_Slot(index=i) for i in range(workers)]
        self._stopping = False
        self._sock: socket.socket | None = None

    def worker_pids(self) -> list[int]:
        """The pids of the worker processes now running (for tests and the bench)."""
        return [s.popen.pid for s in self._slots if s.popen is not None and s.popen.poll() is None]

    def set_tokens(self, tokens: Any) -> None:
        """Use `tokens` (a TokenStore) from now on, in every worker."""
        self._tokens = tokens
        frame = encode_frame(KIND_TOKENS, 0, self._tokens_payload())
        for slot in self._slots:
            if slot.channel is not None:
                slot.channel.write(frame)

    def _tokens_payload(self) -> bytes:
        return json.dumps(self._tokens.entries()).encode()

    async def serve(self, sockets: Sequence[socket.socket]) -> None:
        (self._sock,) = sockets
        runners = [asyncio.create_task(self._run_slot(slot)) for slot in self._slots]
        deadline = time.monotonic() + self._ready_timeout_s
        try:
            while not self.should_exit:
                if not self.started and all(s.ready for s in self._slots):
                    self.started = True
                elif not self.started and time.monotonic() > deadline:
                    log.error("event=ingest_workers_not_ready timeout_s=%s", self._ready_timeout_s)
                    break
                await asyncio.sleep(0.05)
        finally:
            self._stopping = True
            await self._stop_all()
            for runner in runners:
                runner.cancel()
            await asyncio.gather(*runners, return_exceptions=True)

    async def _run_slot(self, slot: _Slot) -> None:
        delay_s = 0.25
        while not self._stopping:
            try:
                lived_s = await self._run_once(slot)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("event=ingest_worker_failed worker=%d", slot.index)
                lived_s = 0.0
            if self._stopping:
                return
            # a worker that dies at once (bad TLS file, import error) is not restarted in a loop
            delay_s = 0.25 if lived_s > 10.0 else min(delay_s * 2, 10.0)
            slot.restarts += 1
            log.info(
                "event=ingest_worker_restart worker=%d in_s=%.1f restarts=%d",
                slot.index,
                delay_s,
                slot.restarts,
            )
            await asyncio.sleep(delay_s)

    def _spawn(self, slot: _Slot, child: socket.socket) -> subprocess.Popen[bytes]:
        assert self._sock is not None
        listen_fd, channel_fd = self._sock.fileno(), child.fileno()
        cmd = [
            sys.executable,
            "-m",
            "trainguard.controller.ingest",
            "--worker",
            str(slot.index),
            "--listen-fd",
            str(listen_fd),
            "--channel-fd",
            str(channel_fd),
            "--parent-pid",
            str(os.getpid()),
            "--max-body-bytes",
            str(self._max_body_bytes),
            "--log-level",
            self._log_level,
        ]
        cert, key = self._tls
        if cert is not None and key is not None:
            cmd += ["--tls-cert-file", cert, "--tls-key-file", key]
        # spawned from the event loop's (main) thread: the parent-death signal fires when the
        # thread that forked exits, and this one lives as long as the core
        return subprocess.Popen(cmd, pass_fds=(listen_fd, channel_fd), stdin=subprocess.DEVNULL)

    async def _run_once(self, slot: _Slot) -> float:
        """Start the slot's worker, serve its channel until EOF, reap it; seconds it lived."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            popen = self._spawn(slot, child)
        finally:
            child.close()
        slot.popen, slot.ready, slot.started_at = popen, False, time.monotonic()
        log.info("event=ingest_worker_started worker=%d pid=%d", slot.index, popen.pid)
        loop = asyncio.get_running_loop()
        max_frame_bytes = self._max_frame_bytes
        _, channel = await loop.create_unix_connection(
            lambda: _FrameQueue(max_frame_bytes=max_frame_bytes), sock=parent
        )
        slot.channel = channel
        channel.write(encode_frame(KIND_TOKENS, 0, self._tokens_payload()))
        reason = "eof"
        try:
            await self._serve_channel(slot, channel)
        except FrameError as e:
            reason = "bad_frame"
            log.error("event=ingest_channel_error worker=%d detail=%s", slot.index, e)
        finally:
            slot.ready = False
            slot.channel = None
            channel.close()
            code = await self._reap(popen)
            for task in list(slot.tasks):
                task.cancel()
        lived_s = time.monotonic() - slot.started_at
        level = logging.INFO if self._stopping else logging.WARNING
        log.log(
            level,
            "event=ingest_worker_exited worker=%d pid=%d code=%s reason=%s lived_s=%.1f",
            slot.index,
            popen.pid,
            code,
            reason,
            lived_s,
        )
        return lived_s

    async def _serve_channel(self, slot: _Slot, channel: _FrameQueue) -> None:
        ingest = self._ingest
        frames = channel.frames
        while True:
            await channel.wakeup.wait()
            channel.wakeup.clear()
            out: list[bytes] = []
            handed = 0
            while frames:
                kind, request_id, payload = frames.popleft()
                if kind == KIND_REPORT:
                    # inline and in order, as the core serves its own reports: the ingest is
                    # synchronous and serialised on the controller's lock anyway
                    actor, raw = decode_report(payload)
                    try:
                        status, body, extra = await ingest(raw, actor)
                        headers = (
                            [(k.lower().encode(), v.encode()) for k, v in extra.items()]
                            if extra
                            else []
                        )
                        answer = encode_answer(status, headers, body, flags=JSON_BODY)
                    except Exception as exc:  # what the core's own fast path answers
                        log.error(
                            "event=api_error method=POST path=/v1/reports error=%s",
                            type(exc).__name__,
                            exc_info=exc,
                        )
                        answer = encode_answer(*_error(500, "internal error"))
                    out.append(encode_frame(KIND_ANSWER, request_id, answer))
                    handed += 1
                    if frames and handed % _YIELD_EVERY == 0:
                        # back-to-back ingests re-take the controller's lock before the tick
                        # thread, woken by its release, gets the GIL to take it: hand the GIL
                        # over now and then so a long batch does not starve the tick
                        time.sleep(0)
                    if len(out) >= _FLUSH_EVERY:
                        channel.write(b"".join(out))
                        out.clear()
                elif kind == KIND_HTTP:
                    meta, body = decode_http(payload)
                    task = asyncio.create_task(self._forward(channel, request_id, meta, body))
                    slot.tasks.add(task)
                    task.add_done_callback(slot.tasks.discard)
                elif kind == KIND_READY:
                    slot.ready = True
                    log.info(
                        "event=ingest_worker_ready worker=%d pid=%s",
                        slot.index,
                        slot.popen and slot.popen.pid,
                    )
                else:
                    raise FrameError(f"frame kind {kind} is not sent by workers")
            if out:
                channel.write(b"".join(out))
            channel.consumed()
            if channel.error is not None:
                raise channel.error
            if channel.lost:
                return

    async def _forward(
        self, channel: _FrameQueue, request_id: int, meta: dict[str, Any], body: bytes
    ) -> None:
        status, headers, out = await call_asgi(self._app, meta, body)
        channel.write(encode_frame(KIND_ANSWER, request_id, encode_answer(status, headers, out)))

    async def _reap(self, popen: subprocess.Popen[bytes]) -> int | None:
        """Wait for a worker whose channel closed to exit: it should at once; SIGTERM after
        a second, SIGKILL after the grace period."""
        started = time.monotonic()
        termed = False
        while popen.poll() is None:
            waited_s = time.monotonic() - started
            if waited_s > self._stop_grace_s:
                log.warning("event=ingest_worker_kill pid=%d", popen.pid)
                popen.kill()
                popen.wait()
                break
            if waited_s > 1.0 and not termed:
                termed = True
                with contextlib.suppress(ProcessLookupError):
                    popen.terminate()
            await asyncio.sleep(0.02)
        return popen.returncode

    async def _stop_all(self) -> None:
        """SIGTERM every worker; their channels stay served until they exit (their in-flight
        reports are answered); a worker still there after the grace period is killed."""
        for slot in self._slots:
            if slot.popen is not None and slot.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    slot.popen.terminate()
        deadline = time.monotonic() + self._stop_grace_s + 2.0
        while any(s.popen is not None and s.popen.poll() is None for s in self._slots):
            if time.monotonic() > deadline:
                for s in self._slots:
                    if s.popen is not None and s.popen.poll() is None:
                        log.warning("event=ingest_worker_kill pid=%d", s.popen.pid)
                        s.popen.kill()
                        s.popen.wait()
                break
            await asyncio.sleep(0.02)


async def call_asgi(app: Any, meta: dict[str, Any], body: bytes) -> tuple[int, Headers, bytes]:
    """Run one forwarded request through `app` in this process; (status, headers, body)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": meta.get("http_version", "1.1"),
        "method": meta["method"],
        "scheme": meta.get("scheme", "http"),
        "path": meta["path"],
        "raw_path": meta.get("raw_path", meta["path"]).encode("latin-1"),
        "query_string": meta.get("query_string", "").encode("latin-1"),
        "root_path": "",
        "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in meta["headers"]],
        "client": tuple(meta["client"]) if meta.get("client") else None,
        "server": tuple(meta["server"]) if meta.get("server") else None,
    }
    done = asyncio.Event()
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()  # asked only by code that watches for a disconnect
        return {"type": "http.disconnect"}

    status = 500
    headers: Headers = []
    chunks: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status = message["status"]
            headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)
    except Exception as exc:
        log.error(
            "event=api_error method=%s path=%s error=%s",
            meta["method"],
            meta["path"],
            type(exc).__name__,
            exc_info=exc,
        )
        return _error(500, "internal error")
    finally:
        done.set()
    return status, headers, b"".join(chunks)


# --- the worker's side ---------------------------------------------------------------------------


class _CoreChannel:
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
            return _error(503, "controller unavailable")
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
        from trainguard.controller.auth import TokenStore  # noqa: PLC0415

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
                    self.tokens = TokenStore([tuple(e) for e in json.loads(payload)])
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
                    future.set_result(_error(503, "controller unavailable"))
            self._pending.clear()


class _WorkerApp:
    """The worker's ASGI app: reports are checked here and handed over; the rest forwarded."""

    def __init__(self, channel: _CoreChannel, *, max_body_bytes: int) -> None:
        self._channel = channel
        self._max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/v1/reports" and scope["method"] == "POST":
            status, headers, body = await self._report(scope, receive)
        else:
            status, headers, body = await self._forward(scope, receive)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _report(self, scope: Any, receive: Any) -> tuple[int, Headers, bytes]:
        from trainguard.controller.api import ApiError, _authenticate, _read_limited  # noqa: PLC0415

        headers = dict(scope["headers"])
        try:
            # the same checks, in the same order, with the same answers as the core's own
            principal = _authenticate(self._channel.tokens, headers.get(b"authorization"), "report")
            raw = await _read_limited(headers.get(b"content-length"), receive, self._max_body_bytes)
        except ApiError as e:
            body = json.dumps({"error": e.error, "detail": e.detail}, separators=(",", ":"))
            return e.status, _json_headers(body.encode(), e.headers), body.encode()
        return await self._channel.request(KIND_REPORT, encode_report(principal.name, raw))

    async def _forward(self, scope: Any, receive: Any) -> tuple[int, Headers, bytes]:
        # at most one byte past the limit is read and handed on: the core's app then answers
        # 413 itself, after its own authentication, as it would without workers
        chunks: list[bytes] = []
        size = 0
        while size <= self._max_body_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _error(400, "client disconnected")
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


_term_requested = False


def _note_term(signum: int, frame: Any) -> None:
    global _term_requested
    _term_requested = True


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the core dies (Linux); exit now if it already has."""
    if sys.platform.startswith("linux"):
        import ctypes  # noqa: PLC0415

        pr_set_pdeathsig = 1
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        raise SystemExit(0)


async def _worker(args: argparse.Namespace) -> int:
    import uvicorn  # noqa: PLC0415

    listen = socket.socket(fileno=args.listen_fd)
    chan = socket.socket(fileno=args.channel_fd)
    reader, writer = await asyncio.open_unix_connection(sock=chan)
    channel = _CoreChannel(reader, writer)
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
    server = uvicorn.Server(
        uvicorn.Config(
            _WorkerApp(channel, max_body_bytes=args.max_body_bytes),
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=args.tls_cert_file,
            ssl_keyfile=args.tls_key_file,
            http="auto",
            timeout_keep_alive=75,
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
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    _die_with_parent(args.parent_pid)
    from trainguard.controller.main import _new_event_loop, _setup_logging  # noqa: PLC0415

    _setup_logging(args.log_level)
    # the core owns reloads and Ctrl-C: it stops its workers itself
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    loop = _new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        code = loop.run_until_complete(_worker(args))
    finally:
        loop.close()
    log.info("event=ingest_worker_exit worker=%d code=%d", args.worker, code)
    return code


if __name__ == "__main__":
    sys.exit(main())
