"""Slurm's failure as a remediation step's: a failed `scontrol`/`squeue` call fails the step
with Slurm's own message, transient (retried, then paged) or permanent."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from trainguard.controller.actions.base import PermanentError, TransientError
from trainguard.controller.backends.slurm.cli import SlurmError

__all__ = ["as_step_error"]

log = logging.getLogger("trainguard.controller.slurm")


@contextmanager
def as_step_error(what: str) -> Iterator[None]:
    """Raise a SlurmError inside as TransientError or PermanentError saying `what` failed."""
    try:
        yield
    except SlurmError as e:
        log.warning("event=slurm_command_failed what=%s error=%s", what, e)
        if e.transient:
            raise TransientError(f"{what}: {e}") from None
        raise PermanentError(f"{what}: {e}") from None
