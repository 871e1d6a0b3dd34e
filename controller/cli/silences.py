"""silence and unsilence."""

from __future__ import annotations

import argparse
from typing import IO, Any

from trainguard.controller.cli.client import Api
from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.format import print_result
from trainguard.controller.cli.values import parse_duration

__all__ = ["add_silence_commands", "silence", "unsilence"]


def add_silence_commands(
    sub: Any, *, parents: list[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """silence and unsilence."""
    sil = add_command(
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

    unsil = add_command(
        sub, "unsilence", "Delete a silence.", "agentctl unsilence 7", parents=[common]
    )
    unsil.add_argument("id", type=int)


def silence(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    if args.rule is None and args.node is None:
        raise CliError("error: give --rule, --node or both", EXIT["usage"])
    try:
        duration_s = parse_duration(args.duration)
    except ValueError as e:
        raise CliError(f"error: --for: {e}", EXIT["usage"]) from None
    body: dict[str, Any] = {"duration_s": duration_s, "comment": args.comment}
    body.update({k: v for k, v in (("rule", args.rule), ("node", args.node)) if v})
    print_result(out, args, "silence", api.request("POST", "/v1/silences", json=body))


def unsilence(api: Api, args: argparse.Namespace, out: IO[str], err: IO[str]) -> None:
    api.request("DELETE", f"/v1/silences/{args.id}")
    out.write(f"silence {args.id} deleted\n")
