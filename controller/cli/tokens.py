"""token hash|issue: agent tokens made and hashed offline."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import IO, Any

from trainguard.controller.auth import hash_token
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.hostlist import HostlistError, expand_hostlist
from trainguard.controller.tokenissue import (
    TokenIssueError,
    append_line,
    append_lines,
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
        "Issue agent tokens or hash one (token issue|hash), offline.",
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
        "Make a new agent token bound to each node of NODES (a name or a Slurm hostlist, "
        "node-[01-64]): one node: the token once (stdout, or --out FILE, mode 0600) and its "
        "tokens-file line (stdout with --out, else stderr); several: --out-dir DIR gets "
        "DIR/NODE.token (0600) for each and stdout the lines.",
        "agentctl token issue node-12 --out /etc/trainguard/agent.token",
        "agentctl token issue node-12 --out n12.token --tokens-file /etc/trainguard/tokens.yaml",
        "agentctl token issue 'node-[01-64]' --out-dir tokens/ --tokens-file tokens.yaml",
    )
    issue.add_argument("node", help="a node, or a Slurm hostlist of nodes (node-[01-64])")
    issue.add_argument("--name", default=None, help="the token's name (default agent-NODE)")
    issue.add_argument("--out", default=None, help="write the token to this new file (0600)")
    issue.add_argument(
        "--out-dir", default=None, help="write each node's token to DIR/NODE.token (0600)"
    )
    issue.add_argument(
        "--tokens-file",
        dest="append_to",
        default=None,
        help="also append the lines to this tokens file, atomically (then reload the "
        "controller: SIGHUP)",
    )


def token_hash(stdin: IO[str], out: IO[str]) -> None:
    token = stdin.read().strip()
    if not token:
        raise CliError("error: no token on stdin", EXIT["usage"])
    out.write(f"sha256: {hash_token(token)}\n")


def token_issue(args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    try:
        nodes = expand_hostlist(args.node)
    except HostlistError as e:
        raise CliError(f"error: NODES {e}", EXIT["usage"]) from None
    if not nodes:
        raise CliError("error: NODES names no node", EXIT["usage"])
    if len(nodes) > 1 or args.out_dir is not None:
        _token_issue_many(args, nodes, out, err)
        return
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
        err.write(f"appended to {args.append_to}; reload the controller (SIGHUP) to accept it\n")


def _token_issue_many(
    args: argparse.Namespace, nodes: list[str], out: IO[str], err: IO[str]
) -> None:
    """A token per node of a hostlist: DIR/NODE.token each, the lines appended at once."""
    if args.out_dir is None or args.out is not None or args.name is not None:
        raise CliError(
            "error: several nodes take --out-dir DIR (one NODE.token each), not --out or --name",
            EXIT["usage"],
        )
    out_dir = Path(args.out_dir)
    tokens = {node: new_token() for node in nodes}
    try:
        lines = [tokens_line(name=f"agent-{n}", node=n, token=t) for n, t in tokens.items()]
        taken = [n for n in nodes if (out_dir / f"{n}.token").exists()]
        if taken:
            raise TokenIssueError(f"{out_dir / (taken[0] + '.token')} exists: nothing written")
        if args.append_to is not None:
            append_lines(Path(args.append_to), lines)
        out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for node, token in tokens.items():
            write_new(out_dir / f"{node}.token", token + "\n")
    except TokenIssueError as e:
        raise CliError(f"error: {e}", EXIT["usage"]) from None
    for line in lines:
        out.write(line + "\n")
    err.write(f"{len(nodes)} tokens in {out_dir}/NODE.token\n")
    if args.append_to is not None:
        err.write(f"appended to {args.append_to}; reload the controller (SIGHUP) to accept them\n")
