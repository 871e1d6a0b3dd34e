"""The node commands: drain, undrain, spares, role, and inject (a simulated fault)."""

from __future__ import annotations

import argparse
from typing import IO, Any

from trainguard.bounds import bad_drain_reason
from trainguard.controller.cli.client import Api, quote_name
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.format import print_result
from trainguard.controller.cli.values import parse_duration

__all__ = [
    "INJECT_KINDS",
    "add_inject_command",
    "add_node_commands",
    "drain",
    "inject",
    "role",
    "spares",
    "undrain",
]

INJECT_KINDS = (
    "ecc_storm",
    "dbe",
    "remap_pending",
    "remap_failure",
    "xid",
    "gpu_lost",
    "nvlink_down",
    "ib_flap",
    "ib_down",
    "thermal",
    "slowdown",
    "clear",
)


def add_node_commands(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """drain, undrain, spares and role: a node's place in the cluster."""
    drain = add_command(
        sub,
        "drain",
        "Drain a node: no new work lands on it (idempotent).",
        "agentctl drain node-12",
        "agentctl drain node-12 --reason 'xid 79 on gpu 3'",
        parents=parents,
        aliases=["cordon"],
    )
    drain.add_argument("node")
    drain.add_argument(
        "--reason", help="recorded with the drain (default: 'drained by NAME (ROLE) via agentctl')"
    )

    undrain = add_command(
        sub,
        "undrain",
        "Put a drained node back into service.",
        "agentctl undrain node-12\n  agentctl undrain --force node-12   # another's drain",
        parents=parents,
        aliases=["uncordon"],
    )
    undrain.add_argument("node")
    undrain.add_argument(
        "--force",
        action="store_true",
        help="also undo a drain trainguard did not make (an admin's or a health check's)",
    )

    add_command(sub, "spares", "List the hot spares.", "agentctl spares -o wide", parents=parents)

    role = add_command(
        sub,
        "role",
        "Mark a node active or hot spare.",
        "agentctl role node-31 spare",
        parents=parents,
    )
    role.add_argument("node")
    role.add_argument("role", choices=["active", "spare"])


def add_inject_command(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """inject: a simulated fault."""
    inj = add_command(
        sub,
        "inject",
        "Queue a simulated fault on a node (sim agents only).",
        "agentctl inject node-3 xid --gpu 2 --code 79",
        parents=parents,
    )
    inj.add_argument("node")
    inj.add_argument("kind", choices=INJECT_KINDS)
    inj.add_argument("--gpu", type=int)
    inj.add_argument("--link", type=int)
    inj.add_argument("--device")
    inj.add_argument("--port", type=int)
    inj.add_argument("--code", type=int)
    inj.add_argument("--rate", type=float, dest="rate_per_s")
    inj.add_argument(
        "--for", dest="duration", help="fault duration, e.g. 30s (default: until cleared)"
    )


def drain(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    # no reason: the controller records who drained it and that agentctl did
    why = bad_drain_reason(args.reason) if args.reason is not None else None
    if why is not None:
        raise CliError(f"error: --reason: {why}", EXIT["usage"])
    body = {"reason": args.reason} if args.reason is not None else {}
    data = api.request("POST", f"/v1/nodes/{quote_name(args.node)}/drain", json=body)
    print_result(out, args, "node", data)


def undrain(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    body = {"force": True} if args.force else {}
    data = api.request("POST", f"/v1/nodes/{quote_name(args.node)}/undrain", json=body)
    print_result(out, args, "node", data)


def spares(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    print_result(out, args, "spares", api.request("GET", "/v1/spares"))


def role(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    data = api.request("PUT", f"/v1/nodes/{quote_name(args.node)}/role", json={"role": args.role})
    print_result(out, args, "node", data)


def inject(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    spec: dict[str, Any] = {"kind": args.kind}
    for key in ("gpu", "link", "device", "port", "code", "rate_per_s"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if args.duration is not None:
        try:
            spec["duration_s"] = parse_duration(args.duration)
        except ValueError as e:
            raise CliError(f"error: --for: {e}", EXIT["usage"]) from None
    data = api.request("POST", f"/v1/nodes/{quote_name(args.node)}/faults", json=spec)
    if args.output in ("json", "yaml"):
        print_result(out, args, "fault", data)
    else:
        out.write(f"fault {args.kind} queued for {args.node}: command {data['command_id']}\n")
