"""Serve an ASGI app with a real uvicorn server on a loopback port, in a thread (the transport
of the fake controller, tests/fakes/controller_service.py)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from tests.helpers import wait_for


@contextmanager
def serve(app: Any, *, port: int = 0, startup_timeout_s: float = 10.0) -> Iterator[str]:
    """Yield the base URL ("http://127.0.0.1:PORT") while uvicorn serves `app` on `port`
    (0: a free one; a port served before can be served again)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off", interface="asgi3"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(
            lambda: server.started or not thread.is_alive(),
            timeout_s=startup_timeout_s,
            what="uvicorn to start",
            interval_s=0.01,
        )
        if not server.started:
            raise RuntimeError("uvicorn stopped before it started serving")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
