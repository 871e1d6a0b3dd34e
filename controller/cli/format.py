"""How agentctl prints what it read (`-o`): tables of columns per resource, one object as
indented `key: value` lines, JSON, YAML, `kind/name` lines and jsonpath templates."""

from __future__ import annotations

import argparse
import io
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import yaml

from trainguard.controller.cli.ckptview import for_humans
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.jsonpath import TemplateError, parse_template

__all__ = [
    "COLUMNS",
    "FORMATS",
    "Column",
    "format_age",
    "output_flag",
    "print_result",
    "render",
    "render_answer",
    "write_object",
    "write_table",
]

FORMATS = ("table", "wide", "json", "yaml", "name")
JSONPATH = "jsonpath="


def output_flag(text: str) -> str:
    """An argparse type for `-o`: one of FORMATS or `jsonpath=TEMPLATE` (checked here, so a
    bad template is a usage error)."""
    if text in FORMATS:
        return text
    if text.startswith(JSONPATH):
        try:
            parse_template(text[len(JSONPATH) :])
        except TemplateError as e:
            raise argparse.ArgumentTypeError(f"jsonpath: {e}") from None
        return text
    raise argparse.ArgumentTypeError(
        f"invalid output format {text!r} (choose from {', '.join(FORMATS)}, jsonpath=TEMPLATE)"
    )


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


def cell(v: Any) -> str:
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


def ago(now: float, ts: Any) -> str:
    return format_age(now - ts) if isinstance(ts, int | float) else "-"


def _age_s(age_s: Any) -> str:
    return format_age(age_s) if isinstance(age_s, int | float) else "-"


def when(ts: Any) -> str:
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
    return format_age(age) if age is not None else ago(now, n.get("last_report_at"))


def _ettr(j: dict[str, Any], now: float) -> str:
    ettr = j.get("ettr")
    return f"{ettr:.1%}" if isinstance(ettr, int | float) else cell(ettr)


def _expires(s: dict[str, Any], now: float) -> str:
    return format_age(s["expires_at"] - now) if s.get("active", True) else "expired"


# Free text (summary, comment, reason, detail) comes last: it may hold spaces.
NODE_COLUMNS = (
    Column("NAME", lambda n, now: n["name"]),
    Column("ROLE", lambda n, now: n["role"]),
    Column("STATE", lambda n, now: n["state"]),
    Column("REPORTING", lambda n, now: cell(n.get("reporting"))),
    Column("LAST-REPORT", _last_report),
    Column("GPUS", lambda n, now: cell(n.get("gpus"))),
    Column("IB-PORTS", lambda n, now: cell(n.get("ib_ports")), wide=True),
    Column("JOB", lambda n, now: cell(n.get("job"))),
    Column("INCIDENTS", lambda n, now: cell(n.get("open_incidents"))),
    Column("AGENT", lambda n, now: cell(n.get("agent_version") or None), wide=True),
    Column("LABELS", lambda n, now: cell(n.get("labels") or None), wide=True),
    Column("DRAIN-REASON", lambda n, now: cell(n.get("drain_reason")), wide=True),
)
INCIDENT_COLUMNS = (
    Column("ID", lambda i, now: str(i["id"])),
    Column("RULE", lambda i, now: i["rule"]),
    Column("TARGET", lambda i, now: i.get("target_text") or i["target"]),
    Column("SEVERITY", lambda i, now: i["severity"]),
    Column("STATE", lambda i, now: i["state"]),
    Column("AGE", lambda i, now: ago(now, i.get("opened_at"))),
    Column("NODE", lambda i, now: cell(i.get("node")), wide=True),
    Column("JOB", lambda i, now: cell(i.get("job")), wide=True),
    Column("UPDATED", lambda i, now: ago(now, i.get("updated_at")), wide=True),
    Column("RESOLVED", lambda i, now: ago(now, i.get("resolved_at")), wide=True),
    Column("SUMMARY", lambda i, now: cell(i.get("summary") or None)),
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
    Column("RANKS", lambda j, now: cell(j.get("ranks"))),
    Column("ATTEMPT", lambda j, now: cell(j.get("attempt"))),
    Column("STEP", lambda j, now: cell(j.get("last_step"))),
    Column("CKPT", lambda j, now: cell(j.get("ckpt_step"))),
    # checkpoint health: how old the newest commit is, saves failed in a row since
    Column("CKPT-AGE", lambda j, now: _age_s(j.get("ckpt_age_s")), wide=True),
    Column("CKPT-FAILS", lambda j, now: cell(j.get("ckpt_failures")), wide=True),
    Column("RESTARTS", lambda j, now: cell(j.get("restarts"))),
    Column("ETTR", _ettr),
    Column("WORLD", lambda j, now: cell(j.get("world_size")), wide=True),
    Column("PER-NODE", lambda j, now: cell(j.get("nproc_per_node")), wide=True),
    Column("MIN-NODES", lambda j, now: cell(j.get("min_nodes")), wide=True),
    Column("AGE", lambda j, now: ago(now, j.get("started_at")), wide=True),
    Column("NODE-LIST", lambda j, now: cell(j.get("nodes")), wide=True),
    Column("REASON", lambda j, now: cell(j.get("state_reason") or None), wide=True),
)
SILENCE_COLUMNS = (
    Column("ID", lambda s, now: str(s["id"])),
    Column("RULE", lambda s, now: cell(s.get("rule"))),
    Column("NODE", lambda s, now: cell(s.get("node"))),
    Column("CREATED-BY", lambda s, now: s["created_by"]),
    Column("AGE", lambda s, now: ago(now, s.get("created_at")), wide=True),
    Column("EXPIRES-IN", _expires),
    Column("EXPIRES-AT", lambda s, now: when(s.get("expires_at")), wide=True),
    Column("ACTIVE", lambda s, now: cell(s.get("active", True))),
    Column("COMMENT", lambda s, now: cell(s.get("comment") or None)),
)
AUDIT_COLUMNS = (
    Column("ID", lambda a, now: str(a["id"])),
    Column("AGE", lambda a, now: ago(now, a.get("ts"))),
    Column("TIME", lambda a, now: when(a.get("ts")), wide=True),
    Column("ACTOR", lambda a, now: a["actor"]),
    Column("ACTION", lambda a, now: a["action"]),
    Column("TARGET", lambda a, now: a["target"]),
    Column("DETAIL", lambda a, now: json.dumps(a.get("detail") or {}, separators=(",", ":"))),
)
COLUMNS: dict[str, tuple[Column, ...]] = {
    "nodes": NODE_COLUMNS,
    "incidents": INCIDENT_COLUMNS,
    "jobs": JOB_COLUMNS,
    "silences": SILENCE_COLUMNS,
    "audit": AUDIT_COLUMNS,
    "spares": NODE_COLUMNS,
}


def write_table(
    out: IO[str],
    columns: Sequence[Column],
    items: list[dict[str, Any]],
    now: float,
    *,
    wide: bool,
    headers: bool = True,
) -> None:
    shown = [c for c in columns if wide or not c.wide]
    rows = [[c.cell(item, now) for c in shown] for item in items]
    if headers:
        rows.insert(0, [c.header for c in shown])
    if not rows:
        return
    widths = [max(len(row[i]) for row in rows) for i in range(len(shown))]
    for row in rows:
        line = "  ".join(c.ljust(widths[i]) for i, c in enumerate(row))
        out.write(line.rstrip() + "\n")


def write_object(out: IO[str], obj: dict[str, Any], now: float, indent: str = "") -> None:
    width = max((len(k) for k in obj), default=0)
    for key, value in obj.items():
        label = f"{indent}{key}:".ljust(width + len(indent) + 2)
        if isinstance(value, dict):
            out.write(f"{indent}{key}:\n")
            write_object(out, value, now, indent + "  ")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            out.write(f"{indent}{key}:\n")
            for item in value:
                out.write(f"{indent}  -\n")
                write_object(out, item, now, indent + "    ")
        elif isinstance(value, str) and "\n" in value:
            # multi-line text (collected stacks): a block, each line indented under its key
            out.write(f"{indent}{key}: |\n")
            for line in value.splitlines():
                out.write(f"{indent}  {line}\n")
        elif key.endswith("_at") or key == "ts":
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
            out.write(f"{label}{when} ({ago(now, value)} ago)\n")
        else:
            out.write(f"{label}{cell(value)}\n")


# what `-o name` prints for a kind: `PREFIX/NAME`, NAME from the field named
_NAME_OF: dict[str, tuple[str, str]] = {
    "nodes": ("node", "name"),
    "spares": ("node", "name"),
    "node": ("node", "name"),
    "jobs": ("job", "name"),
    "job": ("job", "name"),
    "incidents": ("incident", "id"),
    "incident": ("incident", "id"),
    "silences": ("silence", "id"),
    "silence": ("silence", "id"),
    "audit": ("audit", "id"),
    "action": ("action", "id"),
    "fault": ("command", "command_id"),
}


def _name_lines(kind: str, data: Any) -> str:
    prefix, key = _NAME_OF[kind]
    items = data if kind in COLUMNS else [data]
    lines = []
    for item in items:
        # an incident in full (describe) holds the incident itself under "incident"
        obj = item.get("incident", item) if kind == "incident" else item
        lines.append(f"{prefix}/{obj[key]}\n")
    return "".join(lines)


def render(kind: str, data: Any, *, output: str, now: float, headers: bool = True) -> str:
    """`data` (a list when `kind` is one of COLUMNS, else one object) as `-o output` prints
    it."""
    if output == "json":
        return json.dumps(data, indent=2, sort_keys=True) + "\n"
    if output == "yaml":
        return str(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))
    if output == "name":
        return _name_lines(kind, data)
    if output.startswith(JSONPATH):
        root = {"items": data} if kind in COLUMNS else data
        return parse_template(output[len(JSONPATH) :]).render(root)
    buf = io.StringIO()
    if kind in COLUMNS:
        write_table(buf, COLUMNS[kind], data, now, wide=output == "wide", headers=headers)
    else:
        write_object(buf, for_humans(kind, data), now)
    return buf.getvalue()


def render_answer(data: dict[str, Any], *, output: str, text: str, what: str) -> str:
    """An answer that is no resource (a count, a deleted id): `text` for table and wide, the
    data for json, yaml and jsonpath; `-o name` is a usage error (`what` has no name)."""
    if output in ("table", "wide"):
        return text
    if output == "name":
        raise CliError(f"error: -o name: {what} prints no object names", EXIT["usage"])
    return render("answer", data, output=output, now=0.0)


def print_result(
    out: IO[str], args: argparse.Namespace, kind: str, data: Any, *, now: float
) -> None:
    out.write(render(kind, data, output=args.output, now=now, headers=not args.no_headers))
