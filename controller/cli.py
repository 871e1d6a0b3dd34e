"""agentctl: the operator's command line. It talks only to the controller's REST API.

URL and token come from flags (`--url`, `--token-file`), then the environment
(`TRAINGUARD_URL`, `TRAINGUARD_TOKEN`), then `~/.config/trainguard/agentctl.yaml`
(`url`, `token_file`; strict). `rules check|export` and `token hash` work offline.
Exit codes: 0 ok, 1 error or request failed, 2 usage, 3 not found, 4 unauthorized or
forbidden, 5 cannot connect.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import httpx

from trainguard.strict import ConfigError, build, load_yaml

__all__ = ["EXIT", "AgentctlConfig", "format_age", "main", "parse_duration"]

EXIT = {"ok": 0, "error": 1, "usage": 2, "not_found": 3, "auth": 4, "connect": 5}
DEFAULT_URL = "http://127.0.0.1:8800"


@dataclass(frozen=True)
class AgentctlConfig:
    url: str | None = None
    token_file: str | None = None


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
    return str(v)


def _table(out: IO[str], headers: list[str], rows: list[list[str]]) -> None:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    for row in [headers, *rows]:
        line = "  ".join(c.ljust(widths[i]) for i, c in enumerate(row))
        out.write(line.rstrip() + "\n")


def _ago(now: float, ts: Any) -> str:
    return format_age(now - ts) if isinstance(ts, int | float) else "-"


def _node_rows(items: list[dict[str, Any]], now: float) -> tuple[list[str], list[list[str]]]:
    headers = ["NAME", "ROLE", "STATE", "REPORTING", "LAST-REPORT", "GPUS", "JOB", "INCIDENTS"]
    rows = []
    for n in items:
        age = n.get("report_age_s")
        last = format_age(age) if age is not None else _ago(now, n.get("last_report_at"))
        rows.append(
            [
                n["name"],
                n["role"],
                n["state"],
                _cell(n.get("reporting")),
                last,
                _cell(n.get("gpus")),
                _cell(n.get("job")),
                _cell(n.get("open_incidents")),
            ]
        )
    return headers, rows


def _incident_rows(items: list[dict[str, Any]], now: float) -> tuple[list[str], list[list[str]]]:
    headers = ["ID", "RULE", "TARGET", "SEVERITY", "STATE", "AGE", "SUMMARY"]
    rows = [
        [
            str(i["id"]),
            i["rule"],
            i.get("target_text") or i["target"],
            i["severity"],
            i["state"],
            _ago(now, i.get("opened_at")),
            _cell(i.get("summary") or None),
        ]
        for i in items
    ]
    return headers, rows


def _job_rows(items: list[dict[str, Any]], now: float) -> tuple[list[str], list[list[str]]]:
    headers = ["NAME", "STATE", "NODES", "RANKS", "ATTEMPT", "STEP", "CKPT", "RESTARTS", "ETTR"]
    rows = []
    for j in items:
        ettr = j.get("ettr")
        rows.append(
            [
                j["name"],
                j["state"],
                str(len(j.get("nodes", []))),
                _cell(j.get("ranks")),
                _cell(j.get("attempt")),
                _cell(j.get("last_step")),
                _cell(j.get("ckpt_step")),
                _cell(j.get("restarts")),
                f"{ettr:.1%}" if isinstance(ettr, int | float) else _cell(ettr),
            ]
        )
    return headers, rows


def _silence_rows(items: list[dict[str, Any]], now: float) -> tuple[list[str], list[list[str]]]:
    headers = ["ID", "RULE", "NODE", "CREATED-BY", "EXPIRES-IN", "ACTIVE", "COMMENT"]
    rows = [
        [
            str(s["id"]),
            _cell(s.get("rule")),
            _cell(s.get("node")),
            s["created_by"],
            format_age(s["expires_at"] - now) if s.get("active", True) else "expired",
            _cell(s.get("active", True)),
            _cell(s.get("comment") or None),
        ]
        for s in items
    ]
    return headers, rows


def _audit_rows(items: list[dict[str, Any]], now: float) -> tuple[list[str], list[list[str]]]:
    headers = ["ID", "AGE", "ACTOR", "ACTION", "TARGET", "DETAIL"]
    rows = [
        [
            str(a["id"]),
            _ago(now, a.get("ts")),
            a["actor"],
            a["action"],
            a["target"],
            json.dumps(a.get("detail") or {}, separators=(",", ":")),
        ]
        for a in items
    ]
    return headers, rows


_ROWS: dict[str, Callable[[list[dict[str, Any]], float], tuple[list[str], list[list[str]]]]] = {
    "nodes": _node_rows,
    "incidents": _incident_rows,
    "jobs": _job_rows,
    "silences": _silence_rows,
    "audit": _audit_rows,
    "spares": _node_rows,
}


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
    def __init__(self, url: str, token: str | None, *, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def request(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._client.request(method, path, **kw)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise CliError(f"cannot connect to {self.url}: {e}", EXIT["connect"]) from None
        except httpx.HTTPError as e:
            raise CliError(f"request to {self.url} failed: {e}", EXIT["error"]) from None
        if r.status_code >= 400:
            try:
                body = r.json()
                message = str(body.get("error") or r.reason_phrase)
                if body.get("detail"):
                    message += f" ({json.dumps(body['detail'], separators=(',', ':'))})"
            except (ValueError, AttributeError):
                message = r.text.strip() or r.reason_phrase
            code = {404: "not_found", 401: "auth", 403: "auth"}.get(r.status_code, "error")
            raise CliError(f"error: {r.status_code} {message}", EXIT[code])
        if r.status_code == 204 or not r.content:
            return None
        return r.json()


# --- argument parsing --------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: the same options are accepted before or after the command
    common.add_argument("--url", default=argparse.SUPPRESS, help="controller URL")
    common.add_argument(
        "--token-file", default=argparse.SUPPRESS, help="file holding the bearer token"
    )
    common.add_argument("--config", default=argparse.SUPPRESS, help="agentctl config file")
    common.add_argument(
        "--timeout", type=float, default=argparse.SUPPRESS, help="request timeout, seconds"
    )
    reads = argparse.ArgumentParser(add_help=False)
    reads.add_argument(
        "-o", "--output", choices=["table", "json"], default=argparse.SUPPRESS, help="format"
    )

    p = argparse.ArgumentParser(
        prog="agentctl",
        description="trainguard controller command line",
        epilog="exit codes: 0 ok, 1 error, 2 usage, 3 not found, 4 unauthorized/forbidden, "
        "5 cannot connect",
    )
    p.add_argument("--url", default=None, help="controller URL (env TRAINGUARD_URL)")
    p.add_argument("--token-file", default=None, help="bearer token file (env TRAINGUARD_TOKEN)")
    p.add_argument("--config", default=None, help="config file (url, token_file)")
    p.add_argument("--timeout", type=float, default=10.0, help="request timeout, seconds")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    get = sub.add_parser("get", parents=[common, reads], help="list nodes|incidents|jobs|...")
    get.add_argument("resource", choices=["nodes", "incidents", "jobs", "silences", "audit"])
    get.add_argument("--state", help="incidents: only this state")
    get.add_argument("--node", help="incidents: only this node")
    get.add_argument("--limit", type=int, default=None, help="incidents/audit: at most N")
    get.add_argument("--all", action="store_true", help="silences: include expired")

    desc = sub.add_parser("describe", parents=[common, reads], help="show one object in full")
    desc.add_argument("kind", choices=["node", "incident", "job"])
    desc.add_argument("name")

    drain = sub.add_parser("drain", parents=[common, reads], help="drain a node")
    drain.add_argument("node")
    drain.add_argument("--reason", required=True)

    undrain = sub.add_parser("undrain", parents=[common, reads], help="undrain a node")
    undrain.add_argument("node")

    sub.add_parser("spares", parents=[common, reads], help="list hot spares")

    role = sub.add_parser("role", parents=[common, reads], help="mark a node active or spare")
    role.add_argument("node")
    role.add_argument("role", choices=["active", "spare"])

    sil = sub.add_parser("silence", parents=[common, reads], help="silence a rule and/or node")
    sil.add_argument("--rule")
    sil.add_argument("--node")
    sil.add_argument("--for", dest="duration", required=True, help="e.g. 30m, 2h, 1d")
    sil.add_argument("--comment", default="")

    unsil = sub.add_parser("unsilence", parents=[common], help="delete a silence")
    unsil.add_argument("id", type=int)

    inj = sub.add_parser("inject", parents=[common, reads], help="inject a fault (sim agents)")
    inj.add_argument("node")
    inj.add_argument(
        "kind",
        choices=[
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
        ],
    )
    inj.add_argument("--gpu", type=int)
    inj.add_argument("--link", type=int)
    inj.add_argument("--device")
    inj.add_argument("--port", type=int)
    inj.add_argument("--code", type=int)
    inj.add_argument("--rate", type=float, dest="rate_per_s")
    inj.add_argument(
        "--for", dest="duration", help="fault duration, e.g. 30s (default: until cleared)"
    )

    job = sub.add_parser("job", help="submit or stop a training job")
    jsub = job.add_subparsers(dest="job_command", required=True, metavar="SUBCOMMAND")
    submit = jsub.add_parser("submit", parents=[common, reads], help="submit a job spec (YAML)")
    submit.add_argument("file")
    jstop = jsub.add_parser("stop", parents=[common, reads], help="stop a job on every node")
    jstop.add_argument("job")
    for verb, text in (
        ("checkpoint", "ask a job's ranks for a checkpoint now"),
        ("restart", "restart a job from its latest checkpoint"),
    ):
        verb_parser = sub.add_parser(verb, parents=[common, reads], help=text)
        verb_parser.add_argument("job")

    rules = sub.add_parser("rules", help="check, export or reload rules")
    rsub = rules.add_subparsers(dest="rules_command", required=True, metavar="SUBCOMMAND")
    check = rsub.add_parser("check", help="validate rule files offline")
    check.add_argument("paths", nargs="+")
    export = rsub.add_parser("export", help="export rules as Prometheus alerting rules")
    export.add_argument("--format", choices=["prometheus"], default="prometheus")
    export.add_argument("paths", nargs="+")
    rsub.add_parser("reload", parents=[common], help="ask the controller to reload its rules")

    token = sub.add_parser("token", help="token helpers")
    tsub = token.add_subparsers(dest="token_command", required=True, metavar="SUBCOMMAND")
    tsub.add_parser("hash", help="read a token on stdin, print its tokens-file sha256 line")
    return p


# --- settings ----------------------------------------------------------------------------------


def _config_path(arg: str | None) -> tuple[Path, bool]:
    if arg:
        return Path(arg), True
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "trainguard" / "agentctl.yaml", False


def _settings(args: argparse.Namespace) -> tuple[str, str | None]:
    path, explicit = _config_path(args.config)
    cfg = AgentctlConfig()
    if explicit or path.exists():
        try:
            cfg = build(AgentctlConfig, load_yaml(path), source=str(path))
        except ConfigError as e:
            raise CliError(f"error: {e}", EXIT["usage"]) from None
    url = args.url or os.environ.get("TRAINGUARD_URL") or cfg.url or DEFAULT_URL
    token: str | None = None
    token_file = args.token_file
    if token_file is None and not os.environ.get("TRAINGUARD_TOKEN"):
        token_file = cfg.token_file
        if token_file is not None and not Path(token_file).is_absolute():
            token_file = str(path.parent / token_file)
    if token_file is not None:
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise CliError(
                f"error: cannot read token file {token_file}: {e.strerror or e}", EXIT["usage"]
            ) from None
    else:
        token = os.environ.get("TRAINGUARD_TOKEN") or None
    return url, token


# --- commands ----------------------------------------------------------------------------------


def _print(out: IO[str], args: argparse.Namespace, kind: str, data: Any) -> None:
    if args.output == "json":
        out.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return
    now = time.time()
    if kind in _ROWS:
        headers, rows = _ROWS[kind](data, now)
        _table(out, headers, rows)
    else:
        _describe(out, data, now)


def _get(api: Api, args: argparse.Namespace, out: IO[str]) -> None:
    params: dict[str, Any] = {}
    if args.resource == "incidents":
        params = {"state": args.state, "node": args.node, "limit": args.limit}
    elif args.resource == "audit":
        params = {"limit": args.limit}
    elif args.resource == "silences" and args.all:
        params = {"include_expired": "true"}
    params = {k: v for k, v in params.items() if v is not None}
    data = api.request("GET", f"/v1/{args.resource}", params=params)
    _print(out, args, args.resource, data)


def _describe_cmd(api: Api, args: argparse.Namespace, out: IO[str]) -> None:
    if args.kind == "incident":
        if not args.name.isdigit():
            raise CliError(f"error: incident id must be a number, got {args.name!r}", 2)
        data = api.request("GET", f"/v1/incidents/{args.name}")
    else:
        data = api.request("GET", f"/v1/{args.kind}s/{_quote(args.name)}")
    _print(out, args, args.kind, data)


def _quote(name: str) -> str:
    return quote(name, safe="")


def _run_api(args: argparse.Namespace, out: IO[str]) -> None:
    url, token = _settings(args)
    api = Api(url, token, timeout_s=args.timeout)
    cmd = args.command
    if cmd == "get":
        _get(api, args, out)
    elif cmd == "describe":
        _describe_cmd(api, args, out)
    elif cmd == "drain":
        data = api.request(
            "POST", f"/v1/nodes/{_quote(args.node)}/drain", json={"reason": args.reason}
        )
        _print(out, args, "node", data)
    elif cmd == "undrain":
        data = api.request("POST", f"/v1/nodes/{_quote(args.node)}/undrain")
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
        if args.output == "json":
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
        if args.output == "json":
            _print(out, args, "action", data)
        else:
            out.write(f"{verb} of job {args.job}: step #{data['id']} {data['state']}\n")
    elif cmd == "rules" and args.rules_command == "reload":
        data = api.request("POST", "/v1/rules/reload")
        out.write(f"OK: {data['rules']} rules loaded\n")


def _rules_offline(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    from trainguard.controller.rules.loader import RuleError, load_rules  # noqa: PLC0415

    try:
        ruleset = load_rules([Path(p) for p in args.paths])
    except RuleError as e:
        raise CliError(str(e), EXIT["error"]) from None
    except ConfigError as e:
        raise CliError(str(e), EXIT["error"]) from None
    if args.rules_command == "check":
        out.write(f"OK: {len(ruleset.rules)} rules\n")
        return
    import yaml  # noqa: PLC0415

    from trainguard.controller.rules.export import to_prometheus_rules  # noqa: PLC0415

    doc, warnings = to_prometheus_rules(ruleset)
    for w in warnings:
        err.write(f"warning: {w}\n")
    out.write(yaml.safe_dump(doc, sort_keys=False))


def _token_hash(stdin: IO[str], out: IO[str]) -> None:
    from trainguard.controller.auth import hash_token  # noqa: PLC0415

    token = stdin.read().strip()
    if not token:
        raise CliError("error: no token on stdin", EXIT["usage"])
    out.write(f"sha256: {hash_token(token)}\n")


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
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else EXIT["usage"]
    try:
        if args.command == "token":
            _token_hash(stdin or sys.stdin, out)
        elif args.command == "rules" and args.rules_command in ("check", "export"):
            _rules_offline(args, out, err)
        else:
            _run_api(args, out)
    except CliError as e:
        err.write(f"{e}\n")
        return e.code
    except BrokenPipeError:
        return EXIT["ok"]
    return EXIT["ok"]


if __name__ == "__main__":
    sys.exit(main())
