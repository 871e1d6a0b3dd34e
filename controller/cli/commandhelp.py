"""A subcommand as agentctl adds it: its --help starts with a one-line summary and ends with
examples."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

__all__ = ["add_command"]


def add_command(
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
