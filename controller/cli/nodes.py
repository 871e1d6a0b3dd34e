"""The node commands: drain, undrain, spares, role, and inject (a simulated fault)."""

from __future__ import annotations

import argparse
from typing import Any

from trainguard.bounds import bad_drain_reason
from trainguard.controller.cli.client import quote_name
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.session import Session
from trainguard.controller.cli.wait import (
    DrainTracker,
    add_wait_argument,
    progress_stream,
    wait_for,
    wait_timeout_s,
)
from trainguard.controller.jobstate import JobState
from trainguard.faultflags import add_fault_arguments, fault_body

__all__ = [
    "add_inject_command",
    "add_node_commands",
    "drain",
    "inject",
    "role",
    "spares",
    "undrain",
]


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
    add_wait_argument(drain, "until the node is drained")

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
        "agentctl inject node-3 thermal --gpu 6 --for 60s",
        parents=parents,
    )
    inj.add_argument("node")
    add_fault_arguments(inj)


def drain(s: Session, args: argparse.Namespace) -> None:
    # no reason: the controller records who drained it and that agentctl did
    why = bad_drain_reason(args.reason) if args.reason is not None else None
    if why is not None:
        raise CliError(f"error: --reason: {why}", EXIT["usage"])
    before = s.api.request("GET", f"/v1/nodes/{quote_name(args.node)}") if args.wait else None
    body = {"reason": args.reason} if args.reason is not None else {}
    data = s.api.request("POST", f"/v1/nodes/{quote_name(args.node)}/drain", json=body)
    s.show(args, "node", data)
    if before is None:
        return
    stream = progress_stream(s, args)
    wait_for(s, [DrainTracker(args.node)], timeout_s=wait_timeout_s(args), out=stream)
    job = before.get("job")
    view = s.api.request("GET", f"/v1/jobs/{quote_name(job)}") if job else None
    state = JobState.parse(str(view["state"])) if view is not None else None
    if job and state is not None and state.active:
        # an operator's drain stops the job's processes on the node and remediates nothing
        # itself (the job's rules may, on what follows): say how it leaves the node now
        stream.write(
            f"job/{job} ran on node/{args.node}: `agentctl restart {job} --wait` moves it to a "
            "spare\n"
        )


def undrain(s: Session, args: argparse.Namespace) -> None:
    body = {"force": True} if args.force else {}
    data = s.api.request("POST", f"/v1/nodes/{quote_name(args.node)}/undrain", json=body)
    s.show(args, "node", data)


def spares(s: Session, args: argparse.Namespace) -> None:
    s.show(args, "spares", s.api.request("GET", "/v1/spares"))


def role(s: Session, args: argparse.Namespace) -> None:
    data = s.api.request("PUT", f"/v1/nodes/{quote_name(args.node)}/role", json={"role": args.role})
    s.show(args, "node", data)


def inject(s: Session, args: argparse.Namespace) -> None:
    spec = fault_body(args)
    data = s.api.request("POST", f"/v1/nodes/{quote_name(args.node)}/faults", json=spec)
    if args.output in ("table", "wide"):
        s.out.write(f"fault {args.kind} queued for {args.node}: command {data['command_id']}\n")
    else:
        s.show(args, "fault", data)
