"""What the launcher's environment says this process must be: a distributed launch must have
its process group before `Trainguard` is built.

torchrun (and Slurm/mpirun wrappers that follow it) exports WORLD_SIZE to every rank. A
`Trainguard` built before `torch.distributed.init_process_group` would find no process group
and run single-process on every rank: each writes checkpoints of world size 1 into the same
step directories, and no rank agrees with the others on anything.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["LaunchMismatch", "check_launch"]


class LaunchMismatch(RuntimeError):
    """The launch is distributed but this process has no process group."""


def check_launch(
    *, initialized: bool, single_process: bool, env: Mapping[str, str] | None = None
) -> None:
    """Raise `LaunchMismatch` when WORLD_SIZE > 1 and no process group is initialized, unless
    the caller said the process really runs alone (`single_process=True`)."""
    e = os.environ if env is None else env
    raw = e.get("WORLD_SIZE", "")
    try:
        world_size = int(raw) if raw else 1
    except ValueError:
        raise LaunchMismatch(f"WORLD_SIZE={raw!r} is not an integer") from None
    if initialized or single_process or world_size <= 1:
        return
    rank = e.get("RANK", "?")
    raise LaunchMismatch(
        f"this is rank {rank} of a distributed launch (WORLD_SIZE={world_size}) but no "
        "process group is initialized: call torch.distributed.init_process_group() before "
        "constructing Trainguard (or pass single_process=True if each process really trains "
        "alone, with a ckpt_dir of its own)"
    )
