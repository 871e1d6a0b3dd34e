"""get and describe: what the controller knows, listed or one object in full."""

from __future__ import annotations

import argparse
import json
from typing import Any, get_args

from trainguard.controller.cli.client import LIST_MOST, quote_name
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.session import Session
from trainguard.controller.cli.values import positive_int, selected, selector
from trainguard.controller.jobstate import JobState
from trainguard.controller.views import IncidentState, NodeState

__all__ = [
    "FILTERS",
    "KIND_OF",
    "RESOURCES",
    "RESOURCE_OF",
    "STATES",
    "WATCH_INTERVAL_S",
    "add_read_commands",
    "describe",
    "get",
]

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


# the filters each listable resource takes; any other is a usage error, never ignored.
# "state" and "node" of incidents go to the API; the others are applied here
FILTERS: dict[str, frozenset[str]] = {
    "nodes": frozenset({"state", "selector"}),
    "incidents": frozenset({"state", "node", "limit"}),
    "jobs": frozenset({"state", "node", "limit"}),
    "silences": frozenset({"node", "all"}),
    "audit": frozenset({"limit"}),
}
_FLAG_OF = {
    "state": "--state",
    "node": "--node",
    "selector": "-l",
    "limit": "--limit",
    "all": "--all",
}
# the states `--state` may name, per resource (each from its one table)
STATES: dict[str, tuple[str, ...]] = {
    "nodes": get_args(NodeState),
    "incidents": get_args(IncidentState),
    "jobs": tuple(s.value for s in JobState),
}
# `get RESOURCE NAME`: where one object is read, and how a name must look
_ONE_PATH = {"nodes": "/v1/nodes/{}", "jobs": "/v1/jobs/{}", "incidents": "/v1/incidents/{}"}
# `--watch`: how often the result is read again; hidden `--watch-limit N` ends after N reads
WATCH_INTERVAL_S = 2.0
# what changes with the clock alone (an age, a ratio over time): no reason to print again
WATCH_IGNORES = frozenset({"report_age_s", "last_report_at", "ckpt_age_s", "ettr"})


def add_read_commands(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """get and describe: what the controller knows."""
    get = add_command(
        sub,
        "get",
        "List nodes, incidents, jobs, silences or audit entries, or get one by name.",
        "agentctl get nodes -o wide",
        "agentctl get nodes node-12",
        "agentctl get nodes -l rack=r3,gpu=h100 -o name",
        "agentctl get inc --state open --node node-12 --limit 20",
        "agentctl get jobs llama -o jsonpath='{.state}' --watch",
        parents=parents,
    )
    get.add_argument("resource", choices=list(RESOURCE_OF), metavar="{" + ",".join(RESOURCES) + "}")
    get.add_argument("name", nargs="?", help="nodes, jobs: a name; incidents: an id")
    get.add_argument("--state", help="nodes, incidents, jobs: only this state")
    get.add_argument("--node", help="incidents, jobs, silences: only those of this node")
    get.add_argument(
        "-l",
        "--selector",
        type=selector,
        help="nodes: only those whose labels match, key=value[,key2!=value2]",
    )
    get.add_argument(
        "--limit",
        type=positive_int,
        default=None,
        help=f"jobs/incidents/audit: at most N (default: all, up to {LIST_MOST:,})",
    )
    get.add_argument("--all", action="store_true", help="silences: include expired")
    get.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help=f"print again each time the result changes (read every {WATCH_INTERVAL_S:g} s; "
        "Ctrl-C ends)",
    )
    # for tests and scripts: end a watch after N reads
    get.add_argument("--watch-limit", type=positive_int, default=None, help=argparse.SUPPRESS)

    desc = add_command(
        sub,
        "describe",
        "Show one node, incident or job in full.",
        "agentctl describe incident 42",
        parents=parents,
    )
    desc.add_argument("kind", choices=list(KIND_OF), metavar="{node,incident,job}")
    desc.add_argument("name")


def _given_filters(args: argparse.Namespace) -> list[str]:
    given = {
        "state": args.state is not None,
        "node": args.node is not None,
        "selector": args.selector is not None,
        "limit": args.limit is not None,
        "all": args.all,
    }
    return [f for f, on in given.items() if on]


def _check_filters(resource: str, args: argparse.Namespace) -> None:
    """Refuse a filter the resource does not take (or any filter with a NAME)."""
    given = _given_filters(args)
    if args.name is not None:
        if resource not in _ONE_PATH:
            raise CliError(
                f"error: get {resource} takes no NAME (one by name: nodes, jobs, incidents)",
                EXIT["usage"],
            )
        if given:
            raise CliError(
                f"error: {_FLAG_OF[given[0]]} filters a list; it does not apply with a NAME",
                EXIT["usage"],
            )
        if resource == "incidents" and not args.name.isdigit():
            raise CliError(f"error: incident id must be a number, got {args.name!r}", EXIT["usage"])
        return
    for f in given:
        if f not in FILTERS[resource]:
            takes = ", ".join(_FLAG_OF[x] for x in sorted(FILTERS[resource])) or "none"
            raise CliError(
                f"error: {_FLAG_OF[f]} does not apply to {resource} (its filters: {takes})",
                EXIT["usage"],
            )
    states = STATES.get(resource)
    if args.state is not None and states is not None and args.state not in states:
        raise CliError(
            f"error: --state: {resource} have no state {args.state!r} (one of {', '.join(states)})",
            EXIT["usage"],
        )


def _read(s: Session, resource: str, args: argparse.Namespace) -> tuple[str, Any]:
    """What `get` shows: (kind, data) -- the resource's plural and a list; for a NAME the
    object itself (a table shows it as a list of one: a row)."""
    if args.name is not None:
        data = s.api.request("GET", _ONE_PATH[resource].format(quote_name(args.name)))
        if resource == "incidents":
            data = data["incident"]  # the row of it; `describe incident` shows the rest
        if args.output in ("table", "wide"):
            return resource, [data]
        return resource[:-1], data
    params: dict[str, Any] = {}
    if resource == "incidents":
        params = {"state": args.state, "node": args.node}
    elif resource == "silences" and args.all:
        params = {"include_expired": "true"}
    params = {k: v for k, v in params.items() if v is not None}
    if resource not in _PAGED:
        items = s.api.request("GET", f"/v1/{resource}", params=params)
    else:
        most = LIST_MOST if args.limit is None else args.limit
        items, more = s.api.list_all(f"/v1/{resource}", params, most=most)
        if more and args.limit is None:
            s.err.write(f"note: showing the first {most:,} {resource}; --limit N for more\n")
    return resource, _filtered(resource, items, args)


def _filtered(resource: str, items: list[Any], args: argparse.Namespace) -> list[Any]:
    """The filters applied here (the API's are applied already)."""
    if resource == "incidents":
        return items
    if args.state is not None:
        items = [i for i in items if i.get("state") == args.state]
    if args.node is not None:
        if resource == "jobs":
            items = [i for i in items if args.node in (i.get("nodes") or ())]
        else:
            items = [i for i in items if i.get("node") == args.node]
    if args.selector is not None:
        items = [i for i in items if selected(i.get("labels") or {}, args.selector)]
    return items


def get(s: Session, args: argparse.Namespace) -> None:
    resource = RESOURCE_OF[args.resource]
    _check_filters(resource, args)
    if not args.watch:
        s.show(args, *_read(s, resource, args))
        return
    _watch(s, resource, args)


def _watch(s: Session, resource: str, args: argparse.Namespace) -> None:
    """Read again every WATCH_INTERVAL_S; print the result when it changed since the last
    printed (fields that move with the clock alone, WATCH_IGNORES, are no change). Ends on
    Ctrl-C (main: exit 130) or after --watch-limit reads."""
    last: str | None = None
    reads = 0
    while True:
        kind, data = _read(s, resource, args)
        seen = json.dumps(_without_clock(data), sort_keys=True)
        if seen != last:
            s.show(args, kind, data)
            s.out.flush()
            last = seen
        reads += 1
        if args.watch_limit is not None and reads >= args.watch_limit:
            return
        s.clock.sleep(WATCH_INTERVAL_S)


def _without_clock(data: Any) -> Any:
    if isinstance(data, list):
        return [_without_clock(x) for x in data]
    if isinstance(data, dict):
        return {k: _without_clock(v) for k, v in data.items() if k not in WATCH_IGNORES}
    return data


def describe(s: Session, args: argparse.Namespace) -> None:
    kind = KIND_OF[args.kind]
    if kind == "incident":
        if not args.name.isdigit():
            raise CliError(f"error: incident id must be a number, got {args.name!r}", EXIT["usage"])
        data = s.api.request("GET", f"/v1/incidents/{args.name}")
    else:
        data = s.api.request("GET", f"/v1/{kind}s/{quote_name(args.name)}")
    s.show(args, kind, data)
