"""Agent overhead: CPU share of one core and peak RSS of a real `trainguard-agent` process.

Setup: sim backend, 8 GPUs, 8 IB ports, 1 s collection; 8 sender threads (in this process)
send trainer heartbeats at 20 Hz each; /metrics is scraped every --scrape-interval-s; with
--controller (default) the agent also reports every second to a local receiver that answers
like the controller. CPU comes from /proc/<pid>/stat (utime + stime) over the measured window,
after a warm-up that excludes interpreter start-up; peak RSS is VmHWM from /proc/<pid>/status.

    .venv/bin/python bench/agent_overhead.py --seconds 60
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainguard.protocol import Heartbeat, encode_json

TARGET_CPU_PERCENT = 2.0
TARGET_RSS_MB = 80.0


def agent_command() -> list[str]:
    script = Path(sys.executable).with_name("trainguard-agent")
    return [str(script)] if script.exists() else [sys.executable, "-m", "trainguard.agent.main"]


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def status_kb(pid: int, key: str) -> int:
    m = re.search(rf"^{key}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(m.group(1)) if m else 0


class Receiver:
    """Answers POST /v1/reports with an ack of every event it got (controller-shaped)."""

    def __init__(self) -> None:
        self.reports = 0

        recv = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                recv.reports += 1
                ack = max((e["id"] for e in body.get("events", [])), default=0)
                out = json.dumps({"ack_event_id": ack}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def sender(
    path: str, rank: int, hz: float, stop: threading.Event, sent: list[int], failed: list[int]
) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.setblocking(False)
    step = 0
    next_t = time.monotonic()
    while not stop.is_set():
        step += 1
        hb = Heartbeat(
            job="bench", rank=rank, local_rank=rank, world_size=8, step=step, t=time.time(),
            loss=2.0 - step * 1e-4, samples_per_s=512.0, step_time_s=1 / hz, pid=os.getpid(),
        )  # fmt: skip
        try:
            s.sendto(encode_json(hb), path)
            sent[rank] += 1
        except OSError:
            failed[rank] += 1  # queue full (EAGAIN) or agent gone: the heartbeat is lost
        next_t += 1 / hz
        stop.wait(max(0.0, next_t - time.monotonic()))
    s.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="measured window")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--heartbeat-hz", type=float, default=20.0)
    ap.add_argument("--scrape-interval-s", type=float, default=15.0)
    ap.add_argument("--controller", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tgbench", dir="/tmp"))
    sock = work / "hb.sock"
    receiver = Receiver() if args.controller else None
    extra: list[str] = []
    if receiver:
        token = work / "token"
        token.write_text("bench-token\n")
        token.chmod(0o600)
        extra = ["--controller", receiver.url, "--token-file", str(token)]
    log = (work / "agent.log").open("wb")
    cmd = [
        *agent_command(), "--gpu-backend", "sim", "--gpus", "8", "--ib-ports", "8",
        "--node-name", "bench-node", "--metrics-address", "127.0.0.1", "--metrics-port", "0",
        "--collect-interval-s", "1", "--heartbeat-socket", str(sock), *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 30
        port = None
        while port is None:
            m = re.search(r"metrics_port=(\d+)", (work / "agent.log").read_text())
            port = int(m.group(1)) if m else None
            if proc.poll() is not None or time.monotonic() > deadline:
                print((work / "agent.log").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.05)
        sent = [0] * args.ranks
        failed = [0] * args.ranks
        threads = [
            threading.Thread(
                target=sender, args=(str(sock), r, args.heartbeat_hz, stop, sent, failed)
            )
            for r in range(args.ranks)
        ]
        for t in threads:
            t.start()
        time.sleep(args.warmup_s)
        cpu0, t0, sent0, failed0 = cpu_seconds(proc.pid), time.monotonic(), sum(sent), sum(failed)
        scrapes = 0
        next_scrape = t0
        with httpx.Client() as client:
            while (now := time.monotonic()) < t0 + args.seconds:
                if now >= next_scrape:
                    client.get(f"http://127.0.0.1:{port}/metrics").raise_for_status()
                    scrapes += 1
                    next_scrape += args.scrape_interval_s
                time.sleep(min(0.5, max(0.0, t0 + args.seconds - now)))
            cpu1, t1 = cpu_seconds(proc.pid), time.monotonic()
            metrics = client.get(f"http://127.0.0.1:{port}/metrics").text
        hwm_mb = status_kb(proc.pid, "VmHWM") / 1024
        rss_mb = status_kb(proc.pid, "VmRSS") / 1024
        received = re.search(
            r"^trainguard_agent_heartbeats_received_total\{.*\} (\S+)$", metrics, re.M
        )
        cpu_pct = 100 * (cpu1 - cpu0) / (t1 - t0)
        hb_sent = sum(sent) - sent0
        hb_failed = sum(failed) - failed0
    finally:
        stop.set()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        log.close()
        if receiver:
            receiver.close()
        shutil.rmtree(work, ignore_errors=True)

    rows = [
        ("window", f"{t1 - t0:.1f} s (after {args.warmup_s:.0f} s warm-up)", ""),
        ("setup", f"sim 8 GPUs + 8 IB ports, collect 1 s, {args.ranks} ranks x "
         f"{args.heartbeat_hz:g} Hz, scrape every {args.scrape_interval_s:g} s, "
         f"reports {'1 s' if receiver else 'off'}", ""),
        ("heartbeats sent in window", f"{hb_sent}", ""),
        ("heartbeats lost at sender (queue full)", f"{hb_failed}", "0"),
        ("heartbeats received (total)", received.group(1) if received else "?", ""),
        ("scrapes", str(scrapes), ""),
        ("reports received", str(receiver.reports) if receiver else "-", ""),
        ("agent CPU, % of one core", f"{cpu_pct:.2f}", f"<= {TARGET_CPU_PERCENT:g}"),
        ("agent peak RSS (VmHWM), MB", f"{hwm_mb:.1f}", f"<= {TARGET_RSS_MB:g}"),
        ("agent RSS at end, MB", f"{rss_mb:.1f}", ""),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(f"{'what':<{width}}  {'measured':<12}  target")
    for name, value, target in rows:
        print(f"{name:<{width}}  {value:<12}  {target}")
    flags = " --no-controller" if not receiver else ""
    print(
        f"\nreproduce: .venv/bin/python bench/agent_overhead.py --seconds {args.seconds:g}{flags}"
    )
    ok = cpu_pct <= TARGET_CPU_PERCENT and hwm_mb <= TARGET_RSS_MB
    print("result:", "within targets" if ok else "OVER TARGET")
    return 0


if __name__ == "__main__":
    sys.exit(main())
