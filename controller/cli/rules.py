"""rules check|export (offline: the rule language, its cost check, the Prometheus export)
and rules reload (asks the controller)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import IO, Any

import yaml

from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.format import render_answer
from trainguard.controller.cli.session import Session
from trainguard.rules import shipped_dir
from trainguard.strict import ConfigError
from trainguard.xid_catalog import XidCatalog

__all__ = ["add_rules_commands", "reload", "rules_offline"]


def add_rules_commands(sub: Any, *, common: argparse.ArgumentParser) -> None:
    """rules check|export (offline) and reload."""
    rules = add_command(
        sub,
        "rules",
        "Check, export or reload alerting rules (rules check|export|reload).",
        "agentctl rules check",
    )
    rsub = rules.add_subparsers(dest="rules_command", required=True, metavar="SUBCOMMAND")
    check = add_command(
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
    export = add_command(
        rsub,
        "export",
        "Print rules as Prometheus alerting rules (default: the shipped rules).",
        "agentctl rules export --format prometheus > trainguard-alerts.yml",
    )
    export.add_argument("--format", choices=["prometheus"], default="prometheus")
    export.add_argument("paths", nargs="*", help="rule files or directories")
    add_command(
        rsub,
        "reload",
        "Ask the controller to reload its rule files.",
        "agentctl rules reload",
        parents=[common],
    )


def rules_offline(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
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
        text = f"OK: {len(ruleset.rules)} rules\n" + "".join(
            f"OK: XID catalog {c.source}: {len(c)} XIDs\n" for c in catalogs
        )
        data = {
            "rules": len(ruleset.rules),
            "xid_catalogs": [{"source": str(c.source), "xids": len(c)} for c in catalogs],
        }
        out.write(render_answer(data, output=args.output, text=text, what="rules check"))
        return
    if args.output != "table":
        raise CliError(
            "error: -o: rules export prints Prometheus rules as YAML; it takes no -o",
            EXIT["usage"],
        )
    doc, warnings = to_prometheus_rules(ruleset)
    for w in warnings:
        err.write(f"warning: {w}\n")
    out.write(yaml.safe_dump(doc, sort_keys=False))


def reload(s: Session, args: argparse.Namespace) -> None:
    data = s.api.request("POST", "/v1/rules/reload")
    text = f"OK: {data['rules']} rules loaded\n"
    s.out.write(render_answer(data, output=args.output, text=text, what="rules reload"))
