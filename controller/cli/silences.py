"""silence and unsilence."""

from __future__ import annotations

import argparse
from typing import Any

from trainguard.controller.cli.commandhelp import add_command
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.controller.cli.format import render_answer
from trainguard.controller.cli.session import Session
from trainguard.durations import parse_duration

__all__ = ["add_silence_commands", "silence", "unsilence"]


def add_silence_commands(
    sub: Any, *, parents: list[argparse.ArgumentParser], common: argparse.ArgumentParser
) -> None:
    """silence and unsilence."""
    sil = add_command(
        sub,
        "silence",
        "Silence a rule, a node, or a rule on a node for a while.",
        "agentctl silence --rule gpu_uncorrectable_ecc --node node-12 --for 2h "
        "--comment 'RMA open'",
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


def silence(s: Session, args: argparse.Namespace) -> None:
    if args.rule is None and args.node is None:
        raise CliError("error: give --rule, --node or both", EXIT["usage"])
    try:
        duration_s = parse_duration(args.duration)
    except ValueError as e:
        raise CliError(f"error: --for: {e}", EXIT["usage"]) from None
    body: dict[str, Any] = {"duration_s": duration_s, "comment": args.comment}
    body.update({k: v for k, v in (("rule", args.rule), ("node", args.node)) if v})
    s.show(args, "silence", s.api.request("POST", "/v1/silences", json=body))


def unsilence(s: Session, args: argparse.Namespace) -> None:
    s.api.request("DELETE", f"/v1/silences/{args.id}")
    text = f"silence {args.id} deleted\n"
    data = {"deleted": args.id}
    s.out.write(render_answer(data, output=args.output, text=text, what="unsilence"))
