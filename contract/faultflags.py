"""The flags of a simulated fault, the same for `agentctl inject` (through the controller) and
`trainguard-agent inject` (to a local sim agent): one parser section and the FaultSpec body it
makes."""

from __future__ import annotations

import argparse
import math
from typing import Any, get_args

from trainguard.durations import duration_arg
from trainguard.protocol import FaultKind

__all__ = [
    "FAULT_KINDS",
    "add_fault_arguments",
    "fault_body",
]

FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)


def _index(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r} (a whole number)") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of 0 or more, got {text!r}")
    return value


# flag -> (FaultSpec field, argparse type, help); the order `--help` lists them in
_FLAGS: tuple[tuple[str, str, Any, str], ...] = (
    ("--gpu", "gpu", _index, "the GPU index"),
    ("--link", "link", _index, "nvlink_down: link index"),
    ("--device", "device", str, "ib_flap/ib_down: e.g. mlx5_0"),
    ("--port", "port", _index, "ib_flap/ib_down: port number"),
    ("--code", "code", _index, "xid: the XID number"),
    ("--rate-per-s", "rate_per_s", _rate, "ecc_storm/nvlink_down: errors per second"),
    ("--for", "duration_s", duration_arg, "how long it lasts, e.g. 30s (default: until clear)"),
)


def add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    """KIND and the fault's options (each absent unless given: the spec's default then)."""
    parser.add_argument("kind", choices=FAULT_KINDS)
    for flag, dest, kind, text in _FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, help=text)


def fault_body(args: argparse.Namespace) -> dict[str, Any]:
    """The FaultSpec as JSON: KIND and the options given."""
    body: dict[str, Any] = {"kind": args.kind}
    for _, dest, _, _ in _FLAGS:
        value = vars(args)[dest]
        if value is not None:
            body[dest] = value
    return body
