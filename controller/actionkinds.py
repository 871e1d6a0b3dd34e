"""The action kinds: one enum, one row of properties per kind.

Every question the controller asks about a kind of step (may a rule name it, does it take
capacity from a job, may the job's processes exit while it runs, does the scheduler backend
perform it, does it hold the plan) is answered here, from `_ROWS`. Stored action rows keep
the member's value (`ActionKind.DRAIN.value == "drain"`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ActionKind(str, Enum):
    """A kind of action step. Declaration order is the order rule files list them in."""

    NOTIFY = "notify"
    PAGE = "page"
    CHECKPOINT = "checkpoint"
    DRAIN = "drain"
    REPLACE = "replace"
    RESTART = "restart"
    ROLLBACK = "rollback"
    STOP = "stop"
    COLLECT_STACKS = "collect_stacks"
    UNDRAIN = "undrain"  # an operator's (agentctl undrain), never a rule's
    GROW = "grow"  # planned by the tick (controller.growplan), never by a rule
    VALIDATE = "validate"  # a preflight, then back into service (agentctl node return)
    RETIRE = "retire"  # out for good, with the reason (agentctl node retire)
    DIAGNOSE = "diagnose"  # a preflight on a node drained for hardware (lifecycle.auto_repair)
    REPAIR = "repair"  # the GPU reset or node reboot its diagnosis chose (lifecycle.auto_repair)
    # an auto job's new checkpoint interval (controller.ckptauto), never a rule's: the row is
    # the decision, written before its commands and never run by the worker
    CHECKPOINT_INTERVAL = "checkpoint_interval"
    # a retired node's cloud instance terminated through its Auto Scaling Group, which
    # launches the replacement (planned by the tick with Capability.CLOUD_REPLACE)
    TERMINATE_INSTANCE = "terminate_instance"

    @classmethod
    def parse(cls, kind: str) -> ActionKind | None:
        """The member a stored or planned kind string names; None for one outside the table
        (a row written by a newer controller, a test's own kind)."""
        try:
            return cls(kind)
        except ValueError:
            return None

    @property
    def _info(self) -> _KindRow:
        return _ROWS[self]

    @property
    def in_rules(self) -> bool:
        """A rule file may list it under `actions:`."""
        return self._info.in_rules

    @property
    def remediation(self) -> bool:
        """Runs in plan order and a failure cancels the remediation steps after it; a
        notification is not remediation and never holds the plan up."""
        return self._info.remediation

    @property
    def disruptive(self) -> bool:
        """Takes capacity away from a job: gated by the budget, the breaker and stale data."""
        return self._info.disruptive

    @property
    def stops_job(self) -> bool:
        """Its work may make the job's processes exit, so an exit while it is open is no
        crash (controller.jobs)."""
        return self._info.stops_job

    @property
    def removes_node(self) -> bool:
        """Takes a node out of its job: a correlated decision asking for one gets a drain."""
        return self._info.removes_node

    @property
    def job_step(self) -> bool:
        """A job step the scheduler backend performs (controller.backends)."""
        return self._info.job_step

    @property
    def capability(self) -> str | None:
        """The value of the backend capability a job step needs (a backend without it answers
        the step `skipped`); None for a kind every backend performs (drain) or none is asked
        for (notify)."""
        return self._info.capability


@dataclass(frozen=True)
class _KindRow:
    in_rules: bool
    remediation: bool
    disruptive: bool
    stops_job: bool
    removes_node: bool
    job_step: bool
    capability: str | None


def _row(
    *,
    in_rules: bool = True,
    remediation: bool = True,
    disruptive: bool = False,
    stops_job: bool = False,
    removes_node: bool = False,
    job_step: bool = False,
    capability: str | None = None,
) -> _KindRow:
    return _KindRow(
        in_rules=in_rules,
        remediation=remediation,
        disruptive=disruptive,
        stops_job=stops_job,
        removes_node=removes_node,
        job_step=job_step,
        capability=capability,
    )


_K = ActionKind
_ROWS: dict[ActionKind, _KindRow] = {
    _K.NOTIFY: _row(remediation=False),
    # a rule's `page` is planned as a notify row with page=True; no row has this kind
    _K.PAGE: _row(remediation=False),
    _K.CHECKPOINT: _row(stops_job=True, job_step=True, capability="checkpoint"),
    _K.DRAIN: _row(disruptive=True, stops_job=True, removes_node=True),
    _K.REPLACE: _row(
        disruptive=True, stops_job=True, removes_node=True, job_step=True, capability="replace"
    ),
    _K.RESTART: _row(disruptive=True, stops_job=True, job_step=True, capability="restart"),
    _K.ROLLBACK: _row(disruptive=True, stops_job=True, job_step=True, capability="rollback"),
    _K.STOP: _row(disruptive=True, stops_job=True, job_step=True, capability="stop"),
    _K.COLLECT_STACKS: _row(job_step=True, capability="collect_stacks"),
    _K.UNDRAIN: _row(in_rules=False),
    _K.GROW: _row(in_rules=False, stops_job=True, job_step=True, capability="grow"),
    _K.VALIDATE: _row(in_rules=False),
    _K.RETIRE: _row(in_rules=False),
    _K.DIAGNOSE: _row(in_rules=False),
    _K.REPAIR: _row(in_rules=False),
    _K.CHECKPOINT_INTERVAL: _row(in_rules=False, remediation=False),
    _K.TERMINATE_INSTANCE: _row(in_rules=False, capability="cloud_replace"),
}


def rule_actions() -> tuple[str, ...]:
    """The kinds a rule may list, in table order (the loader's allowed list)."""
    return tuple(k.value for k in ActionKind if k.in_rules)


def job_step_kinds() -> tuple[str, ...]:
    """The kinds the scheduler backend performs, in table order."""
    return tuple(k.value for k in ActionKind if k.job_step)


__all__ = ["ActionKind", "job_step_kinds", "rule_actions"]
