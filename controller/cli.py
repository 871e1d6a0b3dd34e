"""agentctl: the operator's command line. It talks only to the controller's REST API.

URL, token and CA file come from flags (`--url`, `--token-file`, `--ca-file`), then the
environment (`TRAINGUARD_URL`, `TRAINGUARD_TOKEN`, `TRAINGUARD_CA_FILE`), then
`~/.config/trainguard/agentctl.yaml` (`url` or `urls`, `token_file`, `ca_file`; strict). `rules
check|export`, `token hash|issue` and `completion` work offline; rules default to the
shipped ones. Reads print as `-o table|wide|json|yaml`.
Several controllers (an HA leader and standbys): the URL may be a comma-separated list; a
request goes to the first that answers, and a standby's 503 naming the leader is retried
once at the leader when it is one of the listed URLs (trainguard.leader).
Exit codes: 0 ok, 1 error or request failed, 2 usage, 3 not found, 4 unauthorized or
forbidden, 5 cannot connect.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import ssl
import stat
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import httpx
import yaml

from trainguard import __version__
from trainguard.bounds import bad_drain_reason
from trainguard.clock import SYSTEM_CLOCK
from trainguard.controller.auth import hash_token
from trainguard.controller.completion import SHELLS, completion_script
from trainguard.controller.tokenissue import (
    TokenIssueError,
    append_line,
    new_token,
    tokens_line,
    write_new,
)
from trainguard.leader import LEADER_HEADER, follow, leader_named, split_urls, url_list_problem
from trainguard.rules import shipped_dir
from trainguard.strict import ConfigError, Invalid, build, load_yaml
from trainguard.xid_catalog import XidCatalog

__all__ = ["EXIT", "AgentctlConfig", "format_age", "main", "parse_duration"]

EXIT = {"ok": 0, "error": 1, "usage": 2, "not_found": 3, "auth": 4, "connect": 5}
DEFAULT_URL = "http://127.0.0.1:8800"
FORMATS = ("table", "wide", "json", "yaml")
# the header the API reads to name the client in a drain reason it fills in
# (controller/api/nodes.py; agentctl does not import the API, which needs the controller extra)
CLIENT_HEADER = "X-Trainguard-Client"
# on a full page of a list, where the next starts (controller/api/routing.py)
CONTINUE_HEADER = "X-Trainguard-Continue"
# `get jobs|incidents|audit` follows pages up to this many items (--limit: fewer)
LIST_MOST = 10_000
_PAGE_SIZE = 1000
_PAGED = ("jobs", "incidents", "audit")


@dataclass(frozen=True)
class AgentctlConfig:
    # the controller's base URL, or several comma-separated
    url: str | None = None
    # several controllers as a list, instead of `url`
    urls: list[str] | None = None
    token_file: str | None = None
    # PEM CA bundle that signed the controller's certificate (a self-signed or private CA);
    # relative to this file
    ca_file: str | None = None

    def __post_init__(self) -> None:
        if self.url is not None and self.urls is not None:
            raise Invalid("urls", "set url or urls, not both")
        if self.urls is not None:
            _check_urls(self.urls, key="urls")

    def resolved_urls(self) -> tuple[str, ...] | None:
        """The configured controllers, or None when the file names none."""
        if self.urls is not None:
            return tuple(self.urls)
        return tuple(split_urls(self.url)) if self.url is not None else None


def _check_urls(urls: Sequence[str], *, key: str) -> None:
    """Raise Invalid naming `key` (and the entry's index) for a bad controller URL list."""
    problem = url_list_problem(urls)
    if problem is not None:
        index, reason = problem
        raise Invalid(key if index is None else f"{key}[{index}]", reason)


class CliError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


# --- formatting --------------------------------------------------------------------------------


def format_age(seconds: float | None) -> str:
    """Compact age like kubectl: "3s", "2m", "5h", "4d"; "-" when unknown."""
    if not isinstance(seconds, int | float) or not math.isfinite(seconds):
        return "-"
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 2 * 3600:
        return f"{s // 60}m"
    if s < 2 * 86400:
        return f"{s // 3600}h"
    return f"{s // 86400}d"


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """ "90s", "30m", "2h", "1d", "1h30m" -> seconds; raises ValueError."""
    t = text.strip()
    if not t:
        raise ValueError("empty duration")
    pos = 0
    total = 0.0
    for m in _DURATION.finditer(t):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if pos != len(t) or total <= 0:
        raise ValueError(f"invalid duration {text!r} (use e.g. 90s, 30m, 2h, 1d, 1h30m)")
    return total


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, list | tuple):
        return ",".join(str(x) for x in v) or "-"
    if isinstance(v, dict):
        return ",".join(f"{k}={x}" for k, x in v.items()) or "-"
    return str(v)


def _ago(now: float, ts: Any) -> str:
    return format_age(now - ts) if isinstance(ts, int | float) else "-"


def _age_s(age_s: Any) -> str:
    return format_age(age_s) if isinstance(age_s, int | float) else "-"


def _when(ts: Any) -> str:
    if not isinstance(ts, int | float) or not math.isfinite(ts):
        return "-"
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts))


@dataclass(frozen=True)
class Column:
    """One column of a list: its header, how a cell is made from an item, and whether only
    `-o wide` shows it."""

    header: str
    cell: Callable[[dict[str, Any], float], str]
    wide: bool = False


def _last_report(n: dict[str, Any], now: float) -> str:
    age = n.get("report_age_s")
    return format_age(age) if age is not None else _ago(now, n.get("last_report_at"))


def _ettr(j: dict[str, Any], now: float) -> str:
    ettr = j.get("ettr")
    return f"{ettr:.1%}" if isinstance(ettr, int | float) else _cell(ettr)


def _expires(s: dict[str, Any], now: float) -> str:
    return format_age(s["expires_at"] - now) if s.get("active", True) else "expired"


# Free text (summary, comment, reason, detail) comes last: it may hold spaces.
NODE_COLUMNS = (
    Column("NAME", lambda n, now: n["name"]),
    Column("ROLE", lambda n, now: n["role"]),
    Column("STATE", lambda n, now: n["state"]),
    Column("REPORTING", lambda n, now: _cell(n.get("reporting"))),
    Column("LAST-REPORT", _last_report),
    Column("GPUS", lambda n, now: _cell(n.get("gpus"))),
    Column("IB-PORTS", lambda n, now: _cell(n.get("ib_ports")), wide=True),
    Column("JOB", lambda n, now: _cell(n.get("job"))),
    Column("INCIDENTS", lambda n, now: _cell(n.get("open_incidents"))),
    Column("AGENT", lambda n, now: _cell(n.get("agent_version") or None), wide=True),
    Column("LABELS", lambda n, now: _cell(n.get("labels") or None), wide=True),
    Column("DRAIN-REASON", lambda n, now: _cell(n.get("drain_reason")), wide=True),
)
INCIDENT_COLUMNS = (
    Column("ID", lambda i, now: str(i["id"])),
    Column("RULE", lambda i, now: i["rule"]),
    Column("TARGET", lambda i, now: i.get("target_text") or i["target"]),
    Column("SEVERITY", lambda i, now: i["severity"]),
    Column("STATE", lambda i, now: i["state"]),
    Column("AGE", lambda i, now: _ago(now, i.get("opened_at"))),
    Column("NODE", lambda i, now: _cell(i.get("node")), wide=True),
    Column("JOB", lambda i, now: _cell(i.get("job")), wide=True),
    Column("UPDATED", lambda i, now: _ago(now, i.get("updated_at")), wide=True),
    Column("RESOLVED", lambda i, now: _ago(now, i.get("resolved_at")), wide=True),
    Column("SUMMARY", lambda i, now: _cell(i.get("summary") or None)),
)
JOB_COLUMNS = (
    Column("NAME", lambda j, now: j["name"]),
    Column("STATE", lambda j, now: j["state"]),
    # where the job runs: "torchrun" (launched by the agents) or "slurm <job id>"
    Column(
        "SCHEDULER",
        lambda j, now: " ".join(
            x for x in (j.get("scheduler") or "torchrun", j.get("scheduler_job_id") or "") if x
        ),
    ),
    Column("NODES", lambda j, now: str(len(j.get("nodes", [])))),
    Column("RANKS", lambda j, now: _cell(j.get("ranks"))),
    Column("ATTEMPT", lambda j, now: _cell(j.get("attempt"))),
    Column("STEP", lambda j, now: _cell(j.get("last_step"))),
    Column("CKPT", lambda j, now: _cell(j.get("ckpt_step"))),
    # checkpoint health: how old the newest commit is, saves failed in a row since
    Column("CKPT-AGE", lambda j, now: _age_s(j.get("ckpt_age_s")), wide=True),
    Column("CKPT-FAILS", lambda j, now: _cell(j.get("ckpt_failures")), wide=True),
    Column("RESTARTS", lambda j, now: _cell(j.get("restarts"))),
    Column("ETTR", _ettr),
    Column("WORLD", lambda j, now: _cell(j.get("world_size")), wide=True),
    Column("PER-NODE", lambda j, now: _cell(j.get("nproc_per_node")), wide=True),
    Column("MIN-NODES", lambda j, now: _cell(j.get("min_nodes")), wide=True),
    Column("AGE", lambda j, now: _ago(now, j.get("started_at")), wide=True),
    Column("NODE-LIST", lambda j, now: _cell(j.get("nodes")), wide=True),
    Column("REASON", lambda j, now: _cell(j.get("state_reason") or None), wide=True),
)
SILENCE_COLUMNS = (
    Column("ID", lambda s, now: str(s["id"])),
    Column("RULE", lambda s, now: _cell(s.get("rule"))),
    Column("NODE", lambda s, now: _cell(s.get("node"))),
    Column("CREATED-BY", lambda s, now: s["created_by"]),
    Column("AGE", lambda s, now: _ago(now, s.get("created_at")), wide=True),
    Column("EXPIRES-IN", _expires),
    Column("EXPIRES-AT", lambda s, now: _when(s.get("expires_at")), wide=True),
    Column("ACTIVE", lambda s, now: _cell(s.get("active", True))),
    Column("COMMENT", lambda s, now: _cell(s.get("comment") or None)),
)
AUDIT_COLUMNS = (
    Column("ID", lambda a, now: str(a["id"])),
    Column("AGE", lambda a, now: _ago(now, a.get("ts"))),
    Column("TIME", lambda a, now: _when(a.get("ts")), wide=True),
    Column("ACTOR", lambda a, now: a["actor"]),
    Column("ACTION", lambda a, now: a["action"]),
    Column("TARGET", lambda a, now: a["target"]),
    Column("DETAIL", lambda a, now: json.dumps(a.get("detail") or {}, separators=(",", ":"))),
)
_COLUMNS: dict[str, tuple[Column, ...]] = {
    "nodes": NODE_COLUMNS,
    "incidents": INCIDENT_COLUMNS,
    "jobs": JOB_COLUMNS,
    "silences": SILENCE_COLUMNS,
    "audit": AUDIT_COLUMNS,
    "spares": NODE_COLUMNS,
}


def _table(
    out: IO[str], columns: Sequence[Column], items: list[dict[str, Any]], now: float, *, wide: bool
) -> None:
    shown = [c for c in columns if wide or not c.wide]
    rows = [[c.header for c in shown], *([c.cell(item, now) for c in shown] for item in items)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(shown))]
    for row in rows:
        line = "  ".join(c.ljust(widths[i]) for i, c in enumerate(row))
        out.write(line.rstrip() + "\n")


def _describe(out: IO[str], obj: dict[str, Any], now: float, indent: str = "") -> None:
    width = max((len(k) for k in obj), default=0)
    for key, value in obj.items():
        label = f"{indent}{key}:".ljust(width + len(indent) + 2)
        if isinstance(value, dict):
            out.write(f"{indent}{key}:\n")
            _describe(out, value, now, indent + "  ")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            out.write(f"{indent}{key}:\n")
            for item in value:
                out.write(f"{indent}  -\n")
                _describe(out, item, now, indent + "    ")
        elif isinstance(value, str) and "\n" in value:
            # multi-line text (collected stacks): a block, each line indented under its key
            out.write(f"{indent}{key}: |\n")
            for line in value.splitlines():
                out.write(f"{indent}  {line}\n")
        elif key.endswith("_at") or key == "ts":
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
            out.write(f"{label}{when} ({_ago(now, value)} ago)\n")
        else:
            out.write(f"{label}{_cell(value)}\n")


# --- HTTP --------------------------------------------------------------------------------------


class Api:
    """The controller's REST API at one or several URLs (HA): a request goes to the first
    URL that answers; a 503 naming a leader of the list is retried once there."""

    def __init__(
        self,
        urls: Sequence[str],
        token: str | None,
        *,
        timeout_s: float,
        ca_file: str | None = None,
    ) -> None:
        self.urls = tuple(u.rstrip("/") for u in urls)
        # the client header lets the API say "via agentctl" in a reason it fills in
        headers = {CLIENT_HEADER: "agentctl", "User-Agent": f"agentctl/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        verify: ssl.SSLContext | bool = True
        if ca_file is not None:
            try:
                verify = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as e:
                raise CliError(
                    f"error: cannot use CA file {ca_file}: {getattr(e, 'strerror', None) or e}",
                    EXIT["usage"],
                ) from None
        # one client for every controller: the same token and CA for each
        self._client = httpx.Client(headers=headers, timeout=timeout_s, verify=verify)

    def request(self, method: str, path: str, **kw: Any) -> Any:
        return _answer(self._send(method, path, **kw))

    def list_all(self, path: str, params: dict[str, Any], *, most: int) -> tuple[list[Any], bool]:
        """GET a paged list, following CONTINUE_HEADER page by page, up to `most` items;
        also whether more were left."""
        items: list[Any] = []
        params = dict(params)
        while True:
            params["limit"] = min(_PAGE_SIZE, most - len(items))
            r = self._send("GET", path, params=params)
            items.extend(_answer(r))
            after = r.headers.get(CONTINUE_HEADER)
            if after is None:
                return items, False
            if len(items) >= most:
                return items[:most], True
            params["continue"] = after

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        todo = list(self.urls)
        missed: list[str] = []  # "URL: why", for each controller that did not take it
        answered = False  # some controller answered (so it is not a connection problem)
        redirected = False
        while todo:
            url = todo.pop(0)
            try:
                r = self._client.request(method, url + path, **kw)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                # not sent: safe to try the next controller, even for a write
                missed.append(f"{url}: {e}")
                continue
            except httpx.HTTPError as e:
                raise CliError(f"request to {url} failed: {e}", EXIT["error"]) from None
            if r.status_code != 503 or (len(self.urls) == 1 and LEADER_HEADER not in r.headers):
                return r
            # a standby (or a controller without a leader) refused it before doing anything
            answered = True
            header = r.headers.get(LEADER_HEADER)
            leader = leader_named(header)
            target = follow(header, self.urls)
            if leader is not None and target is None:
                raise CliError(
                    f"error: 503 {url} does not lead; the leader is {leader}, which is not "
                    f"one of the controller URLs ({', '.join(self.urls)}): add it to --url, "
                    "TRAINGUARD_URL or the config file's url",
                    EXIT["error"],
                )
            if target is not None and target.rstrip("/") != url and not redirected:
                redirected = True  # once: never a loop between standbys
                todo = [target.rstrip("/")]
                missed.append(f"{url}: 503, the leader is {target}")
                continue
            if target is not None:
                raise CliError(
                    f"error: 503 {url} does not lead; it names {target} as the leader "
                    f"({'; '.join(missed) or 'asked already'}); retry shortly",
                    EXIT["error"],
                )
            missed.append(f"{url}: 503 {_error_text(r)}")
        if not answered:
            if len(self.urls) == 1:
                raise CliError(f"cannot connect to {missed[0]}", EXIT["connect"])
            raise CliError(
                f"cannot connect to any controller: {'; '.join(missed)}", EXIT["connect"]
            )
        raise CliError(
            f"error: 503 no controller leads now ({'; '.join(missed)}); retry shortly",
            EXIT["error"],
        )


def _error_text(r: httpx.Response) -> str:
    """An error answer's message: the body's `error` and `detail`, else its text."""
    try:
        body = r.json()
        message = str(body.get("error") or r.reason_phrase)
        if body.get("detail"):
            message += f" ({json.dumps(body['detail'], separators=(',', ':'))})"
    except (ValueError, AttributeError):
        message = r.text.strip() or r.reason_phrase
    return message


def _answer(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        code = {404: "not_found", 401: "auth", 403: "auth"}.get(r.status_code, "error")
        raise CliError(f"error: {r.status_code} {_error_text(r)}", EXIT[code])
    if r.status_code == 204 or not r.content:
        return None
    return r.json()


# --- argument parsing --------------------------------------------------------------------------

# kubectl-style names: each listable resource by its plural, singular and short name
RESOURCES: dict[str, tuple[str, ...]] = {
    "nodes": ("node", "no"),
    "incidents": ("incident", "inc"),
    "jobs": ("job",),
    "silences": ("silence",),
    "audit": (),
}
_RESOURCE_OF = {a: name for name, aliases in RESOURCES.items() for a in (name, *aliases)}
# `describe` takes the singular; any name of nodes, incidents and jobs is accepted
_KIND_OF = {
    a: name[:-1] for a, name in _RESOURCE_OF.items() if name in ("nodes", "incidents", "jobs")
}
# command aliases -> the command they stand for
_COMMAND_OF = {"cordon": "drain", "uncordon": "undrain"}

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

EPILOG = """exit codes: 0 ok, 1 error or request failed, 2 usage, 3 not found,
            4 unauthorized or forbidden, 5 cannot connect
run 'agentctl COMMAND --help' for a command's options and an example"""


def _command(
    sub: Any,
    name: str,
    summary: str,
    *examples: str,
    parents: Sequence[argparse.ArgumentParser] = (),
    aliases: Sequence[str] = (),
) -> argparse.ArgumentParser:
    """A subcommand whose --help starts with its one-line `summary` and ends with examples."""
    title = "example:" if len(examples) == 1 else "examples:"
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        aliases=list(aliases),
        parents=list(parents),
        help=summary,
        description=summary,
        epilog="\n".join([title, *(f"  {e}" for e in examples)]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    """agentctl's whole command tree (also the source of its shell completion): the global
    options, then one function per group of commands, in the order `--help` lists them."""
    common, reads = _option_parents()
    p = _top_parser()
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    api = [common, reads]
    _add_read_commands(sub, parents=api)
    _add_node_commands(sub, parents=api)
    _add_lifecycle_commands(sub, parents=api)
    _add_silence_commands(sub, parents=api, common=common)
    _add_inject_command(sub, parents=api)
    _add_job_commands(sub, parents=api)
    _add_rules_commands(sub, common=common)
    _add_token_commands(sub)
    _add_completion_command(sub)
    return p


def _option_parents() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The options every command that calls the controller takes (`common`) and those of the
    commands that print what they read (`reads`)."""
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: the same options are accepted before or after the command
    common.add_argument(
        "--url", default=argparse.SUPPRESS, help="controller URL, or several comma-separated"
    )
    common.add_argument(
        "--token-file", default=argparse.SUPPRESS, help="file holding the bearer token"
    )
    common.add_argument(
        "--ca-file", default=argparse.SUPPRESS, help="CA file for the controller's certificate"
    )
    common.add_argument("--config", default=argparse.SUPPRESS, help="agentctl config file")
    common.add_argument(
        "--timeout", type=float, default=argparse.SUPPRESS, help="request timeout, seconds"
    )
    reads = argparse.ArgumentParser(add_help=False)
    reads.add_argument(
        "-o",
        "--output",
        choices=FORMATS,
        default=argparse.SUPPRESS,
        help="table (default), wide (more columns), json or yaml",
    )
    return common, reads


def _top_parser() -> argparse.ArgumentParser:
    """`agentctl` itself and its global options (with their defaults)."""
    p = argparse.ArgumentParser(
        prog="agentctl",
        description="agentctl: the trainguard controller's command line",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"agentctl {__version__}")
    p.add_argument(
        "--url",
        default=None,
        help="controller URL, or several comma-separated: reads from the first that answers, "
        "writes to the leader (env TRAINGUARD_URL)",
    )
    p.add_argument("--token-file", default=None, help="bearer token file (env TRAINGUARD_TOKEN)")
    p.add_argument(
        "--ca-file",
        default=None,
        help="PEM CA file that signed the controller's certificate (env TRAINGUARD_CA_FILE)",
    )
    p.add_argument("--config", default=None, help="config file (url or urls, token_file, ca_file)")
    p.add_argument("--timeout", type=float, default=10.0, help="request timeout, seconds")
    p.add_argument(
        "-o", "--output", choices=FORMATS, default="table", help="table, wide, json or yaml"
    )
    return p


def _add_read_commands(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """get and describe: what the controller knows."""
    get = _command(
        sub,
        "get",
        "List nodes, incidents, jobs, silences or audit entries.",
        "agentctl get nodes -o wide",
        "agentctl get inc --state open --node node-12 --limit 20",
        parents=parents,
    )
    get.add_argument(
        "resource", choices=list(_RESOURCE_OF), metavar="{" + ",".join(RESOURCES) + "}"
    )
    get.add_argument("--state", help="incidents: only this state")
    get.add_argument("--node", help="incidents: only this node")
    get.add_argument(
        "--limit",
        type=int,
        default=None,
        help=f"jobs/incidents/audit: at most N (default: all, up to {LIST_MOST:,})",
    )
    get.add_argument("--all", action="store_true", help="silences: include expired")

    desc = _command(
        sub,
        "describe",
        "Show one node, incident or job in full.",
        "agentctl describe incident 42",
        parents=parents,
    )
    desc.add_argument("kind", choices=list(_KIND_OF), metavar="{node,incident,job}")
    desc.add_argument("name")


def _add_node_commands(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """drain, undrain, spares and role: a node's place in the cluster."""
    drain = _command(
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

    undrain = _command(
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

    _command(sub, "spares", "List the hot spares.", "agentctl spares -o wide", parents=parents)

    role = _command(
        sub,
        "role",
        "Mark a node active or hot spare.",
        "agentctl role node-31 spare",
        parents=parents,
    )
    role.add_argument("node")
    role.add_argument("role", choices=["active", "spare"])


def _add_lifecycle_commands(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """node return|retire: a node's way back into service, or out for good."""
    node = _command(
        sub,
        "node",
        "Return a repaired node to service, or retire it.",
        "agentctl node return node-12",
    )
    nsub = node.add_subparsers(dest="node_command", required=True, metavar="SUBCOMMAND")
    ret = _command(
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
    retire = _command(
        nsub,
        "retire",
        "Take a node out of service for good (an RMA), with the reason.",
        "agentctl node retire node-12 --reason 'RMA 4411: GPU 3 row remap failures'",
        parents=parents,
    )
    retire.add_argument("node")
    retire.add_argument("--reason", required=True, help="why it leaves (recorded and shown)")


def _node_return(api: Api, args: argparse.Namespace, out: IO[str]) -> None:
    """POST the return, then read the node until its validation ends; print the result."""
    try:
        wait_s = parse_duration(args.wait)
    except ValueError as e:
        raise CliError(f"error: --wait: {e}", EXIT["usage"]) from None
    path = f"/v1/nodes/{_quote(args.node)}"
    data = api.request("POST", f"{path}/return")
    deadline = SYSTEM_CLOCK.monotonic() + wait_s
    while data.get("state") == "validating" and SYSTEM_CLOCK.monotonic() < deadline:
        SYSTEM_CLOCK.sleep(1.0)
        data = api.request("GET", path)
    if args.output in ("json", "yaml"):
        _print(out, args, "node", data)
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
    if args.output not in ("json", "yaml"):
        out.write(f"node {args.node} returned ({data.get('role')}): preflight {summary}\n")


def _add_silence_commands(
    sub: Any, *, parents: list[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """silence and unsilence."""
    sil = _command(
        sub,
        "silence",
        "Silence a rule, a node, or a rule on a node for a while.",
        "agentctl silence --rule gpu_dbe --node node-12 --for 2h --comment 'RMA open'",
        parents=parents,
    )
    sil.add_argument("--rule")
    sil.add_argument("--node")
    sil.add_argument("--for", dest="duration", required=True, help="e.g. 30m, 2h, 1d")
    sil.add_argument("--comment", default="")

    unsil = _command(
        sub, "unsilence", "Delete a silence.", "agentctl unsilence 7", parents=[common]
    )
    unsil.add_argument("id", type=int)


def _add_inject_command(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """inject: a simulated fault."""
    inj = _command(
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


def _add_job_commands(sub: Any, *, parents: list[argparse.ArgumentParser]) -> None:
    """job submit|stop, checkpoint and restart."""
    job = _command(sub, "job", "Submit or stop a training job.", "agentctl job submit llama.yaml")
    jsub = job.add_subparsers(dest="job_command", required=True, metavar="SUBCOMMAND")
    submit = _command(
        jsub,
        "submit",
        "Submit a job spec (YAML, see docs/jobs.md); prints the job.",
        "agentctl job submit llama.yaml",
        parents=parents,
    )
    submit.add_argument("file")
    jstop = _command(
        jsub, "stop", "Stop a job on all its nodes.", "agentctl job stop llama", parents=parents
    )
    jstop.add_argument("job")
    for verb, text in (
        ("checkpoint", "Ask a job's ranks for a checkpoint now."),
        ("restart", "Restart a job from its latest committed checkpoint."),
    ):
        verb_parser = _command(sub, verb, text, f"agentctl {verb} llama", parents=parents)
        verb_parser.add_argument("job")


def _add_rules_commands(sub: Any, *, common: argparse.ArgumentParser) -> None:
    """rules check|export (offline) and reload."""
    rules = _command(
        sub, "rules", "Check, export or reload alerting rules.", "agentctl rules check"
    )
    rsub = rules.add_subparsers(dest="rules_command", required=True, metavar="SUBCOMMAND")
    check = _command(
        rsub,
        "check",
        "Validate rule files offline (default: the shipped rules and XID catalog).",
        "agentctl rules check",
        "agentctl rules check /etc/trainguard/rules",
    )
    check.add_argument("paths", nargs="*", help="rule files or directories")
    check.add_argument(
        "--controller-config",
        metavar="FILE",
        help="the controller config whose api.max_nodes and rule_budget size the cost check"
        " (default: their defaults)",
    )
    export = _command(
        rsub,
        "export",
        "Print rules as Prometheus alerting rules (default: the shipped rules).",
        "agentctl rules export --format prometheus > trainguard-alerts.yml",
    )
    export.add_argument("--format", choices=["prometheus"], default="prometheus")
    export.add_argument("paths", nargs="*", help="rule files or directories")
    _command(
        rsub,
        "reload",
        "Ask the controller to reload its rule files.",
        "agentctl rules reload",
        parents=[common],
    )


def _add_token_commands(sub: Any) -> None:
    """token hash|issue (offline)."""
    token = _command(
        sub,
        "token",
        "Token helpers.",
        "agentctl token issue node-12 --out node-12.token",
        'printf %s "$TOKEN" | agentctl token hash',
    )
    tsub = token.add_subparsers(dest="token_command", required=True, metavar="SUBCOMMAND")
    _command(
        tsub,
        "hash",
        "Read a token on stdin, print its tokens-file sha256 line.",
        'printf %s "$TOKEN" | agentctl token hash',
    )
    issue = _command(
        tsub,
        "issue",
        "Make a new agent token bound to NODE: the token once (stdout, or --out FILE, mode "
        "0600) and its tokens-file line (stdout with --out, else stderr).",
        "agentctl token issue node-12 --out /etc/trainguard/agent.token",
        "agentctl token issue node-12 --out n12.token --tokens-file /etc/trainguard/tokens.yaml",
    )
    issue.add_argument("node", help="the node this token speaks for")
    issue.add_argument("--name", default=None, help="the token's name (default agent-NODE)")
    issue.add_argument("--out", default=None, help="write the token to this new file (0600)")
    issue.add_argument(
        "--tokens-file",
        dest="append_to",
        default=None,
        help="also append the line to this tokens file, atomically (restart the controller)",
    )


def _add_completion_command(sub: Any) -> None:
    """completion: the shell completion script."""
    comp = _command(
        sub,
        "completion",
        "Print a shell completion script for bash or zsh.",
        "source <(agentctl completion bash)",
        "source <(agentctl completion zsh)   # after compinit",
    )
    comp.add_argument("shell", choices=SHELLS)


# --- settings ----------------------------------------------------------------------------------


def _config_path(arg: str | None) -> tuple[Path, bool]:
    if arg:
        return Path(arg), True
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "trainguard" / "agentctl.yaml", False


@dataclass(frozen=True)
class Settings:
    urls: tuple[str, ...]
    token: str | None
    ca_file: str | None


def _settings(args: argparse.Namespace, err: IO[str]) -> Settings:
    path, explicit = _config_path(args.config)
    cfg = AgentctlConfig()
    if explicit or path.exists():
        try:
            cfg = build(AgentctlConfig, load_yaml(path), source=str(path))
        except ConfigError as e:
            raise CliError(f"error: {e}", EXIT["usage"]) from None
    urls = _urls(args, cfg)
    ca_file = args.ca_file or os.environ.get("TRAINGUARD_CA_FILE") or None
    if ca_file is None and cfg.ca_file is not None:
        ca_file = cfg.ca_file
        if not Path(ca_file).is_absolute():
            ca_file = str(path.parent / ca_file)
    return Settings(urls=urls, token=_token(args, cfg, path, err), ca_file=ca_file)


def _urls(args: argparse.Namespace, cfg: AgentctlConfig) -> tuple[str, ...]:
    """The controller URLs: --url, else TRAINGUARD_URL (each comma-separated), else the
    config file, else the default; a bad entry is a usage error naming where it came from."""
    for source, text in (("--url", args.url), ("TRAINGUARD_URL", os.environ.get("TRAINGUARD_URL"))):
        if text:
            urls = split_urls(text)
            try:
                _check_urls(urls, key=source)
            except Invalid as e:
                raise CliError(f"error: {e.key}: {e.reason}", EXIT["usage"]) from None
            return tuple(urls)
    return cfg.resolved_urls() or (DEFAULT_URL,)


def _token(args: argparse.Namespace, cfg: AgentctlConfig, path: Path, err: IO[str]) -> str | None:
    token_file = args.token_file
    if token_file is None and not os.environ.get("TRAINGUARD_TOKEN"):
        token_file = cfg.token_file
        if token_file is not None and not Path(token_file).is_absolute():
            token_file = str(path.parent / token_file)
    if token_file is None:
        return os.environ.get("TRAINGUARD_TOKEN") or None
    try:
        with open(token_file, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read().strip()
    except OSError as e:
        raise CliError(
            f"error: cannot read token file {token_file}: {e.strerror or e}", EXIT["usage"]
        ) from None
    if os.name == "posix" and stat.S_ISREG(mode) and mode & 0o077:
        err.write(
            f"warning: token file {token_file} is open to group or others "
            f"(mode {stat.S_IMODE(mode):04o}); fix: chmod 600 {token_file}\n"
        )
    return token


# --- commands ----------------------------------------------------------------------------------


def _print(out: IO[str], args: argparse.Namespace, kind: str, data: Any) -> None:
    if args.output == "json":
        out.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    elif args.output == "yaml":
        out.write(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    elif kind in _COLUMNS:
        _table(out, _COLUMNS[kind], data, SYSTEM_CLOCK.now(), wide=args.output == "wide")
    else:
        _describe(out, data, SYSTEM_CLOCK.now())


def _get(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    resource = _RESOURCE_OF[args.resource]
    params: dict[str, Any] = {}
    if resource == "incidents":
        params = {"state": args.state, "node": args.node}
    elif resource == "silences" and args.all:
        params = {"include_expired": "true"}
    params = {k: v for k, v in params.items() if v is not None}
    if resource not in _PAGED:
        _print(out, args, resource, api.request("GET", f"/v1/{resource}", params=params))
        return
    if args.limit is not None and args.limit < 1:
        raise CliError(f"error: --limit must be at least 1, got {args.limit}", EXIT["usage"])
    most = LIST_MOST if args.limit is None else args.limit
    data, more = api.list_all(f"/v1/{resource}", params, most=most)
    _print(out, args, resource, data)
    if more and args.limit is None:
        err.write(f"note: showing the first {most:,} {resource}; --limit N for more\n")


def _describe_cmd(api: Api, args: argparse.Namespace, out: IO[str]) -> None:
    kind = _KIND_OF[args.kind]
    if kind == "incident":
        if not args.name.isdigit():
            raise CliError(f"error: incident id must be a number, got {args.name!r}", EXIT["usage"])
        data = api.request("GET", f"/v1/incidents/{args.name}")
    else:
        data = api.request("GET", f"/v1/{kind}s/{_quote(args.name)}")
    _print(out, args, kind, data)


def _quote(name: str) -> str:
    return quote(name, safe="")


def _run_api(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    settings = _settings(args, err)
    api = Api(settings.urls, settings.token, timeout_s=args.timeout, ca_file=settings.ca_file)
    cmd = args.command
    if cmd == "get":
        _get(api, args, out, err)
    elif cmd == "describe":
        _describe_cmd(api, args, out)
    elif cmd == "drain":
        # no reason: the controller records who drained it and that agentctl did
        why = bad_drain_reason(args.reason) if args.reason is not None else None
        if why is not None:
            raise CliError(f"error: --reason: {why}", EXIT["usage"])
        body = {"reason": args.reason} if args.reason is not None else {}
        data = api.request("POST", f"/v1/nodes/{_quote(args.node)}/drain", json=body)
        _print(out, args, "node", data)
    elif cmd == "undrain":
        body = {"force": True} if args.force else {}
        data = api.request("POST", f"/v1/nodes/{_quote(args.node)}/undrain", json=body)
        _print(out, args, "node", data)
    elif cmd == "node" and args.node_command == "return":
        _node_return(api, args, out)
    elif cmd == "node" and args.node_command == "retire":
        why = bad_drain_reason(args.reason)
        if why is not None or not args.reason.strip():
            raise CliError(f"error: --reason: {why or 'must say why'}", EXIT["usage"])
        data = api.request(
            "POST", f"/v1/nodes/{_quote(args.node)}/retire", json={"reason": args.reason}
        )
        _print(out, args, "node", data)
    elif cmd == "spares":
        _print(out, args, "spares", api.request("GET", "/v1/spares"))
    elif cmd == "role":
        data = api.request("PUT", f"/v1/nodes/{_quote(args.node)}/role", json={"role": args.role})
        _print(out, args, "node", data)
    elif cmd == "silence":
        if args.rule is None and args.node is None:
            raise CliError("error: give --rule, --node or both", EXIT["usage"])
        try:
            duration_s = parse_duration(args.duration)
        except ValueError as e:
            raise CliError(f"error: --for: {e}", EXIT["usage"]) from None
        body = {"duration_s": duration_s, "comment": args.comment}
        body.update({k: v for k, v in (("rule", args.rule), ("node", args.node)) if v})
        _print(out, args, "silence", api.request("POST", "/v1/silences", json=body))
    elif cmd == "unsilence":
        api.request("DELETE", f"/v1/silences/{args.id}")
        out.write(f"silence {args.id} deleted\n")
    elif cmd == "inject":
        spec: dict[str, Any] = {"kind": args.kind}
        for key in ("gpu", "link", "device", "port", "code", "rate_per_s"):
            if getattr(args, key) is not None:
                spec[key] = getattr(args, key)
        if args.duration is not None:
            try:
                spec["duration_s"] = parse_duration(args.duration)
            except ValueError as e:
                raise CliError(f"error: --for: {e}", EXIT["usage"]) from None
        data = api.request("POST", f"/v1/nodes/{_quote(args.node)}/faults", json=spec)
        if args.output in ("json", "yaml"):
            _print(out, args, "fault", data)
        else:
            out.write(f"fault {args.kind} queued for {args.node}: command {data['command_id']}\n")
    elif cmd == "job" and args.job_command == "submit":
        try:
            spec = load_yaml(Path(args.file))
        except ConfigError as e:
            raise CliError(f"error: {e}", EXIT["usage"]) from None
        if not isinstance(spec, dict):
            raise CliError(f"error: {args.file}: a job spec must be a mapping", EXIT["usage"])
        _print(out, args, "job", api.request("POST", "/v1/jobs", json=spec))
    elif cmd in ("checkpoint", "restart") or (cmd == "job" and args.job_command == "stop"):
        verb = "stop" if cmd == "job" else cmd
        data = api.request("POST", f"/v1/jobs/{_quote(args.job)}/{verb}")
        if args.output in ("json", "yaml"):
            _print(out, args, "action", data)
        else:
            out.write(f"{verb} of job {args.job}: step #{data['id']} {data['state']}\n")
    elif cmd == "rules" and args.rules_command == "reload":
        data = api.request("POST", "/v1/rules/reload")
        out.write(f"OK: {data['rules']} rules loaded\n")


def _rules_offline(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    # deferred: the rule language, its signal tables and the engine are a third of agentctl's
    # start-up, and only these two offline commands use them
    from trainguard.controller.config import ControllerConfig, load_config  # noqa: PLC0415
    from trainguard.controller.rules.cost import check_costs, limits_of  # noqa: PLC0415
    from trainguard.controller.rules.export import to_prometheus_rules  # noqa: PLC0415
    from trainguard.controller.rules.loader import RuleError, load_rules  # noqa: PLC0415

    # no path: the rules shipped in this installation (package data, wherever it lives)
    paths = [Path(p) for p in args.paths] or [shipped_dir()]
    try:
        ruleset = load_rules(paths)
        if args.rules_command == "check":
            # the same cost check as the controller's at start and reload, same message
            given = args.controller_config
            config = load_config(given) if given is not None else ControllerConfig()
            check_costs(ruleset, limits_of(config))
            # the XID catalog beside the rules too: the shipped one, or one in a directory given
            catalogs = [
                XidCatalog.load(p / "xid_catalog.yaml")
                for p in paths
                if p.is_dir() and (p / "xid_catalog.yaml").is_file()
            ]
    except (RuleError, ConfigError) as e:
        raise CliError(str(e), EXIT["error"]) from None
    if args.rules_command == "check":
        out.write(f"OK: {len(ruleset.rules)} rules\n")
        for catalog in catalogs:
            out.write(f"OK: XID catalog {catalog.source}: {len(catalog)} XIDs\n")
        return
    doc, warnings = to_prometheus_rules(ruleset)
    for w in warnings:
        err.write(f"warning: {w}\n")
    out.write(yaml.safe_dump(doc, sort_keys=False))


def _token_hash(stdin: IO[str], out: IO[str]) -> None:
    token = stdin.read().strip()
    if not token:
        raise CliError("error: no token on stdin", EXIT["usage"])
    out.write(f"sha256: {hash_token(token)}\n")


def _token_issue(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    token = new_token()
    try:
        line = tokens_line(name=args.name or f"agent-{args.node}", node=args.node, token=token)
        if args.append_to is not None:
            # the line goes in before the token is handed out: a refused append leaves
            # no token behind that no tokens file knows
            append_line(Path(args.append_to), line)
        if args.out is not None:
            write_new(Path(args.out), token + "\n")
    except TokenIssueError as e:
        raise CliError(f"error: {e}", EXIT["usage"]) from None
    if args.out is None:
        out.write(token + "\n")
        err.write(f"# tokens.yaml line (under tokens:):\n{line}\n")
    else:
        out.write(line + "\n")
    if args.append_to is not None:
        err.write(f"appended to {args.append_to}; restart the controller to accept the token\n")


def main(
    argv: Sequence[str] | None = None,
    *,
    stdin: IO[str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Run agentctl; returns the exit code (see EXIT)."""
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    parser = build_parser()
    try:
        # argparse prints --help, --version and usage errors itself: to our streams
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else EXIT["usage"]
    args.command = _COMMAND_OF.get(args.command, args.command)
    try:
        if args.command == "token":
            if args.token_command == "issue":  # noqa: S105 (a subcommand's name)
                _token_issue(args, out, err)
            else:
                _token_hash(stdin or sys.stdin, out)
        elif args.command == "completion":
            out.write(completion_script(parser, shell=args.shell))
        elif args.command == "rules" and args.rules_command in ("check", "export"):
            _rules_offline(args, out, err)
        else:
            _run_api(args, out, err)
    except CliError as e:
        err.write(f"{e}\n")
        return e.code
    except BrokenPipeError:
        return EXIT["ok"]
    return EXIT["ok"]


if __name__ == "__main__":
    sys.exit(main())
