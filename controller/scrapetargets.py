"""Prometheus `file_sd` target files: the agents of a hostlist (or of the controller's node
list) and the controller, as JSON that Prometheus' file-based discovery reads
(`trainguard-controller targets`, docs/deploy.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from trainguard.controller.hostlist import HostlistError, expand_hostlist

__all__ = ["file_sd", "main", "write_atomic"]

PROG = "trainguard-controller targets"
EXIT_OK = 0
EXIT_USAGE = 2


def file_sd(*, hosts: Sequence[str], port: int, labels: dict[str, str]) -> list[dict[str, object]]:
    """One file_sd target group: each host at `port`, with `labels` (sorted, for stable diffs)."""
    group: dict[str, object] = {"targets": [f"{h}:{port}" for h in hosts]}
    if labels:
        group["labels"] = dict(sorted(labels.items()))
    return [group]


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: Prometheus watches the
    file and must never read half of it."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), 0o644)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Write a Prometheus file_sd target file (JSON) for the agents of HOSTS "
        "(a Slurm hostlist, node-[01-64]) or for the controller.",
        epilog="e.g. trainguard-controller targets 'node-[01-64]' --port 9500 "
        "--out /etc/prometheus/targets/agents-all.json",
    )
    p.add_argument("hosts", metavar="HOSTS", help="host names or addresses, a Slurm hostlist")
    p.add_argument(
        "--port", type=int, required=True, help="the port to scrape (agents: metrics.port 9500)"
    )
    p.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label on every target (repeatable), e.g. rack=r01",
    )
    p.add_argument("--out", default=None, help="write here, atomically (default stdout)")
    return p


def main(argv: Sequence[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    try:
        hosts = expand_hostlist(args.hosts)
    except HostlistError as e:
        p.error(f"HOSTS {e}")
    if not hosts:
        p.error("HOSTS names no host")
    if not 0 < args.port < 65536:
        p.error(f"--port {args.port}: not a port (1-65535)")
    labels: dict[str, str] = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            p.error(f"--label {item!r}: use KEY=VALUE (a label name, then a value)")
        labels[key] = value
    text = json.dumps(file_sd(hosts=hosts, port=args.port, labels=labels), indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
        return EXIT_OK
    try:
        write_atomic(Path(args.out), text)
    except OSError as e:
        print(f"{PROG}: cannot write {args.out}: {e.strerror or e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{len(hosts)} targets in {args.out}", file=sys.stderr)
    return EXIT_OK
