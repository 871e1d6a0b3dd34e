"""token hash|issue: agent tokens made and hashed offline."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import IO, Any

from trainguard.controller.auth import hash_token
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.tokenissue import (
    TokenIssueError,
    append_line,
    new_token,
    tokens_line,
    write_new,
)

__all__ = ["add_token_commands", "token_hash", "token_issue"]


def add_token_commands(sub: Any) -> None:
    """token hash|issue (offline)."""
    token = add_command(
        sub,
        "token",
        "Token helpers.",
        "agentctl token issue node-12 --out node-12.token",
        'printf %s "$TOKEN" | agentctl token hash',
    )
    tsub = token.add_subparsers(dest="token_command", required=True, metavar="SUBCOMMAND")
    add_command(
        tsub,
        "hash",
        "Read a token on stdin, print its tokens-file sha256 line.",
        'printf %s "$TOKEN" | agentctl token hash',
    )
    issue = add_command(
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


def token_hash(stdin: IO[str], out: IO[str]) -> None:
    token = stdin.read().strip()
    if not token:
        raise CliError("error: no token on stdin", EXIT["usage"])
    out.write(f"sha256: {hash_token(token)}\n")


def token_issue(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
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
