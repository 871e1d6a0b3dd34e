"""What a request carries, checked the same way on every route and in the ingest workers: its
headers (one Authorization at most), its credential (a bearer token for a permission, or for a
report a client certificate naming a node), and its body within the size limit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.types import Receive, Scope

from trainguard.controller.api.errors import UNAUTHORIZED_HEADERS, ApiError, invalid_body
from trainguard.controller.auth import Permission, Principal, TokenStore
from trainguard.controller.tlsauth import PEER_NODE_KEY
from trainguard.protocol import ProtocolError
from trainguard.wire_schemas import decoder

__all__ = [
    "Bodies",
    "Guards",
    "authenticate",
    "authenticate_report",
    "check_token",
    "read_limited",
    "request_headers",
]

T = TypeVar("T")


def check_token(tokens: TokenStore, token: str | None, permission: Permission) -> Principal:
    """The token's principal when it may do `permission`; 401 unknown or missing, 403 else."""
    if not token:
        raise ApiError(401, "missing bearer token", headers=UNAUTHORIZED_HEADERS)
    principal = tokens.authenticate(token)
    if principal is None:
        raise ApiError(401, "unknown token", headers=UNAUTHORIZED_HEADERS)
    if not principal.may(permission):
        raise ApiError(403, f"role {principal.role} may not {permission}", {"role": principal.role})
    return principal


def request_headers(raw: list[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """A request's headers as a dict (names are lower case in ASGI); 400 when Authorization
    is repeated: one layer reading the first and another the last would let a request carry
    two credentials."""
    headers = dict(raw)
    if len(headers) < len(raw) and sum(1 for k, _ in raw if k == b"authorization") > 1:
        raise ApiError(400, "repeated Authorization header: send one", {"header": "Authorization"})
    return headers


def authenticate_report(tokens: TokenStore, headers: dict[bytes, bytes], scope: Scope) -> Principal:
    """Who posts a report: the bearer token when an Authorization header is sent, else the
    node named by the connection's verified client certificate (mutual TLS), else 401."""
    header = headers.get(b"authorization")
    if header is None:
        state = scope.get("state")
        node = state.get(PEER_NODE_KEY) if state else None
        if node is not None:
            return Principal(name=f"cert:{node}", role="agent", node=node)
    return authenticate(tokens, header, "report")


def authenticate(tokens: TokenStore, header: bytes | None, permission: Permission) -> Principal:
    """The Authorization header's bearer token checked for `permission` (as HTTPBearer reads
    it: scheme case-insensitive, anything but "Bearer <token>" counts as no token)."""
    token = None
    if header:
        scheme, _, credentials = header.decode("latin-1").strip().partition(" ")
        if scheme.lower() == "bearer":
            token = credentials.strip()
    return check_token(tokens, token, permission)


async def read_limited(declared: bytes | None, receive: Receive, max_bytes: int) -> bytes:
    """The request body; 413 when it (or its declared length) exceeds `max_bytes`."""
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, "body too large", {"max_bytes": max_bytes})
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(400, "client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, "body too large", {"max_bytes": max_bytes})
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class Guards:
    """The role checks routes depend on: `reader` (read) and `writer` (write), and the bearer
    scheme the OpenAPI document names."""

    def __init__(self, tokens: TokenStore) -> None:
        self.bearer = HTTPBearer(auto_error=False, description="Bearer token from the tokens file")
        self.reader = self._require(tokens, "read")
        self.writer = self._require(tokens, "write")

    def _require(
        self, tokens: TokenStore, permission: Permission
    ) -> Callable[..., Awaitable[Principal]]:
        async def check(
            creds: HTTPAuthorizationCredentials | None = Depends(self.bearer),
        ) -> Principal:
            return check_token(tokens, None if creds is None else creds.credentials, permission)

        return check


class Bodies:
    """Request bodies read within `max_body_bytes` and decoded by the wire decoders."""

    def __init__(self, *, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes

    async def read(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        limit = declared.encode() if declared is not None else None
        return await read_limited(limit, request.receive, self.max_body_bytes)

    async def decode(self, request: Request, cls: type[T], *, if_empty: T | None = None) -> T:
        """The body decoded as `cls`; `if_empty` (when given) stands for an empty body."""
        raw = await self.read(request)
        if if_empty is not None and not raw.strip():
            return if_empty
        try:
            return decoder(cls).decode_json(raw)
        except ProtocolError as e:
            raise invalid_body(e) from None
