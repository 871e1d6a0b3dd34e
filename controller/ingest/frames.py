"""The ingest channel's frames: `!IBI` (payload length, kind, request id) + payload, and the
payload codecs of each kind. Raw bytes and JSON only; nothing is pickled."""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

__all__ = [
    "ANSWER_MAX_BYTES",
    "HEADER",
    "JSON_BODY",
    "KIND_ANSWER",
    "KIND_HTTP",
    "KIND_READY",
    "KIND_REPORT",
    "KIND_TOKENS",
    "KINDS",
    "FrameError",
    "Headers",
    "decode_answer",
    "decode_http",
    "decode_handover",
    "encode_answer",
    "encode_frame",
    "encode_http",
    "encode_handover",
    "error_answer",
    "json_headers",
    "read_frame",
]

# payload length, kind, request id
HEADER = struct.Struct("!IBI")
KIND_TOKENS = 1  # core -> worker: JSON [[name, role, sha256 hex, node or null], ...]
KIND_READY = 2  # worker -> core: JSON {"pid": ...}, once it accepts connections
KIND_REPORT = 3  # worker -> core: actor name, the node it speaks for, raw report body
KIND_HTTP = 4  # worker -> core: any other request, whole
KIND_ANSWER = 5  # core -> worker: status, headers, body
KINDS = frozenset({KIND_TOKENS, KIND_READY, KIND_REPORT, KIND_HTTP, KIND_ANSWER})
_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_ANSWER = struct.Struct("!HBI")  # status, flags, length of the JSON header list
# answer flag: the body is JSON; the worker adds content-type and content-length itself (the
# usual report answer travels without a header list to encode and parse)
JSON_BODY = 1
# largest frame a worker takes from the core: answers are not bound by the request body limit
# (a GET of every incident or node can be megabytes), only guarded against a corrupt length
ANSWER_MAX_BYTES = 1 << 30

Headers = list[tuple[bytes, bytes]]


class FrameError(ValueError):
    """A channel frame that is not what the protocol allows: the channel is dropped."""


def encode_frame(kind: int, request_id: int, payload: bytes) -> bytes:
    return HEADER.pack(len(payload), kind, request_id) + payload


def encode_handover(actor: str, node: str | None, body: bytes) -> bytes:
    """A report frame's payload, a received report handed over to the core: the authenticated
    actor, the node its credential speaks for (None: a shared agent token; sent as an empty
    name) and the raw body."""
    name = actor.encode()
    bound = (node or "").encode()
    return _U16.pack(len(name)) + name + _U16.pack(len(bound)) + bound + body


def decode_handover(payload: bytes) -> tuple[str, str | None, bytes]:
    """(actor, node or None, raw body) of a report frame's payload."""
    if len(payload) < _U16.size:
        raise FrameError("report frame shorter than its header")
    (n,) = _U16.unpack_from(payload)
    pos = _U16.size + n
    if pos + _U16.size > len(payload):
        raise FrameError("report frame: actor name runs past the frame")
    (m,) = _U16.unpack_from(payload, pos)
    start = pos + _U16.size
    if start + m > len(payload):
        raise FrameError("report frame: node name runs past the frame")
    node = payload[start : start + m].decode() or None
    return payload[2:pos].decode(), node, payload[start + m :]


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
        headers = json_headers(body) + headers
    return status, headers, body


async def read_frame(reader: asyncio.StreamReader, *, max_bytes: int) -> tuple[int, int, bytes]:
    """(kind, request id, payload); IncompleteReadError at EOF, FrameError on a bad frame."""
    length, kind, request_id = HEADER.unpack(await reader.readexactly(HEADER.size))
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind}")
    if length > max_bytes:
        raise FrameError(f"frame of {length} bytes exceeds {max_bytes}")
    return kind, request_id, await reader.readexactly(length)


def json_headers(body: bytes, extra: dict[str, str] | None = None) -> Headers:
    """content-type and content-length of a JSON `body`, then `extra` (names lower-cased)."""
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if extra:
        headers += [(k.lower().encode(), v.encode()) for k, v in extra.items()]
    return headers


def error_answer(status: int, error: str, detail: Any = None) -> tuple[int, Headers, bytes]:
    """(status, headers, body) of the API's error shape `{"error": ..., "detail": ...}`."""
    body = json.dumps({"error": error, "detail": detail}, separators=(",", ":")).encode()
    return status, json_headers(body), body
