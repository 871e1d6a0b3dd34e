"""A job spec's `recovery` block: whether a lost node is recovered in process (the healthy
ranks stay in their processes and re-form the world with a spare's warm standby,
controller.actions.inprocess) before the full restart from the checkpoint. Only a loop
written for it can rejoin (docs/trainer.md, "In-process rejoin"), so it is opt-in."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RecoverySpec"]


@dataclass(frozen=True)
class RecoverySpec:
    """`recovery:` in a job spec. `in_process`: on a lost node, try the in-process path
    first (survivors rejoin, a spare's ready standby takes the lost ranks); any failure falls
    back to the full restart, with the reason in the incident timeline."""

    in_process: bool = False
