"""Connection flood: controller RSS before, during and after unfinished report bodies and idle
connections, and whether a regular agent keeps reporting meanwhile.

Setup: a real `trainguard-controller` (SQLite store, node-bound agent tokens, the default
api.connections bounds unless flags say otherwise). Phases, each measured from
/proc/<pid>/status (VmRSS) before, at its peak and a few seconds after the connections close:

1. one token: `--bodies` connections (default 200), each declaring a 4 MiB report body and
   sending `--sent-kib` of it, then holding (the per-credential cap answers all but two);
2. many tokens: the same with one token per connection (the total cap answers past it);
3. idle: `--idle` connections (default 2,100) that send nothing (the connection cap and the
   header deadline close them).

A regular agent (its own token and keep-alive connection) posts a report every 0.2 s
throughout; its failures are counted. Prints one JSON object.

    .venv/bin/python bench/conn_flood.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.controller_proc import dbe_rules, start_controller, write_config

BODY_BYTES = 4 * 1024 * 1024


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Agent(threading.Thread):
    """Posts a report every 0.2 s on one keep-alive connection; counts what failed."""

    def __init__(self, url: str, token: str) -> None:
        super().__init__(daemon=True)
        self.client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
        self.ok = self.failed = 0
        self.stop = threading.Event()

    def run(self) -> None:
        seq = 0
        while not self.stop.wait(0.2):
            seq += 1
            body = f'{{"node": "agent", "instance": "i1", "seq": {seq}, "sent_at": {time.time()}}}'
            try:
                status = self.client.post("/v1/reports", content=body).status_code
            except httpx.HTTPError:
                status = 0
            if status == 200:
                self.ok += 1
            else:
                self.failed += 1


def unfinished(host: str, port: int, token: str, sent_bytes: int) -> socket.socket | None:
    try:
        s = socket.create_connection((host, port), timeout=10)
        s.sendall(
            f"POST /v1/reports HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {BODY_BYTES}\r\n\r\n".encode()
            + b" " * sent_bytes
        )
        return s
    except OSError:
        return None


def answers(socks: list[socket.socket]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in socks:
        s.settimeout(0.05)
        try:
            head = s.recv(64).split(b"\r\n", 1)[0].decode(errors="replace") or "closed"
        except TimeoutError:
            head = "held"
        except OSError:
            head = "closed"
        out[head] = out.get(head, 0) + 1
    return out


def phase(
    name: str, pid: int, open_socks: Any, *, agent: Agent, hold_s: float, settle_s: float
) -> dict[str, Any]:
    ok, failed = agent.ok, agent.failed
    before = rss_mb(pid)
    socks = [s for s in open_socks() if s is not None]
    peak = rss_mb(pid)
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:
        peak = max(peak, rss_mb(pid))
        time.sleep(0.2)
    seen = answers(socks)
    for s in socks:
        with contextlib.suppress(OSError):
            s.close()
    time.sleep(settle_s)
    return {
        "phase": name,
        "connections": len(socks),
        "rss_before_mb": round(before, 1),
        "rss_peak_mb": round(peak, 1),
        "rss_after_mb": round(rss_mb(pid), 1),
        "answers": seen,
        "agent_reports_ok": agent.ok - ok,
        "agent_reports_failed": agent.failed - failed,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bodies", type=int, default=200)
    p.add_argument("--sent-kib", type=int, default=3072)
    p.add_argument("--idle", type=int, default=2100)
    p.add_argument("--hold-s", type=float, default=5.0)
    p.add_argument("--settle-s", type=float, default=5.0)
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.idle + 512)), hard))
    tokens = {f"f{i}": f"flood-token-{i}" for i in range(args.bodies)}
    tokens["agent"] = "agent-token-regular"
    with tempfile.TemporaryDirectory(prefix="tgflood") as tmp:
        work = Path(tmp)
        config = write_config(
            work, rules=dbe_rules(), agent_tokens=tokens, max_body_bytes=BODY_BYTES
        )
        data = yaml.safe_load(config.read_text())
        data["api"]["max_nodes"] = args.bodies + 10
        config.write_text(yaml.safe_dump(data))
        proc = start_controller(config, log_path=work / "controller.log")
        try:
            host, port_text = proc.url.split("//")[1].split(":")
            port = int(port_text)
            pid = proc.popen.pid
            agent = Agent(proc.url, tokens["agent"])
            agent.start()
            time.sleep(1.0)
            sent = args.sent_kib * 1024
            results = [
                phase(
                    "one_token_unfinished_bodies",
                    pid,
                    lambda: [
                        unfinished(host, port, tokens["f0"], sent) for _ in range(args.bodies)
                    ],
                    agent=agent,
                    hold_s=args.hold_s,
                    settle_s=args.settle_s,
                ),
                phase(
                    "token_per_connection_unfinished_bodies",
                    pid,
                    lambda: [
                        unfinished(host, port, tokens[f"f{i}"], sent) for i in range(args.bodies)
                    ],
                    agent=agent,
                    hold_s=args.hold_s,
                    settle_s=args.settle_s,
                ),
                phase(
                    "idle_connections",
                    pid,
                    lambda: [_connect(host, port) for _ in range(args.idle)],
                    agent=agent,
                    hold_s=args.hold_s,
                    settle_s=args.settle_s,
                ),
            ]
            fresh = httpx.get(f"{proc.url}/healthz", timeout=10).status_code
            agent.stop.set()
            agent.join(timeout=10)
            print(
                json.dumps(
                    {
                        "phases": results,
                        "agent_reports_ok": agent.ok,
                        "agent_reports_failed": agent.failed,
                        "fresh_healthz": fresh,
                        "controller_alive": proc.popen.poll() is None,
                    },
                    indent=2,
                )
            )
        finally:
            proc.kill()
    return 0


def _connect(host: str, port: int) -> socket.socket | None:
    try:
        return socket.create_connection((host, port), timeout=10)
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
