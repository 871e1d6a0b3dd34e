"""The scheduler backend interface: where jobs run, as every remediation step sees it.

The remediation flow is one flow (notify -> proactive checkpoint -> drain -> hot spare ->
restart) whatever runs the jobs; each step asks the controller's backend. A backend drains
and undrains nodes (it is the drain step's DrainBackend), runs the job steps, and shows the
jobs it knows beyond trainguard's own job table. Implementations: controller.backends.
torchrun (the agents launch torchrun; the default) and controller.backends.slurm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from trainguard.controller.actions.base import ActionContext, Outcome
from trainguard.controller.actions.drain import DrainState
from trainguard.controller.actions.kinds import job_step_kinds
from trainguard.controller.views import JobView

# The job steps a backend performs: the action kinds the table marks `job_step`.
JOB_STEP_KINDS = job_step_kinds()


class SchedulerBackend(Protocol):
    """What the remediation steps ask of the system that runs the jobs."""

    name: str  # "torchrun" | "slurm"

    # --- nodes (the drain / undrain steps; controller.actions.drain.DrainBackend) ---------

    def drain(
        self,
        node: str,
        *,
        reason: str,
        key: str,
        rule: str | None = None,
        incident_id: int | None = None,
    ) -> tuple[DrainState, dict[str, Any]]:
        """Take the node out of scheduling; the state reached and the progress to poll with."""

    def poll(self, node: str, *, key: str, progress: dict[str, Any]) -> DrainState: ...

    def undrain(self, node: str, *, key: str, force: bool = False) -> None:
        """Back into service. A backend that shares the node with others (Slurm) undoes only
        what trainguard did unless `force`."""

    # --- jobs (one method per step kind in JOB_STEP_KINDS) --------------------------------

    def checkpoint(self, ctx: ActionContext) -> Outcome: ...

    def replace(self, ctx: ActionContext) -> Outcome: ...

    def restart(self, ctx: ActionContext) -> Outcome: ...

    def rollback(self, ctx: ActionContext) -> Outcome: ...

    def stop(self, ctx: ActionContext) -> Outcome: ...

    def collect_stacks(self, ctx: ActionContext) -> Outcome: ...

    def grow(self, ctx: ActionContext) -> Outcome:
        """Bring a job that runs shrunk back to its full size on the spares the step names
        (controller.growplan plans it); a backend that cannot answers `skipped`."""

    def job_views(self, *, now: float) -> list[JobView]:
        """Jobs the scheduler runs that trainguard's job table does not hold (Slurm jobs)."""

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start background work (the Slurm backend's sync); idempotent."""

    def close(self) -> None: ...


@dataclass
class BackendStep:
    """The action handler of one job step kind: it asks the controller's backend."""

    backend: SchedulerBackend
    kind: str
    remediation: bool = True

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True  # every backend step keeps its progress and derives its ids from its key

    def run(self, ctx: ActionContext) -> Outcome:
        step: Any = getattr(self.backend, self.kind)
        outcome: Outcome = step(ctx)
        return outcome


def step_handlers(backend: SchedulerBackend) -> list[BackendStep]:
    """A handler per job step kind, for HandlerRegistry.register."""
    return [BackendStep(backend, kind) for kind in JOB_STEP_KINDS]


__all__ = ["JOB_STEP_KINDS", "BackendStep", "SchedulerBackend", "step_handlers"]
