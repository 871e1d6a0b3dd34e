"""Controller scale bench: N simulated agents (8 GPUs x 18 NVLinks, 8 IB ports) report at 1 Hz.

Starts the real `trainguard-controller` process (SQLite store, or the PostgreSQL database
that `--store-url` names; default rules) on loopback and drives it from a few load-generator
processes, each holding one keep-alive HTTP/1.1 connection per simulated node (a minimal
raw-socket client, so the generator spends as little of the shared CPUs as it can). The
generator shares the machine's cores with the controller.

Prints: client-side report latency p50/p99, achieved report rate, controller CPU (from
/proc), server-side ingest and rule tick durations (scraped from the controller's /metrics),
and the detection latency of a double-bit ECC error injected into one node's reports
(report carrying it sent -> incident visible through GET /v1/incidents).

Values move like a busy node's: every GPU's power (and now and then its temperature) and
every IB port's data counters change each second; NVLink and error counters stay put. By
default each simulated agent sends delta reports as `trainguard.agent.reporter` does (a full report
every 30, only the changed GPUs and ports in between, a full one whenever the controller
answers `want_full`); `--full-only` sends full reports in the original shape, as agents
without delta support do.

    .venv/bin/python bench/controller_scale.py --nodes 2048 --seconds 60
    .venv/bin/python bench/controller_scale.py --nodes 1024 --store-url postgresql://...
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from trainguard.model import GpuSample, IbPortSample, NvLinkSample
from trainguard.protocol import Event, Report, encode_json

ROOT = Path(__file__).resolve().parents[1]
AGENT_TOKEN = "bench-agent-token"
OP_TOKEN = "bench-operator-token"
DBE_NODE = "node-0000"
DBE_GPU = 3
FULL_EVERY = 30
# Placeholders in a pre-encoded report: slot k is written as the integer _SLOT + k.
_SLOT = 770_000_000
SEQ, SENT_AT, BASE_SEQ = 0, 1, 2


_VALUES: dict[tuple[int, int, int], list[bytes]] = {}


def _slot_values(seq: int, sent_at: float, *, gpus: int, ports: int) -> list[bytes]:
    """What the placeholders of report number `seq` say (see `_report`). All nodes send the
    same values (only sent_at differs), so they are formatted once per seq: the generator
    shares the controller's cores and must spend as little as it can."""
    key = (seq, gpus, ports)
    values = _VALUES.get(key)
    if values is None:
        if len(_VALUES) > 256:
            _VALUES.clear()
        values = _VALUES[key] = _format_values(seq, gpus=gpus, ports=ports)
    out = values.copy()
    out[SENT_AT] = b"%.3f" % sent_at
    return out


def _format_values(seq: int, *, gpus: int, ports: int) -> list[bytes]:
    out = [b"%d" % seq, b"", b"%d" % (seq - 1)]
    for i in range(gpus):
        out.append(b"%.1f" % (48.0 + i + (seq // 7) % 3))  # temperature: now and then
        out.append(b"%.1f" % (580.0 + (seq * 37 + i * 11) % 50))  # power: every second
    for p in range(ports):
        out.append(b"%d" % (123_456_789 + seq * 1_250_000 + p))  # port_xmit_data
        out.append(b"%d" % (987_654_321 + seq * 1_250_000 + p))  # port_rcv_data
    return out


def _node_names(count: int) -> list[str]:
    return [f"node-{i:04d}" for i in range(count)]


def _agent_token(node: str) -> str:
    """The agent token of `node` (each node has its own, bound to it)."""
    return f"{AGENT_TOKEN}-{node}"


def _report(node: str, *, dbe: bool, mode: str = "legacy") -> Report:
    """One node's report with placeholders for every value that moves. mode: "legacy" (no
    delta fields), "full" (a full report of a delta-capable agent) or "delta" (what changes
    every second: all GPUs without their NVLinks, all IB ports)."""
    slot = iter(range(_SLOT + 3, _SLOT + 1000))
    gpus = []
    for i in range(8):
        links = tuple(
            NvLinkSample(
                link=link,
                up=True,
                crc_flit_errors_total=0,
                crc_data_errors_total=0,
                replay_errors_total=0,
                recovery_errors_total=0,
            )
            for link in range(18)
        )
        hit = dbe and i == DBE_GPU
        gpus.append(
            GpuSample(
                index=i,
                uuid=f"GPU-{hashlib.md5(f'{node}/{i}'.encode()).hexdigest()[:16]}",
                pci_bus_id=f"0000:{0x18 + i:02x}:00.0",
                name="NVIDIA H100 80GB HBM3",
                temperature_celsius=next(slot),
                power_watts=next(slot),
                utilization_gpu_percent=98.0,
                utilization_memory_percent=61.0,
                memory_used_bytes=71_000_000_000,
                memory_total_bytes=85_520_809_984,
                sm_clock_mhz=1980.0,
                clock_event_reasons=0,
                throttle_hw_slowdown=False,
                throttle_hw_thermal=False,
                throttle_sw_thermal=False,
                throttle_power_brake=False,
                ecc_corrected_volatile_total=2,
                ecc_uncorrected_volatile_total=1 if hit else 0,
                ecc_corrected_aggregate_total=17,
                ecc_uncorrected_aggregate_total=1 if hit else 0,
                remapped_rows_correctable=0,
                remapped_rows_uncorrectable=0,
                remapped_rows_pending=False,
                remapped_rows_failure=False,
                pcie_replay_total=0,
                nvlinks=() if mode == "delta" else links,
            )
        )
    ports = tuple(
        IbPortSample(
            device=f"mlx5_{p}",
            port=1,
            state="ACTIVE",
            state_code=4,
            phys_state="LinkUp",
            phys_state_code=5,
            rate_gbps=400.0,
            link_layer="InfiniBand",
            counters={
                "port_xmit_data": next(slot),
                "port_rcv_data": next(slot),
                "symbol_error": 0,
                "link_downed": 0,
                "link_error_recovery": 0,
                "port_rcv_errors": 0,
            },
            hw_counters={"rnr_nak_retry_err": 0},
        )
        for p in range(8)
    )
    events: tuple[Event, ...] = ()
    if dbe:
        events = (Event(id=1, kind="xid", ts=0.0, gpu=DBE_GPU, code=48, message="Xid 48: DBE"),)
    return Report(
        node=node,
        instance="bench",
        seq=_SLOT + SEQ,
        sent_at=_SLOT + SENT_AT,
        agent_version="bench",
        gpus=tuple(gpus),
        ib_ports=ports,
        events=events,
        labels={"rack": f"r{int(node[-4:]) // 32:03d}"},
        full=None if mode == "legacy" else mode == "full",
        base_seq=_SLOT + BASE_SEQ if mode == "delta" else None,
    )


class Template:
    """A report pre-encoded once; each send only formats the placeholders into it."""

    def __init__(self, report: Report) -> None:
        raw = encode_json(report)
        pieces = re.split(rb"\b(77\d{7})\b", raw)
        self.parts = pieces[0::2]
        self.slots = [int(x) - _SLOT for x in pieces[1::2]]
        self.gpus, self.ports = len(report.gpus), len(report.ib_ports)

    def body(self, seq: int, sent_at: float) -> bytes:
        values = _slot_values(seq, sent_at, gpus=self.gpus, ports=self.ports)
        out = [self.parts[0]]
        for k, part in zip(self.slots, self.parts[1:], strict=True):
            out.append(values[k])
            out.append(part)
        return b"".join(out)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    m = re.search(rb"(?i)content-length:\s*(\d+)", head)
    body = await reader.readexactly(int(m.group(1))) if m else b""
    return status, body


async def _agent(
    node: str,
    host: str,
    port: int,
    *,
    start: float,
    end: float,
    inject_at: float | None,
    out: dict[str, Any],
    full_only: bool,
) -> None:
    modes = ("legacy",) if full_only else ("full", "delta")
    normal = {m: Template(_report(node, dbe=False, mode=m)) for m in modes}
    sick = {m: Template(_report(node, dbe=True, mode=m)) for m in modes} if inject_at else normal
    since_full: int | None = None  # acknowledged deltas since the last full; None: need one
    reader, writer = await asyncio.open_connection(host, port)
    head = (
        f"POST /v1/reports HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {_agent_token(node)}\r\n"
        "Content-Type: application/json\r\nContent-Length: "
    ).encode()
    seq = 0
    when = start
    try:
        while when < end:
            delay = when - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                out["late"] += 1
            seq += 1
            sent_at = time.time()
            if full_only:
                mode = "legacy"
            elif since_full is None or since_full + 1 >= FULL_EVERY:
                mode = "full"
            else:
                mode = "delta"
            tpl = normal[mode]
            if inject_at is not None and sent_at >= inject_at:
                tpl = sick[mode]
                out.setdefault("dbe_sent_at", sent_at)
            body = tpl.body(seq, sent_at)
            t0 = time.perf_counter()
            writer.write(head + b"%d\r\n\r\n" % len(body) + body)
            status, answer = await _read_response(reader)
            out["lat"].append(time.perf_counter() - t0)
            if out["window"][0] <= time.time() < out["window"][1]:
                out["answered"] += 1
            out["bytes"] += len(body)
            out[mode] += 1
            if status != 200:
                out["errors"] += 1
                since_full = None
            elif b'"want_full":true' in answer:
                out["want_full"] += 1
                since_full = None
            else:
                since_full = 0 if mode == "full" else (since_full or 0) + 1
            when += 1.0
    finally:
        writer.close()


def _worker(
    nodes: list[str],
    host: str,
    port: int,
    start: float,
    end: float,
    inject_at: float,
    q: Any,
    full_only: bool,
    measure_from: float,
) -> None:
    out: dict[str, Any] = {
        "window": (measure_from, end),
        "answered": 0,
        "lat": [],
        "errors": 0,
        "late": 0,
        "bytes": 0,
        "legacy": 0,
        "full": 0,
        "delta": 0,
        "want_full": 0,
    }

    async def run() -> None:
        tasks = []
        for i, node in enumerate(nodes):
            # spread the nodes over the second, as real agents started at random times are
            offset = (i / max(1, len(nodes))) + (hash(node) % 97) / 9700.0
            tasks.append(
                _agent(
                    node,
                    host,
                    port,
                    start=start + offset,
                    end=end,
                    inject_at=inject_at if node == DBE_NODE else None,
                    out=out,
                    full_only=full_only,
                )
            )
        results = await asyncio.gather(*tasks, return_exceptions=True)
        out["failures"] = [repr(r) for r in results if isinstance(r, BaseException)][:5]

    t0 = time.process_time()
    try:  # the generator's CPU is taken from the controller's 2 cores: spend as little as we can
        import uvloop  # noqa: PLC0415

        uvloop.run(run())
    except ImportError:
        asyncio.run(run())
    out["cpu_s"] = time.process_time() - t0
    q.put(out)


def _cpu_s(pid: int, *, children: bool = True) -> float:
    """CPU seconds of the controller and (`children`) its live child processes (ingest
    workers)."""
    total = 0
    for p in [pid, *(_children(pid) if children else [])]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _hist(metrics: str, name: str) -> tuple[float, float, list[tuple[float, float]]]:
    """(sum, count, [(le, cumulative count)]) of a Prometheus histogram."""
    total = count = 0.0
    buckets = []
    for line in metrics.splitlines():
        if line.startswith(f"{name}_sum"):
            total = float(line.split()[-1])
        elif line.startswith(f"{name}_count"):
            count = float(line.split()[-1])
        elif line.startswith(f"{name}_bucket"):
            le = re.search(r'le="([^"]+)"', line)
            if le:
                buckets.append((float(le.group(1)), float(line.split()[-1])))
    return total, count, buckets


def _hist_delta(
    before: tuple[float, float, list[tuple[float, float]]],
    after: tuple[float, float, list[tuple[float, float]]],
) -> dict[str, Any]:
    s = after[0] - before[0]
    n = after[1] - before[1]
    b0 = dict(before[2])
    deltas = [(le, c - b0.get(le, 0.0)) for le, c in after[2]]

    def q(p: float) -> float | None:
        for le, c in deltas:
            if n and c >= p * n:
                return le
        return None

    return {"count": n, "mean_s": s / n if n else None, "p50_le_s": q(0.5), "p99_le_s": q(0.99)}


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


def _decode_bench(n: int = 2000) -> int:
    from trainguard.protocol import from_wire  # noqa: PLC0415
    from trainguard.wire_schemas import decoder  # noqa: PLC0415

    raw = Template(_report("node-0001", dbe=False)).body(1, time.time())
    delta = Template(_report("node-0001", dbe=False, mode="delta")).body(2, time.time())
    fast = decoder(Report)
    out: dict[str, Any] = {"report_bytes": len(raw), "delta_report_bytes": len(delta)}
    for name, fn in (
        # the same decoder on already-parsed JSON (the API decodes the bytes in one pass)
        ("json_loads_from_wire", lambda: from_wire(Report, json.loads(raw))),
        ("decode_json", lambda: fast.decode_json(raw)),
        ("decode_json_delta", lambda: fast.decode_json(delta)),
    ):
        fn()
        times = []
        for _ in range(n if name == "decode_json" else n // 10):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[f"{name}_median_ms"] = statistics.median(times) * 1e3
        out[f"{name}_p99_ms"] = _pct(times, 0.99) * 1e3
    print(json.dumps(out, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=60.0, help="measured duration")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    ap.add_argument("--procs", type=int, default=2, help="load-generator processes")
    ap.add_argument(
        "--inject-after",
        type=float,
        default=None,
        help="DBE at this many s into the measurement (default: half)",
    )
    ap.add_argument("--ingest-in-threadpool", action="store_true", help="controller option")
    ap.add_argument(
        "--ingest-workers",
        type=int,
        default=0,
        help="controller option: processes serving the port and handing reports over",
    )
    ap.add_argument(
        "--full-only",
        action="store_true",
        help="full reports in the original shape (agents without delta reports)",
    )
    ap.add_argument(
        "--store-url",
        default=None,
        help="store.url (a PostgreSQL database) instead of an SQLite file in the temp dir",
    )
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the controller's store and log")
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="only time decoding one report: from bytes, and json.loads + from_wire",
    )
    args = ap.parse_args()
    if args.decode_only:
        return _decode_bench()

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.nodes + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))

    tmp = Path(tempfile.mkdtemp(prefix="tg-scale-"))
    op_hash = hashlib.sha256(OP_TOKEN.encode()).hexdigest()
    # one token per node, bound to it, as in production: the bench pays the identity check
    agents = "".join(
        f"  - {{name: agent-{node}, role: agent, node: {node}, sha256: "
        f'"{hashlib.sha256(_agent_token(node).encode()).hexdigest()}"}}\n'
        for node in _node_names(args.nodes)
    )
    (tmp / "tokens.yaml").write_text(
        "tokens:\n" + agents + f'  - {{name: bench, role: operator, sha256: "{op_hash}"}}\n'
    )
    store = (
        f"store: {{url: '{args.store_url}'}}\n"
        if args.store_url
        else f"store: {{path: {tmp / 'controller.db'}}}\n"
    )
    (tmp / "controller.yaml").write_text(
        store + f"rules: [{ROOT / 'rules'}]\n"
        f"api: {{host: 127.0.0.1, port: 0, tokens_file: {tmp / 'tokens.yaml'}}}\n"
        "safety: {dry_run: true}\n"
        "log: {level: warning}\n"
    )
    cmd = [
        str(Path(sys.executable).parent / "trainguard-controller"),
        "--config",
        str(tmp / "controller.yaml"),
        "--log-level",
        "info",
    ]
    if args.ingest_in_threadpool:
        cmd.append("--ingest-in-threadpool")
    cmd += ["--ingest-workers", str(args.ingest_workers)]
    log_path = tmp / "controller.log"
    with log_path.open("w") as log_f:
        proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        url = None
        while url is None:
            m = re.search(r"event=api_listening url=(\S+)", log_path.read_text())
            if m:
                url = m.group(1)
            elif proc.poll() is not None or time.monotonic() > deadline:
                print(log_path.read_text(), file=sys.stderr)
                return 1
            else:
                time.sleep(0.1)
        host, port = url.split("//")[1].split(":")
        return _run(args, proc, url, host, int(port), log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        if args.keep:
            print(f"controller files kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(
    args: argparse.Namespace,
    proc: subprocess.Popen[bytes],
    url: str,
    host: str,
    port: int,
    log_path: Path,
) -> int:
    nodes = _node_names(args.nodes)
    start = time.time() + 2.0
    measure_from = start + args.warmup
    end = measure_from + args.seconds
    inject_at = measure_from + (
        args.inject_after if args.inject_after is not None else args.seconds / 2
    )
    q: Any = mp.get_context("fork").Queue()
    workers = []
    for w in range(args.procs):
        share = nodes[w :: args.procs]
        p = mp.get_context("fork").Process(
            target=_worker,
            args=(share, host, port, start, end, inject_at, q, args.full_only, measure_from),
            daemon=True,
        )
        p.start()
        workers.append(p)

    # generous: under overload the controller answers its own metrics late too
    client = httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {OP_TOKEN}"}, timeout=120
    )
    while time.time() < measure_from:
        time.sleep(0.05)
    m0 = client.get("/metrics").text
    cpu0, wall0 = _cpu_s(proc.pid), time.monotonic()
    core0 = _cpu_s(proc.pid, children=False)
    load0 = os.getloadavg()[0]
    detected_at = None
    while time.time() < end:
        if detected_at is None and time.time() >= inject_at - 0.5:
            r = client.get("/v1/incidents", params={"node": DBE_NODE, "limit": 10})
            if r.status_code == 200 and any(i["rule"] == "gpu_uncorrectable_ecc" for i in r.json()):
                detected_at = time.time()
            time.sleep(0.05)
        else:
            time.sleep(0.2)
    cpu1, wall1 = _cpu_s(proc.pid), time.monotonic()
    core1 = _cpu_s(proc.pid, children=False)
    load1 = os.getloadavg()[0]
    m1 = client.get("/metrics").text
    results = [q.get(timeout=120) for _ in workers]
    for p in workers:
        p.join(timeout=30)

    lat: list[float] = []
    errors = late = 0
    sent = {k: sum(r[k] for r in results) for k in ("legacy", "full", "delta", "want_full")}
    body_bytes = sum(r["bytes"] for r in results)
    dbe_sent_at = None
    failures: list[str] = []
    loadgen_cpu_s = sum(r["cpu_s"] for r in results)
    for r in results:
        lat.extend(r["lat"])
        errors += r["errors"]
        late += r["late"]
        failures += r.get("failures", [])
        dbe_sent_at = r.get("dbe_sent_at", dbe_sent_at)
    # latencies of the measured window only: drop the warm-up share (sends are uniform in time)
    total_s = end - start
    keep = int(len(lat) * args.seconds / total_s)
    measured = lat[-keep:] if keep else lat
    count0 = float(re.search(r"^trainguard_controller_reports_total (\S+)", m0, re.M).group(1))  # type: ignore[union-attr]
    count1 = float(re.search(r"^trainguard_controller_reports_total (\S+)", m1, re.M).group(1))  # type: ignore[union-attr]
    out = {
        "nodes": args.nodes,
        "store": "postgresql" if args.store_url else "sqlite",
        "seconds": args.seconds,
        "procs": args.procs,
        "ingest_in_threadpool": args.ingest_in_threadpool,
        "ingest_workers": args.ingest_workers,
        # 1-minute load average at the start and the end of the window (this run included)
        "load_average": [round(load0, 2), round(load1, 2)],
        "full_only": args.full_only,
        "reports_sent": sent,
        "mean_body_bytes": body_bytes / max(1, sent["legacy"] + sent["full"] + sent["delta"]),
        "cores": os.cpu_count(),
        # reports answered within the measured window, counted by the clients
        "report_rate_per_s": sum(r["answered"] for r in results) / args.seconds,
        "server_rate_per_s": (count1 - count0) / (wall1 - wall0),
        # rate and CPU are taken between two /metrics scrapes, which answer late under overload
        "metrics_window_s": wall1 - wall0,
        "controller_cpu_ms_per_report": (cpu1 - cpu0) * 1e3 / max(1.0, count1 - count0),
        "target_rate_per_s": float(args.nodes),
        "client_latency_p50_ms": _pct(measured, 0.50) * 1e3,
        "client_latency_p99_ms": _pct(measured, 0.99) * 1e3,
        "client_latency_max_ms": max(measured) * 1e3 if measured else None,
        "client_latency_mean_ms": statistics.fmean(measured) * 1e3 if measured else None,
        "errors": errors,
        "late_sends": late,
        "failures": failures,
        "controller_cpu_cores": (cpu1 - cpu0) / (wall1 - wall0),
        # the controller process alone (without its ingest workers)
        "core_cpu_cores": (core1 - core0) / (wall1 - wall0),
        "core_cpu_ms_per_report": (core1 - core0) * 1e3 / max(1.0, count1 - count0),
        "loadgen_cpu_cores": loadgen_cpu_s / (end - start),
        "ingest_server": _hist_delta(
            _hist(m0, "trainguard_controller_report_ingest_seconds"),
            _hist(m1, "trainguard_controller_report_ingest_seconds"),
        ),
        "rule_eval": _hist_delta(
            _hist(m0, "trainguard_controller_rule_eval_seconds"),
            _hist(m1, "trainguard_controller_rule_eval_seconds"),
        ),
        "tick": _hist_delta(
            _hist(m0, "trainguard_controller_tick_seconds"),
            _hist(m1, "trainguard_controller_tick_seconds"),
        ),
        "dbe_detect_s": (detected_at - dbe_sent_at) if (detected_at and dbe_sent_at) else None,
    }
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
