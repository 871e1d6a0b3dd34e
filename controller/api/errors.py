"""The API's one error shape, `{"error": "...", "detail": ...}`, and what each failure maps to:
`ApiError` (raised by the HTTP layer), the service's errors, an unreachable store, a write to a
controller that does not lead, and the framework's own validation and HTTP errors.

The report path answers these itself (`ApiError.reply`); every other route gets them from the
exception handlers `install_error_handlers` registers.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from trainguard.controller.errors import NotLeader, ServiceError
from trainguard.controller.store.errors import LeaseLost, StoreUnavailable
from trainguard.leader import LEADER_HEADER
from trainguard.protocol import ProtocolError

__all__ = [
    "STORE_RETRY_AFTER_S",
    "ApiError",
    "Leadership",
    "error_response",
    "install_error_handlers",
    "invalid_body",
    "json_bytes",
    "not_leader_error",
    "service_error_reply",
    "store_unavailable_error",
]

log = logging.getLogger("trainguard.controller.api")

# Retry-After on the 503 of a request that needed the store while it is unreachable
STORE_RETRY_AFTER_S = 2

UNAUTHORIZED_HEADERS = {"WWW-Authenticate": "Bearer"}


class Leadership(Protocol):
    """Whether this controller leads (HA, controller/ha.py): a standby answers every write
    503 with the leader's URL."""

    def is_leader(self) -> bool: ...

    def leader_url(self) -> str: ...

    def retry_after_s(self) -> int: ...


class ApiError(Exception):
    def __init__(
        self, status: int, error: str, detail: Any = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(error)
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = headers

    def reply(self) -> tuple[int, bytes, dict[str, str] | None]:
        """(status, JSON body, headers): this error as the report path answers it."""
        return self.status, json_bytes({"error": self.error, "detail": self.detail}), self.headers


def json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def error_response(
    status: int, error: str, detail: Any = None, headers: dict[str, str] | None = None
) -> Response:
    body = json_bytes({"error": error, "detail": detail})
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def not_leader_error(leadership: Leadership, reason: str = "") -> ApiError:
    """The 503 of a write to a controller that does not lead: body and headers name the
    leader (X-Trainguard-Leader; empty while none is known) and when to retry."""
    leader = leadership.leader_url()
    where = f"send writes to the leader, {leader}" if leader else "no leader is known yet"
    return ApiError(
        503,
        f"this controller does not lead: {where}",
        {"leader": leader or None, "reason": reason or "standby"},
        {LEADER_HEADER: leader, "Retry-After": str(leadership.retry_after_s())},
    )


def store_unavailable_error() -> ApiError:
    """The 503 of a request that needed the store while it cannot be reached (PostgreSQL
    stopped or cut off). The store's URL is the controller's business: the log names it."""
    return ApiError(
        503,
        "this controller cannot reach its store: it writes and acts on nothing until the "
        "store is back; retry",
        {"reason": "store_unavailable"},
        {"Retry-After": str(STORE_RETRY_AFTER_S)},
    )


def service_error_reply(exc: ServiceError) -> tuple[int, bytes, dict[str, str] | None]:
    """A service error other than NotLeader: its own 4xx, anything else a 500."""
    status = exc.status if 400 <= exc.status < 500 else 500
    return status, json_bytes({"error": str(exc) or type(exc).__name__, "detail": None}), None


def invalid_body(e: ProtocolError) -> ApiError:
    """A body the wire decoder refused: 400 when it is not JSON, 422 naming the field else."""
    if e.reason.startswith("invalid JSON"):
        return ApiError(400, "invalid JSON", {"field": e.field, "reason": e.reason})
    return ApiError(422, "invalid body", {"field": e.field, "reason": e.reason})


def install_error_handlers(app: FastAPI, *, leadership: Leadership | None) -> None:
    """Answer every error a route raises in the one shape; a 5xx never says more than
    "internal error" (the log has the rest)."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.error, exc.detail, exc.headers)

    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> Response:
        if isinstance(exc, NotLeader) and leadership is not None:
            err = not_leader_error(leadership, str(exc))
            return error_response(err.status, err.error, err.detail, err.headers)
        status, body, _no_headers = service_error_reply(exc)
        return Response(body, status_code=status, media_type="application/json")

    @app.exception_handler(LeaseLost)
    async def _lease_lost(_: Request, exc: LeaseLost) -> Response:
        # the store's fence refused a write: answered as a standby's NotLeader is
        if leadership is None:  # no fence without HA
            return error_response(500, str(exc) or type(exc).__name__, None, None)
        err = not_leader_error(leadership, str(exc))
        return error_response(err.status, err.error, err.detail, err.headers)

    @app.exception_handler(StoreUnavailable)
    async def _store_unavailable(_: Request, exc: StoreUnavailable) -> Response:
        err = store_unavailable_error()
        return error_response(err.status, err.error, err.detail, err.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        detail = [
            {"field": ".".join(str(p) for p in err.get("loc", ())), "reason": err.get("msg", "")}
            for err in exc.errors()
        ]
        return error_response(422, "invalid request", detail)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers) if exc.headers else None
        return error_response(exc.status_code, str(exc.detail), None, headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # method and path only: headers (Authorization) and bodies are never logged
        log.error(
            "event=api_error method=%s path=%s error=%s",
            request.method,
            request.url.path,
            type(exc).__name__,
            exc_info=exc,
        )
        return error_response(500, "internal error")
