"""The core's side of the ingest workers: IngestFrontend starts N worker processes
(`python -m trainguard.controller.ingest`), serves their channels and restarts or stops them.

A report a worker has received (the report path's receive stage) is decoded and ingested
through the app's `report_path.decode_and_ingest`, in order, exactly as the core's own; every
other request is run through the core's ASGI app in-process (`call_asgi`). A worker's channel
is read in batches and not read while 512 of its frames wait (back-pressure on the workers). A
worker that exits while the core serves is started again (with a backoff when it keeps
crashing); on shutdown each gets SIGTERM, what it still hands over is answered, and one still
there after the grace period is killed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.controller.ingest.frames import (
    HEADER,
    JSON_BODY,
    KIND_ANSWER,
    KIND_HTTP,
    KIND_READY,
    KIND_REPORT,
    KIND_TOKENS,
    KINDS,
    FrameError,
    Headers,
    decode_handover,
    decode_http,
    encode_answer,
    encode_frame,
    error_answer,
)

__all__ = ["IngestFrontend", "call_asgi"]

log = logging.getLogger("trainguard.controller.ingest")

# frames queued in the core for one worker before it stops reading that worker's channel
_QUEUE_HIGH, _QUEUE_LOW = 512, 64
# answers written to a worker in one go at most: a long batch must not hold the first back
_FLUSH_EVERY = 32
# reports ingested back to back before the GIL is handed to the tick thread (~2-5 ms)
_YIELD_EVERY = 16
# room for a forwarded request's method, path, query and headers beyond the body limit
_META_ALLOWANCE_BYTES = 1024 * 1024


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
            if kind not in KINDS or length > self._max_frame_bytes:
                self.error = FrameError(
                    f"unknown frame kind {kind}"
                    if kind not in KINDS
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
        tls_client_ca_file: str | None = None,
        log_level: str = "info",
        ready_timeout_s: float = 60.0,
        stop_grace_s: float = 10.0,
        clock: Clock = SYSTEM_CLOCK,
        conn_limits: str | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.started = False
        self.should_exit = False
        self._app = app
        # the report path's decode and ingest stages (controller/api/reports.py)
        self._decode_and_ingest: Callable[..., Awaitable[tuple[int, bytes, dict[str, str] | None]]]
        self._decode_and_ingest = app.report_path.decode_and_ingest
        self._tokens = tokens
        self._max_body_bytes = max_body_bytes
        self._max_frame_bytes = max_body_bytes + _META_ALLOWANCE_BYTES
        self._tls = (tls_cert_file, tls_key_file, tls_client_ca_file)
        self._log_level = log_level
        self._conn_limits = conn_limits  # connlimits.ConnLimits as JSON, for each worker
        self._ready_timeout_s = ready_timeout_s
        self._stop_grace_s = stop_grace_s
        self._clock = clock
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
        deadline = self._clock.monotonic() + self._ready_timeout_s
        try:
            while not self.should_exit:
                if not self.started and all(s.ready for s in self._slots):
                    self.started = True
                elif not self.started and self._clock.monotonic() > deadline:
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
        cert, key, client_ca = self._tls
        if cert is not None and key is not None:
            cmd += ["--tls-cert-file", cert, "--tls-key-file", key]
        if client_ca is not None:
            cmd += ["--tls-client-ca-file", client_ca]
        if self._conn_limits is not None:
            cmd += ["--conn-limits", self._conn_limits]
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
        slot.popen, slot.ready, slot.started_at = popen, False, self._clock.monotonic()
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
        lived_s = self._clock.monotonic() - slot.started_at
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
        decode_and_ingest = self._decode_and_ingest
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
                    actor, node, raw = decode_handover(payload)
                    try:
                        status, body, extra = await decode_and_ingest(raw, actor=actor, node=node)
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
                        answer = encode_answer(*error_answer(500, "internal error"))
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
        started = self._clock.monotonic()
        termed = False
        while popen.poll() is None:
            waited_s = self._clock.monotonic() - started
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
        deadline = self._clock.monotonic() + self._stop_grace_s + 2.0
        while any(s.popen is not None and s.popen.poll() is None for s in self._slots):
            if self._clock.monotonic() > deadline:
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
        return error_answer(500, "internal error")
    finally:
        done.set()
    return status, headers, b"".join(chunks)
