"""node return|retire: a node's way back into service after a repair, or out for good."""

from __future__ import annotations

import argparse
from typing import Any

from trainguard.bounds import bad_drain_reason
from trainguard.controller.cli.client import quote_name
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.session import Session
from trainguard.durations import parse_duration

__all__ = ["add_lifecycle_commands", "node_retire", "node_return"]

POLL_S = 1.0


def add_lifecycle_commands(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """node return|retire."""
    node = add_command(
        sub,
        "node",
        "Return a repaired node to service, or retire it (node return|retire).",
        "agentctl node return node-12",
    )
    nsub = node.add_subparsers(dest="node_command", required=True, metavar="SUBCOMMAND")
    ret = add_command(
        nsub,
        "return",
        "Validate a drained or retired node (a preflight) and bring it back into service on a"
        " pass; prints the result (exit 1 when it fails).",
        "agentctl node return node-12",
        "agentctl node return node-12 --wait 20m",
        parents=parents,
    )
    ret.add_argument("node")
    ret.add_argument(
        "--wait",
        default="15m",
        help="how long to wait for the preflight's result, e.g. 90s, 20m (default: 15m)",
    )
    retire = add_command(
        nsub,
        "retire",
        "Take a node out of service for good (an RMA), with the reason.",
        "agentctl node retire node-12 --reason 'RMA 4411: GPU 3 row remap failures'",
        parents=parents,
    )
    retire.add_argument("node")
    retire.add_argument("--reason", required=True, help="why it leaves (recorded and shown)")


def node_return(s: Session, args: argparse.Namespace) -> None:
    """POST the return, then read the node until its validation ends; print the result."""
    try:
        wait_s = parse_duration(args.wait)
    except ValueError as e:
        raise CliError(f"error: --wait: {e}", EXIT["usage"]) from None
    path = f"/v1/nodes/{quote_name(args.node)}"
    data = s.api.request("POST", f"{path}/return")
    deadline = s.clock.monotonic() + wait_s
    while data.get("state") == "validating" and s.clock.monotonic() < deadline:
        s.clock.sleep(POLL_S)
        data = s.api.request("GET", path)
    if args.output != "table":
        s.show(args, "node", data)
    state = data.get("state")
    preflight = data.get("last_preflight") or {}
    summary = preflight.get("summary") or data.get("drain_reason") or ""
    if state == "validating":
        raise CliError(f"error: node {args.node} still validating after {args.wait}", EXIT["error"])
    if state != "active":
        raise CliError(
            f"error: node {args.node} stays {state}: {data.get('drain_reason') or summary}",
            EXIT["error"],
        )
    if args.output == "table":
        s.out.write(f"node {args.node} returned ({data.get('role')}): preflight {summary}\n")


def node_retire(s: Session, args: argparse.Namespace) -> None:
    why = bad_drain_reason(args.reason)
    if why is not None or not args.reason.strip():
        raise CliError(f"error: --reason: {why or 'must say why'}", EXIT["usage"])
    data = s.api.request(
        "POST", f"/v1/nodes/{quote_name(args.node)}/retire", json={"reason": args.reason}
    )
    s.show(args, "node", data)
