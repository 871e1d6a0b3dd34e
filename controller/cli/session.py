"""What a command that calls the controller runs with: the API client, the output streams and
the clock (injected: `--watch` and `--wait` poll on it, tests drive it)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import IO, Any

from trainguard.clock import Clock
from trainguard.controller.cli.client import Api
from trainguard.controller.cli.format import render

__all__ = ["Session"]


@dataclass(frozen=True)
class Session:
    api: Api
    out: IO[str]
    err: IO[str]
    clock: Clock

    def show(self, args: argparse.Namespace, kind: str, data: Any) -> None:
        """Print `data` as `-o` says (`kind`: a resource's plural for a list, else one)."""
        self.out.write(self.text(args, kind, data))

    def text(self, args: argparse.Namespace, kind: str, data: Any) -> str:
        return render(
            kind, data, output=args.output, now=self.clock.now(), headers=not args.no_headers
        )
