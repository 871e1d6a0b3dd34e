"""Helpers for integration tests that run a real `trainguard-agent` process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from trainguard.protocol import Event, Report, decode_json


def agent_command() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("trainguard-agent")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "trainguard.agent.main"]


def wait_until(cond: Callable[[], Any], *, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.05)


def short_tmpdir() -> Path:
    # unix socket paths are limited to 108 bytes; pytest's tmp_path can be longer
    return Path(tempfile.mkdtemp(prefix="tgit", dir="/tmp"))


class AgentProcess:
    """A running agent (sim backend by default) with its stderr in a file."""

    def __init__(self, workdir: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.socket_path = workdir / "hb.sock"
        self.log_path = workdir / "agent.log"
        self._log = self.log_path.open("wb")
        args = [
            *agent_command(),
            "--gpu-backend", "sim", "--gpus", "8", "--ib-ports", "8",
            "--node-name", "node-1", "--metrics-port", "0", "--metrics-address", "127.0.0.1",
            "--heartbeat-socket", str(self.socket_path), "--jobs-dir", str(workdir / "jobs"),
            *extra,
        ]  # fmt: skip
        full_env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=self._log, env=full_env, cwd=workdir
        )
        self.port = int(
            wait_until(self._port, what=f"the agent to log its metrics port ({self.log_path})")
        )

    def _port(self) -> str | None:
        if self.proc.poll() is not None:
            pytest.fail(f"agent exited with {self.proc.returncode}:\n{self.log()}")
        m = re.search(r"metrics_port=(\d+)", self.log())
        return m.group(1) if m else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def inject(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*agent_command(), "inject", "--metrics-port", str(self.port), *args],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip

    def terminate(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def sample_value(body: str, name: str, **labels: str) -> float | None:
    for line in body.splitlines():
        m = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


class FakeController:
    """POST /v1/reports like the controller: stores events by (instance, id), acks the
    contiguous prefix, hands out queued commands once; can stop and restart on its port."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.lock = threading.Lock()
        self.reports: list[Report] = []
        self.events: dict[tuple[str, int], Event] = {}
        self.deliveries = 0
        self.pending_commands: list[dict[str, Any]] = []
        self.unauthorized = 0
        self.httpd: ThreadingHTTPServer | None = None
        self.port = 0
        self.start()

    def start(self) -> None:
        ctl = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Authorization") != f"Bearer {ctl.token}":
                    with ctl.lock:
                        ctl.unauthorized += 1
                    self._answer(401, {"detail": "bad token"})
                    return
                report = decode_json(Report, body)
                with ctl.lock:
                    ctl.reports.append(report)
                    for ev in report.events:
                        ctl.deliveries += 1
                        ctl.events[(report.instance, ev.id)] = ev
                    ack = 0
                    for i in sorted(i for inst, i in ctl.events if inst == report.instance):
                        if i != ack + 1:
                            break
                        ack = i
                    commands, ctl.pending_commands = ctl.pending_commands, []
                self._answer(200, {"ack_event_id": ack, "commands": commands})

            def _answer(self, status: int, obj: dict[str, Any]) -> None:
                out = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def events_of(self, kind: str) -> list[Event]:
        with self.lock:
            return [e for e in self.events.values() if e.kind == kind]


def cleanup(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
