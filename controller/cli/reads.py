"""get and describe: what the controller knows, listed or one object in full."""

from __future__ import annotations

import argparse
from typing import IO, Any

from trainguard.controller.cli.client import LIST_MOST, Api, quote_name
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.format import print_result

__all__ = ["KIND_OF", "RESOURCES", "RESOURCE_OF", "add_read_commands", "describe", "get"]

_PAGED = ("jobs", "incidents", "audit")

# kubectl-style names: each listable resource by its plural, singular and short name
RESOURCES: dict[str, tuple[str, ...]] = {
    "nodes": ("node", "no"),
    "incidents": ("incident", "inc"),
    "jobs": ("job",),
    "silences": ("silence",),
    "audit": (),
}
RESOURCE_OF = {a: name for name, aliases in RESOURCES.items() for a in (name, *aliases)}
# `describe` takes the singular; any name of nodes, incidents and jobs is accepted
KIND_OF = {
    a: name[:-1] for a, name in RESOURCE_OF.items() if name in ("nodes", "incidents", "jobs")
}


def add_read_commands(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """get and describe: what the controller knows."""
    get = add_command(
        sub,
        "get",
        "List nodes, incidents, jobs, silences or audit entries.",
        "agentctl get nodes -o wide",
        "agentctl get inc --state open --node node-12 --limit 20",
        parents=parents,
    )
    get.add_argument("resource", choices=list(RESOURCE_OF), metavar="{" + ",".join(RESOURCES) + "}")
    get.add_argument("--state", help="incidents: only this state")
    get.add_argument("--node", help="incidents: only this node")
    get.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"jobs/incidents/audit: at most N (default: all, up to {LIST_MOST:,})",
    )
    get.add_argument("--all", action="store_true", help="silences: include expired")

    desc = add_command(
        sub,
        "describe",
        "Show one node, incident or job in full.",
        "agentctl describe incident 42",
        parents=parents,
    )
    desc.add_argument("kind", choices=list(KIND_OF), metavar="{node,incident,job}")
    desc.add_argument("name")


def get(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    resource = RESOURCE_OF[args.resource]
    params: dict[str, Any] = {}
    if resource == "incidents":
        params = {"state": args.state, "node": args.node}
    elif resource == "silences" and args.all:
        params = {"include_expired": "true"}
    params = {k: v for k, v in params.items() if v is not None}
    if resource not in _PAGED:
        print_result(out, args, resource, api.request("GET", f"/v1/{resource}", params=params))
        return
    if args.limit is not None and args.limit < 1:
        raise CliError(f"error: --limit must be at least 1, got {args.limit}", EXIT["usage"])
    most = LIST_MOST if args.limit is None else args.limit
    data, more = api.list_all(f"/v1/{resource}", params, most=most)
    print_result(out, args, resource, data)
    if more and args.limit is None:
        err.write(f"note: showing the first {most:,} {resource}; --limit N for more\n")


def describe(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    kind = KIND_OF[args.kind]
    if kind == "incident":
        if not args.name.isdigit():
            raise CliError(f"error: incident id must be a number, got {args.name!r}", EXIT["usage"])
        data = api.request("GET", f"/v1/incidents/{args.name}")
    else:
        data = api.request("GET", f"/v1/{kind}s/{quote_name(args.name)}")
    print_result(out, args, kind, data)
