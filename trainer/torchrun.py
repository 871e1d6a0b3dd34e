"""`python -m trainguard.trainer.torchrun ARGS`: torchrun (`torch.distributed.run`, the same
arguments) whose exit barrier lasts at most `TRAINGUARD_EXIT_BARRIER_S` seconds (default 30)
instead of torch's 300.

A torchrun whose local ranks finished waits in its exit barrier for every other node's
torchrun to finish too. After an in-process recovery some of those are gone for good (a lost
node, the node of a killed rank: a warm standby took their ranks, and a standby is no
torchrun), so torch's barrier would hold the finished job for 5 minutes before it is reported
completed. The agent launches jobs recovered in process through this module (static
rendezvous: a torchrun reads the store only at its start and in this barrier, so a barrier cut
short costs nothing but the log line torch writes about it). torch offers no option for the
barrier's length; the one default is changed here, and tests/integration/test_torchrun_exit.py
checks that it takes.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

from torch.distributed.elastic.agent.server import api
from torch.distributed.run import main as torchrun_main

EXIT_BARRIER_ENV = "TRAINGUARD_EXIT_BARRIER_S"
EXIT_BARRIER_S = 30.0
_EXIT_BARRIER_MAX_S = 3600.0


def exit_barrier_s(env: dict[str, str] | os._Environ[str] = os.environ) -> float:
    """The barrier's length from the environment; a value that is not a number in
    (0, 3600] is refused with the variable's name."""
    raw = env.get(EXIT_BARRIER_ENV)
    if raw is None:
        return EXIT_BARRIER_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= _EXIT_BARRIER_MAX_S):
        raise SystemExit(
            f"{EXIT_BARRIER_ENV}: must be a number of seconds in (0, {_EXIT_BARRIER_MAX_S:g}],"
            f" got {raw!r}"
        )
    return value


def limit_exit_barrier(limit_s: float) -> None:
    """Make every elastic agent created from now on wait at most `limit_s` in its exit
    barrier."""
    original = api.SimpleElasticAgent.__init__
    if getattr(original, "_trainguard_limit", None) is not None:
        original = original._trainguard_original  # type: ignore[attr-defined]

    def init(self: Any, spec: Any, exit_barrier_timeout: float = 300.0, *a: Any, **kw: Any) -> None:
        original(self, spec, min(float(exit_barrier_timeout), limit_s), *a, **kw)

    init._trainguard_limit = limit_s  # type: ignore[attr-defined]
    init._trainguard_original = original  # type: ignore[attr-defined]
    api.SimpleElasticAgent.__init__ = init  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    limit_exit_barrier(exit_barrier_s())
    torchrun_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
