"""Bounds on the API server's connections and request bodies, so that no caller (with a
credential or without) can exhaust the controller's memory or file descriptors.

Two hooks, both added where the server is built (controller/main.py):
- `guarded_protocol(...)`: the uvicorn HTTP protocol with a cap on open connections (when
  full, an idle connection is closed to admit the new one: one that never completed a
  request first, so established agents keep theirs; with none idle the new one is answered
  503 and closed), a deadline for a request's headers (from the connection's
  first byte, or from the connection itself for its first request: a connection that never
  sends a request is closed) and for its body, and idle keep-alive connections closed.
- `CredentialLimits`: ASGI middleware holding each credential (the Authorization header's
  value, known before the body is read; the peer address without one) to a number of
  requests at once and to a number of body bytes in flight, and all callers together to a
  total of body bytes in flight: 429 (per credential) or 503 (total) with the limit named,
  before any body is read. Memory a burst of bodies took is handed back to the OS after it.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import hashlib
import json
import logging
import resource
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainguard.clock import SYSTEM_CLOCK

if TYPE_CHECKING:  # the annotation only
    from trainguard.controller.config import ConnectionsConfig

__all__ = [
    "ConnLimits",
    "SMALL_BODY_BYTES",
    "ConnectionTable",
    "CredentialLimits",
    "InFlight",
    "bounded",
    "conn_limits",
    "guarded_protocol",
    "open_connection_cap",
    "return_memory",
    "tune_malloc",
]

log = logging.getLogger("trainguard.controller.connlimits")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

# File descriptors kept out of the connection cap: the store, log files, the ingest workers'
# channels, the notify socket, outgoing webhooks.
FD_RESERVE = 256
# A body this small (an agent's report is a few KiB) is never refused by the total cap, only
# by its own credential's: a flood of large bodies from many credentials cannot starve the
# agents. The memory bound is total_body_bytes plus this much per open connection.
SMALL_BODY_BYTES = 64 * 1024
# Memory is handed back once the bodies in flight drop to none after at least this many bytes
# were held (a few reports' worth is not worth a trim), at most once per TRIM_INTERVAL_S.
TRIM_AFTER_BYTES = 16 * 1024 * 1024
TRIM_INTERVAL_S = 5.0


@dataclass(frozen=True)
class ConnLimits:
    """The bounds (config `api.connections`, documented in docs/controller.md)."""

    max_open: int  # connections at once (already capped below the fd limit)
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float
    per_credential_requests: int
    per_credential_body_bytes: int
    total_body_bytes: int


def conn_limits(config: ConnectionsConfig) -> ConnLimits:
    """The bounds `api.connections` sets, the connection cap below this process's fd limit."""
    return ConnLimits(
        max_open=open_connection_cap(config.max_open),
        header_timeout_s=config.header_timeout_s,
        body_timeout_s=config.body_timeout_s,
        idle_timeout_s=config.idle_timeout_s,
        per_credential_requests=config.per_credential_requests,
        per_credential_body_bytes=config.per_credential_body_bytes,
        total_body_bytes=config.total_body_bytes,
    )


def open_connection_cap(configured: int, *, fd_limit: int | None = None) -> int:
    """The connection cap: `configured` (0 = as many as the fd limit allows), never above
    the process's open-file limit less FD_RESERVE."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0] if fd_limit is None else fd_limit
    room = soft - FD_RESERVE if soft != resource.RLIM_INFINITY else 1_000_000
    room = max(16, room)
    return room if configured == 0 else min(configured, room)


# --- bodies in flight, per credential -------------------------------------------------------


class InFlight:
    """Requests and body bytes in flight per credential and in total (event loop only)."""

    def __init__(self, limits: ConnLimits) -> None:
        self._limits = limits
        self._requests: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self.total_bytes = 0

    def admit(self, key: str, body_bytes: int) -> tuple[int, str, dict[str, Any]] | None:
        """Count a request of `body_bytes` for `key`, or the refusal (status, error, detail)."""
        lim = self._limits
        if self._requests.get(key, 0) >= lim.per_credential_requests:
            return (
                429,
                "too many requests in flight for this credential",
                {
                    "limit": "api.connections.per_credential_requests",
                    "max": lim.per_credential_requests,
                },
            )
        held = self._bytes.get(key, 0)
        if held + body_bytes > lim.per_credential_body_bytes:
            return (
                429,
                "too many body bytes in flight for this credential",
                {
                    "limit": "api.connections.per_credential_body_bytes",
                    "max": lim.per_credential_body_bytes,
                    "in_flight": held,
                },
            )
        if body_bytes > SMALL_BODY_BYTES and self.total_bytes + body_bytes > lim.total_body_bytes:
            return (
                503,
                "too many body bytes in flight",
                {"limit": "api.connections.total_body_bytes", "max": lim.total_body_bytes},
            )
        self._requests[key] = self._requests.get(key, 0) + 1
        self._add_bytes(key, body_bytes)
        return None

    def grow(self, key: str, body_bytes: int, *, request_bytes: int) -> bool:
        """Count `body_bytes` more of an admitted request (a body without a declared length),
        `request_bytes` its size with them; False (nothing counted) when that passes a limit."""
        lim = self._limits
        if self._bytes.get(key, 0) + body_bytes > lim.per_credential_body_bytes:
            return False
        if (
            request_bytes > SMALL_BODY_BYTES
            and self.total_bytes + body_bytes > lim.total_body_bytes
        ):
            return False
        self._add_bytes(key, body_bytes)
        return True

    def release(self, key: str, body_bytes: int) -> None:
        n = self._requests.get(key, 0) - 1
        if n > 0:
            self._requests[key] = n
        else:
            self._requests.pop(key, None)
        self._add_bytes(key, -body_bytes)

    def _add_bytes(self, key: str, n: int) -> None:
        held = self._bytes.get(key, 0) + n
        if held > 0:
            self._bytes[key] = held
        else:
            self._bytes.pop(key, None)
        self.total_bytes += n

    def keys(self) -> int:
        return len(self._requests)


class _OverCap(Exception):
    """A body without a declared length grew past a limit while being read."""


def credential_key(scope: Scope) -> str:
    """Whom a request is counted against: its Authorization header (hashed: the table never
    holds a token), else the peer address (mTLS agents, /healthz, /metrics)."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return "auth:" + hashlib.blake2b(value, digest_size=16).hexdigest()
    client = scope.get("client")
    return f"peer:{client[0]}" if client else "peer:unknown"


def _declared_length(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return 0


class CredentialLimits:
    """ASGI middleware: per-credential requests and body bytes in flight, total body bytes."""

    def __init__(
        self,
        app: App,
        *,
        limits: ConnLimits,
        clock: Callable[[], float] = SYSTEM_CLOCK.monotonic,
    ) -> None:
        self._app = app
        self._clock = clock
        self.in_flight = InFlight(limits)
        self._peak_bytes = 0
        self._trimmed_at = float("-inf")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        key = credential_key(scope)
        declared = _declared_length(scope)
        refused = self.in_flight.admit(key, declared)
        if refused is not None:
            status, error, detail = refused
            log.warning(
                "event=request_refused status=%d limit=%s path=%s",
                status,
                detail["limit"],
                scope.get("path", ""),
            )
            await _answer(send, status, error, detail)
            return
        counted = declared
        received = 0
        started = False
        self._peak_bytes = max(self._peak_bytes, self.in_flight.total_bytes)

        async def counting_receive() -> Message:
            # the declared length was counted at admission; bytes past it (a body without a
            # declared length) are counted as they arrive
            nonlocal counted, received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                extra = received - counted
                if extra > 0:
                    if not self.in_flight.grow(key, extra, request_bytes=received):
                        raise _OverCap
                    counted += extra
            return message

        async def watching_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._app(scope, counting_receive, watching_send)
        except _OverCap:
            if not started:
                await _answer(
                    send,
                    429,
                    "too many body bytes in flight for this credential",
                    {"limit": "api.connections.per_credential_body_bytes"},
                )
        finally:
            self.in_flight.release(key, counted)
            self._maybe_trim()

    def _maybe_trim(self) -> None:
        if self.in_flight.total_bytes > 0 or self._peak_bytes < TRIM_AFTER_BYTES:
            return
        now = self._clock()
        if now - self._trimmed_at < TRIM_INTERVAL_S:
            return
        self._trimmed_at = now
        self._peak_bytes = 0
        return_memory()


async def _answer(send: Send, status: int, error: str, detail: dict[str, Any]) -> None:
    body = json.dumps({"error": error, "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    if status in (429, 503):
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


# --- memory -----------------------------------------------------------------------------------


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


_M_MMAP_THRESHOLD = -3
# Allocations from this size up (a report body being joined, a decoded report) are mapped
# on their own and unmapped when freed. Fixing the threshold turns off glibc's adjustment
# that, after large frees, keeps such buffers in the heap (which held 800 MB after a burst).
MMAP_THRESHOLD_BYTES = 256 * 1024


def tune_malloc() -> bool:
    """Fix glibc's mmap threshold (see MMAP_THRESHOLD_BYTES); False where there is no glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def return_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc malloc_trim); False where there is
    no glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    libc.malloc_trim(0)
    return True


# --- connections ------------------------------------------------------------------------------


class ConnectionTable:
    """The open connections: each busy, or idle since a monotonic time, and whether it has
    been answered a request yet."""

    def __init__(self, *, max_open: int) -> None:
        self.max_open = max_open
        self._idle_since: dict[Any, float | None] = {}  # None: busy
        self._served: set[Any] = set()

    def __len__(self) -> int:
        return len(self._idle_since)

    def admit(self, conn: Any, *, now: float, close: Callable[[Any], None]) -> bool:
        """Register `conn` (idle from now). When full, close an idle connection to make room:
        one that never completed a request first (an established agent's connection is the
        last to go), the idle longest among them; refuse (False) when every one is busy."""
        if len(self._idle_since) >= self.max_open:
            idle = [
                (c in self._served, since, id(c), c)
                for c, since in self._idle_since.items()
                if since is not None
            ]
            if not idle:
                return False
            victim = min(idle, key=lambda t: t[:3])[3]
            self.remove(victim)
            close(victim)
        self._idle_since[conn] = now
        return True

    def busy(self, conn: Any) -> None:
        if conn in self._idle_since:
            self._idle_since[conn] = None

    def idle(self, conn: Any, *, now: float) -> None:
        """`conn` answered a request and waits for the next."""
        if conn in self._idle_since:
            self._idle_since[conn] = now
            self._served.add(conn)

    def remove(self, conn: Any) -> None:
        self._idle_since.pop(conn, None)
        self._served.discard(conn)


_TIMEOUT_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\ncontent-length: 23\r\n"
    b"connection: close\r\n\r\nrequest took too long\r\n"
)
_FULL_503 = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\ncontent-length: 22\r\n"
    b"retry-after: 1\r\nconnection: close\r\n\r\ntoo many connections\r\n"
)


def bounded(options: dict[str, Any], limits: ConnLimits) -> dict[str, Any]:
    """uvicorn.Config keyword arguments (`options`, e.g. the TLS ones) with their HTTP
    protocol bounded by `limits`."""
    return {**options, "http": guarded_protocol(limits, base=options.get("http", "auto"))}


def guarded_protocol(
    limits: ConnLimits,
    *,
    base: type | str = "auto",
    table: ConnectionTable | None = None,
    clock: Callable[[], float] = SYSTEM_CLOCK.monotonic,
) -> type:
    """The uvicorn HTTP protocol class bounded by `limits` (uvicorn.Config(http=this,
    timeout_keep_alive=limits.idle_timeout_s)): the connection cap over `table`, and the
    header and body deadlines. `base`: the httptools protocol or a subclass of it (the
    mutual-TLS one, controller/tlsauth.py); "auto" is httptools (a declared dependency)."""
    # deferred: uvicorn is heavy and only the serving process needs it
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # noqa: PLC0415

    parent = HttpToolsProtocol if base == "auto" else base
    if not (isinstance(parent, type) and issubclass(parent, HttpToolsProtocol)):
        raise TypeError(f"guarded_protocol needs uvicorn's httptools protocol, got {base!r}")
    conns = ConnectionTable(max_open=limits.max_open) if table is None else table

    def close(proto: Any) -> None:
        log.info("event=connection_closed reason=connections_full open=%d", len(conns))
        proto.disarm()
        proto.transport.close()

    class GuardedHttpProtocol(parent):  # type: ignore[valid-type,misc]
        """uvicorn's httptools protocol with the connection cap and the deadlines."""

        _deadline: asyncio.TimerHandle | None = None
        table = conns

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if not conns.admit(self, now=clock(), close=close):
                log.warning("event=connection_refused reason=full open=%d", len(conns))
                transport.write(_FULL_503)
                transport.close()
                return
            self._arm(limits.header_timeout_s, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm()
            conns.remove(self)
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            conns.busy(self)
            if self._deadline is None:
                self._arm(limits.header_timeout_s, "headers")

        def on_headers_complete(self) -> None:
            self.disarm()
            self._arm(limits.body_timeout_s, "body")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self.disarm()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                conns.idle(self, now=clock())

        def _arm(self, after_s: float, stage: str) -> None:
            self._deadline = self.loop.call_later(after_s, self._expired, stage)

        def disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, stage: str) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            log.warning(
                "event=connection_closed reason=%s_timeout peer=%s",
                stage,
                self.client[0] if self.client else "unknown",
            )
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(_TIMEOUT_408)
            conns.remove(self)
            self.transport.close()

    return GuardedHttpProtocol
