"""A local instance metadata service on a free loopback port: AWS IMDSv2 and GCP, shaped
like the real ones (paths, headers, status codes, bodies), for preemption-notice tests."""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

AWS_TOKEN_PATH = "/latest/api/token"
AWS_ACTION_PATH = "/latest/meta-data/spot/instance-action"
GCP_PREFIX = "/computeMetadata/v1/instance/"


class MetadataServer:
    """Serves both clouds' metadata paths. AWS: a token comes only from PUT with the TTL
    header; every GET needs a currently valid token (401 otherwise, as IMDSv2 answers);
    `spot/instance-action` is 404 until `aws_action` is set. GCP: every request needs
    `Metadata-Flavor: Google` (403 otherwise); `preempted` is "FALSE" until set."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (method, path, headers)
        self.tokens: set[str] = set()
        self.aws_action: dict[str, str] | None = None
        self.gcp_preempted = "FALSE"
        self.gcp_maintenance = "NONE"
        self.fail_status: int | None = None  # answer everything with this status when set
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _record(self) -> None:
                with server.lock:
                    server.requests.append((self.command, self.path, dict(self.headers.items())))

            def _send(self, status: int, body: str, content_type: str = "text/plain") -> None:
                raw = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                if self.path.startswith(GCP_PREFIX):
                    self.send_header("Metadata-Flavor", "Google")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_PUT(self) -> None:
                self._record()
                if server.fail_status is not None:
                    self._send(server.fail_status, "")
                    return
                if self.path != AWS_TOKEN_PATH:
                    self._send(404, "")
                    return
                ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
                if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                    self._send(400, "")
                    return
                token = secrets.token_urlsafe(24)
                with server.lock:
                    server.tokens.add(token)
                self._send(200, token)

            def do_GET(self) -> None:
                self._record()
                if server.fail_status is not None:
                    self._send(server.fail_status, "")
                    return
                if self.path.startswith("/latest/"):
                    with server.lock:
                        valid = self.headers.get("X-aws-ec2-metadata-token") in server.tokens
                        action = server.aws_action
                    if not valid:
                        self._send(401, "")
                    elif self.path != AWS_ACTION_PATH or action is None:
                        self._send(404, "")
                    else:
                        self._send(200, json.dumps(action), "application/json")
                    return
                if self.path.startswith(GCP_PREFIX):
                    if self.headers.get("Metadata-Flavor") != "Google":
                        self._send(403, "Missing Metadata-Flavor:Google header.")
                        return
                    name = self.path[len(GCP_PREFIX) :]
                    with server.lock:
                        values = {
                            "preempted": server.gcp_preempted,
                            "maintenance-event": server.gcp_maintenance,
                        }
                    if name in values:
                        self._send(200, values[name])
                    else:
                        self._send(404, "")
                    return
                self._send(404, "")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def revoke_tokens(self) -> None:
        with self.lock:
            self.tokens.clear()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
