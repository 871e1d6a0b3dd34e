"""Ingest workers: N processes that serve the controller's HTTP port and hand reports to it.

With `api.ingest_workers: N` (N > 0) the controller process (the core) binds the listening
socket and starts N worker processes (`python -m trainguard.controller.ingest`) that inherit it and
accept on it. A worker parses HTTP and, for `POST /v1/reports`, checks the credential (agent
token or client certificate; 401/403 as the core answers them) and the body limit (413),
then hands the raw body (bytes) and the node that credential speaks for to the core over its
own unix socket pair; the core decodes the body, refuses a report for another node and
ingests it exactly as it does its own requests, and sends back the response bytes. Every
other request (API, agentctl, /metrics, /healthz) is forwarded whole, and the core runs it
through its ASGI app in-process, so there is one API implementation. Workers know nothing
of HA leadership: a standby's core answers both 503 naming the leader (`api.create_app`).

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

Modules: `frames` (the channel's frames), `frontend` (the core's side: IngestFrontend),
`worker` (the worker process; `__main__` is its `-m` entry).
"""

from __future__ import annotations

from trainguard.controller.ingest.frames import (
    ANSWER_MAX_BYTES,
    HEADER,
    JSON_BODY,
    KIND_ANSWER,
    KIND_HTTP,
    KIND_READY,
    KIND_REPORT,
    KIND_TOKENS,
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
from trainguard.controller.ingest.frontend import IngestFrontend, call_asgi

__all__ = [
    "ANSWER_MAX_BYTES",
    "HEADER",
    "JSON_BODY",
    "KIND_ANSWER",
    "KIND_HTTP",
    "KIND_READY",
    "KIND_REPORT",
    "KIND_TOKENS",
    "FrameError",
    "IngestFrontend",
    "call_asgi",
    "decode_answer",
    "decode_http",
    "decode_handover",
    "encode_answer",
    "encode_frame",
    "encode_http",
    "encode_handover",
    "read_frame",
]
