"""agentctl's command tree: the global options, the options every API command takes, and each
group of commands added by the module that runs it, in the order `--help` lists them."""

from __future__ import annotations

import argparse
from typing import Any

from trainguard import __version__
from trainguard.controller.cli import jobs, lifecycle, nodes, reads, rules, silences, tokens
from trainguard.controller.cli.client import REQUEST_TIMEOUT_S
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.format import FORMATS, JSONPATH, output_flag
from trainguard.controller.completion import SHELLS
from trainguard.durations import duration_arg

__all__ = ["COMMAND_OF", "EPILOG", "build_parser"]

# command aliases -> the command they stand for
COMMAND_OF = {"cordon": "drain", "uncordon": "undrain"}

EPILOG = """exit codes: 0 ok, 1 error or request failed, 2 usage, 3 not found,
            4 unauthorized or forbidden, 5 cannot connect, 130 interrupted (Ctrl-C)
run 'agentctl COMMAND --help' for a command's options and an example"""


def build_parser() -> argparse.ArgumentParser:
    """agentctl's whole command tree (also the source of its shell completion): the global
    options, then one function per group of commands, in the order `--help` lists them."""
    common, read_opts = _option_parents()
    p = _top_parser()
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    api = [common, read_opts]
    reads.add_read_commands(sub, parents=api)
    nodes.add_node_commands(sub, parents=api)
    lifecycle.add_lifecycle_commands(sub, parents=api)
    silences.add_silence_commands(sub, parents=api, common=common)
    nodes.add_inject_command(sub, parents=api)
    jobs.add_job_commands(sub, parents=api)
    rules.add_rules_commands(sub, common=common)
    tokens.add_token_commands(sub)
    add_completion_command(sub)
    return p


class _Outputs(tuple[str, ...]):
    """`-o`'s choices: FORMATS (what --help and completion list) or any `jsonpath=...` (its
    template checked by output_flag)."""

    def __contains__(self, value: object) -> bool:
        return tuple.__contains__(self, value) or (
            isinstance(value, str) and value.startswith(JSONPATH)
        )


OUTPUTS = _Outputs(FORMATS)
OUTPUT_HELP = (
    "table (default), wide (more columns), json, yaml, name (kind/name lines) or "
    "jsonpath=TEMPLATE (e.g. '{.items[*].name}')"
)
TIMEOUT_HELP = (
    f"request timeout (default {REQUEST_TIMEOUT_S:g}s); with --wait, how long to wait in all; "
    "e.g. 30s, 5m, or seconds"
)
NO_HEADERS_HELP = "table, wide: no header line"


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
        "--timeout", type=duration_arg, default=argparse.SUPPRESS, help=TIMEOUT_HELP
    )
    reads = argparse.ArgumentParser(add_help=False)
    reads.add_argument(
        "-o",
        "--output",
        type=output_flag,
        choices=OUTPUTS,
        default=argparse.SUPPRESS,
        help=OUTPUT_HELP,
    )
    reads.add_argument(
        "--no-headers", action="store_true", default=argparse.SUPPRESS, help=NO_HEADERS_HELP
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
    p.add_argument("--timeout", type=duration_arg, default=None, help=TIMEOUT_HELP)
    p.add_argument(
        "-o", "--output", type=output_flag, choices=OUTPUTS, default="table", help=OUTPUT_HELP
    )
    p.add_argument("--no-headers", action="store_true", default=False, help=NO_HEADERS_HELP)
    return p


def add_completion_command(sub: Any) -> None:
    """completion: the shell completion script."""
    comp = add_command(
        sub,
        "completion",
        "Print a shell completion script for bash or zsh.",
        "source <(agentctl completion bash)",
        "source <(agentctl completion zsh)   # after compinit",
    )
    comp.add_argument("shell", choices=SHELLS)
