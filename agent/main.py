"""`trainguard-agent`: run the node agent, or `inject` a fault into a running sim agent.

    trainguard-agent [--config FILE] [--gpu-backend sim --gpus 8 --ib-ports 8] [...]
    trainguard-agent inject [--metrics-port 9500] KIND [--gpu N] [...]
    trainguard-agent install-unit [--prefix VENV] [--dest /etc/systemd/system] [--dry-run]

Exit codes: 0 clean stop, 1 runtime/startup failure, 2 usage or configuration error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

import httpx

from trainguard import __version__
from trainguard.agent.config import load_config
from trainguard.agent.daemon import Agent, StartupError
from trainguard.bounds import bad_name_reason
from trainguard.faultflags import add_fault_arguments, fault_body
from trainguard.leader import split_urls
from trainguard.strict import ConfigError
from trainguard.unitfile import install_unit_main

PROG = "trainguard-agent"
_FLAG_TO_KEY = {
    "node_name": "node.name",
    "gpu_backend": "hardware.gpu_backend",
    "gpus": "hardware.sim_gpus",
    "ib_ports": "hardware.sim_ib_ports",
    "sim_seed": "hardware.sim_seed",
    "collect_interval_s": "hardware.collect_interval_s",
    "ib_sysfs_root": "hardware.ib_sysfs_root",
    "kmsg_path": "hardware.kmsg_path",
    "heartbeat_socket": "heartbeat.socket_path",
    "jobs_dir": "jobs.work_dir",
    "advertise_address": "node.advertise_address",
    "preemption": "preemption.provider",
    "preemption_url": "preemption.base_url",
    "metrics_address": "metrics.address",
    "metrics_port": "metrics.port",
    "controller": "controller.url",
    "token_file": "controller.token_file",
    "report_interval_s": "controller.report_interval_s",
    "log_level": "log.level",
}


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="trainguard node agent: GPU/NVLink/IB health and trainer heartbeats "
        "to Prometheus and the controller. Flags override the config file.",
        epilog=f"Subcommands: '{PROG} inject --help' injects a fault into a running sim agent; "
        f"'{PROG} install-unit --help' writes the systemd unit for this installation.",
    )
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    p.add_argument("--config", help="YAML config (default /etc/trainguard/agent.yaml if present)")
    p.add_argument("--check-config", action="store_true", help="validate, print, exit")
    p.add_argument("--node-name", help="node identity (default: host name)")
    p.add_argument("--gpu-backend", choices=["nvml", "sim"])
    p.add_argument("--gpus", type=int, help="sim backend: number of GPUs")
    p.add_argument("--ib-ports", type=int, help="sim backend: number of IB ports")
    p.add_argument("--sim-seed", type=int, help="sim backend: random seed")
    p.add_argument("--collect-interval-s", type=float)
    p.add_argument("--ib-sysfs-root", help="InfiniBand sysfs root")
    p.add_argument("--kmsg-path", help="kernel log for XIDs ('' disables)")
    p.add_argument("--heartbeat-socket", help="unix datagram socket for trainer heartbeats")
    p.add_argument("--jobs-dir", help="where job logs are written (jobs.work_dir)")
    p.add_argument("--advertise-address", help="address other nodes reach this one at")
    p.add_argument("--preemption", choices=["none", "aws", "gcp"], help="preemption notices")
    p.add_argument("--preemption-url", help="metadata service base URL (tests, proxies)")
    p.add_argument("--metrics-address")
    p.add_argument("--metrics-port", type=int, help="/metrics port (0 = pick a free one)")
    p.add_argument(
        "--controller",
        help="controller base URL, or several comma-separated (HA: the agent follows the "
        "leader among them); omit for export-only",
    )
    p.add_argument("--token-file", help="file holding the controller bearer token")
    p.add_argument("--report-interval-s", type=float)
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def _inject_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{PROG} inject",
        description="Inject a fault into a running agent with the sim backend "
        "(POST http://127.0.0.1:PORT/v1/faults).",
    )
    # KIND and its options: the same flags as `agentctl inject`
    add_fault_arguments(p)
    p.add_argument("--metrics-port", type=int, default=9500, help="the agent's /metrics port")
    p.add_argument("--timeout-s", type=float, default=5.0)
    p.add_argument(
        "-o", "--output", choices=["text", "json"], default="text",
        help="text: one line saying what was injected (default); json: the agent's answer",
    )  # fmt: skip
    return p


def _fault_line(kind: str, body: dict[str, Any], answer: dict[str, Any]) -> str:
    """`inject`'s human line: the fault, where, and the event it made (if any)."""
    where = " ".join(
        f"{name}={body[name]}"
        for name in ("gpu", "link", "device", "port", "code", "rate_per_s", "duration_s")
        if name in body
    )
    event = answer.get("event_id")
    return " ".join(
        part
        for part in (
            f"fault {kind} injected",
            where,
            f"(event {event})" if event is not None else "",
        )
        if part
    )


def _setup_logging(level: str, node: str) -> None:
    safe_node = node.replace("%", "%%")
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"ts=%(asctime)s level=%(levelname)s node={safe_node} logger=%(name)s %(message)s",
        force=True,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per report otherwise
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def _inject(argv: Sequence[str]) -> int:
    args = _inject_parser().parse_args(argv)
    body = fault_body(args)
    url = f"http://127.0.0.1:{args.metrics_port}/v1/faults"
    try:
        resp = httpx.post(url, json=body, timeout=args.timeout_s)
    except httpx.HTTPError as e:
        print(f"{PROG}: inject: cannot reach the agent at {url}: {e}", file=sys.stderr)
        return 1
    try:
        detail = resp.json()
    except ValueError:
        detail = {"detail": resp.text.strip()}
    if resp.status_code != 200:
        print(
            f"{PROG}: inject: agent refused ({resp.status_code}): {detail.get('detail', detail)}",
            file=sys.stderr,
        )
        return 1
    if args.output == "json":
        print(json.dumps(detail))
    else:
        print(_fault_line(args.kind, body, detail))
    return 0


def _run(argv: Sequence[str]) -> int:
    args = _run_parser().parse_args(argv)
    overrides = {key: getattr(args, flag) for flag, key in _FLAG_TO_KEY.items()}
    if args.controller is not None:
        # the flag replaces the file's controller.url or controller.urls, whichever it holds
        urls = split_urls(args.controller) if "," in args.controller else []
        overrides["controller.url"] = "" if urls else args.controller
        overrides["controller.urls"] = urls
    try:
        config, source = load_config(args.config, overrides=overrides)
    except ConfigError as e:
        print(f"{PROG}: config error: {e}", file=sys.stderr)
        return 2
    if args.check_config:
        print(json.dumps({"source": source, "config": dataclasses.asdict(config)}, indent=2))
        return 0

    node = config.node.resolved_name()
    reason = bad_name_reason(node)
    if reason is not None:  # a host name the controller would refuse in every report
        print(
            f"{PROG}: config error: node.name (default: the host name) {reason}; "
            "set node.name or --node-name",
            file=sys.stderr,
        )
        return 2
    _setup_logging(config.log.level, node)
    log = logging.getLogger("trainguard.agent")

    try:
        agent = Agent(config)
    except StartupError as e:
        log.error("event=startup_failed error=%r", str(e))
        return 1
    try:
        agent.start()
    except StartupError as e:
        log.error("event=startup_failed error=%r", str(e))
        agent.close()
        return 1

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        agent.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.run()
    finally:
        agent.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "inject":
        return _inject(argv[1:])
    if argv and argv[0] == "install-unit":
        return install_unit_main(argv[1:], prog=PROG)
    if argv and argv[0] == "run":
        argv = argv[1:]
    return _run(argv)


if __name__ == "__main__":
    sys.exit(main())
