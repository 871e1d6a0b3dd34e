"""The scheduler backend interface: where jobs run, as every remediation step sees it, with
the capabilities a backend declares and the step handlers that dispatch to it.

The remediation flow is one flow (notify -> proactive checkpoint -> drain -> hot spare ->
restart) whatever runs the jobs; each step asks the controller's backend. A backend drains
and undrains nodes (it is the drain step's DrainBackend), runs the job steps, and shows the
jobs it knows beyond trainguard's own job table. Implementations are packages
(controller.backends.torchrun, the default, and controller.backends.slurm) registered with
their capabilities in controller.backends.registry; code outside a backend asks a
capability, never a backend's name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from trainguard.controller.actionkinds import ActionKind, job_step_kinds
from trainguard.controller.actions.base import ActionContext, Outcome
from trainguard.controller.actions.drain import DrainState
from trainguard.controller.actions.sparecheck import SparePreflight, spare_preflight
from trainguard.controller.lemons import LemonPolicy
from trainguard.controller.views import JobView
from trainguard.kinds import CommandKind

if TYPE_CHECKING:  # types only: the factories' inputs import the controller's core modules
    from trainguard.clock import Clock
    from trainguard.controller.actions.recovery import PhaseObserver
    from trainguard.controller.backends.slurm.cli import SlurmRunner
    from trainguard.controller.config import ControllerConfig
    from trainguard.controller.jobs import JobManager
    from trainguard.controller.livestate import LiveState

# The job steps a backend performs: the action kinds the table marks `job_step`.
JOB_STEP_KINDS = job_step_kinds()


class Capability(enum.Enum):
    """What a backend can do, declared with it in the registry. A job step whose capability
    the backend lacks answers `skipped`; the rest say how the steps behave."""

    # --- the job steps (STEP_CAPABILITY maps each JOB_STEP_KINDS kind to one) -------------
    CHECKPOINT = "checkpoint"
    REPLACE = "replace"
    RESTART = "restart"
    ROLLBACK = "rollback"
    STOP = "stop"
    COLLECT_STACKS = "collect_stacks"
    GROW = "grow"  # a shrunk job grows back to full size: controller.growplan plans only these
    # --- how the steps behave ---------------------------------------------------------------
    SHRINK = "shrink"  # replace/restart may place a job on fewer nodes (JobSpec.shrink)
    REQUEUE = "requeue"  # restart requeues the scheduler's job; trainguard starts no attempt
    # the drain is the scheduler's: done at once (poll answers drained), a drain made by
    # someone else is left alone and undone only with force
    SCHEDULER_SIDE_DRAIN = "scheduler_side_drain"
    # job_views shows jobs the scheduler runs beyond trainguard's job table
    EXTERNAL_JOB_VIEWS = "external_job_views"
    # --- the nodes' machines ------------------------------------------------------------------
    # a retired node's cloud instance is terminated through its Auto Scaling Group, which
    # launches a replacement (the terminate_instance step; controller.backends.aws)
    CLOUD_REPLACE = "cloud_replace"


# Job step kind -> the capability it needs.
STEP_CAPABILITY: dict[str, Capability] = {
    kind.value: Capability(kind.capability)
    for kind in ActionKind
    if kind.job_step and kind.capability is not None
}


class SchedulerBackend(Protocol):
    """What the remediation steps ask of the system that runs the jobs."""

    name: str  # the registry's kind (backend.kind in the config)
    capabilities: frozenset[Capability]

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
        """Back into service. A backend that shares the node with others
        (SCHEDULER_SIDE_DRAIN) undoes only what trainguard did unless `force`."""

    def return_to_pool(self, node: str, *, role: str) -> None:
        """The scheduler's side of a node the lifecycle brings back in `role` (spare or
        active; the node table already holds the role): Slurm puts a spare into its spare
        reservation (and takes an active node out of it); a backend whose pools are the node
        table's roles does nothing. Idempotent: a validation re-run after a crash calls it
        again."""

    # --- jobs (one method per step kind in JOB_STEP_KINDS) --------------------------------

    def checkpoint(self, ctx: ActionContext) -> Outcome: ...

    def replace(self, ctx: ActionContext) -> Outcome: ...

    def restart(self, ctx: ActionContext) -> Outcome: ...

    def rollback(self, ctx: ActionContext) -> Outcome: ...

    def stop(self, ctx: ActionContext) -> Outcome: ...

    def collect_stacks(self, ctx: ActionContext) -> Outcome: ...

    def grow(self, ctx: ActionContext) -> Outcome:
        """Bring a job that runs shrunk back to its full size on the spares the step names
        (controller.growplan plans it); a backend without Capability.GROW answers
        `skipped`."""

    def job_views(self, *, now: float) -> list[JobView]:
        """Jobs the scheduler runs that trainguard's job table does not hold (with
        Capability.EXTERNAL_JOB_VIEWS; else none)."""

    def job_nodes(self, job: str) -> frozenset[str] | None:
        """The nodes the scheduler runs (or last ran) job `job` on, for the report path's
        scope check (controller.jobscope); None: not a job the scheduler runs beyond the job
        table. Called under the live state's lock on every report naming a job outside the
        job table: a dict lookup, no lock of the backend's own."""

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start background work (the Slurm backend's sync); idempotent."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class BackendDeps:
    """What a backend factory may build from: the controller's config and the parts of the
    controller every backend shares. `slurm_runner` replaces the real Slurm commands
    (tests)."""

    config: ControllerConfig
    live: LiveState
    jobs: JobManager
    clock: Clock
    open_incident_nodes: Callable[[], set[str]]
    observe: PhaseObserver
    slurm_runner: SlurmRunner | None = None

    def spare_check(self) -> SparePreflight:
        """The spare preflight gate (controller.actions.sparecheck) over the live node
        state, the nodes' last preflights and the lemon verdict: every backend's spare pick
        goes through it."""
        live = self.live
        return spare_preflight(
            self.config.lifecycle,
            ops=live,
            last_preflight=lambda node: live.store.commands.last_done(
                node, kind=CommandKind.PREFLIGHT.value
            ),
            lemon=LemonPolicy(
                store=live.store, config=self.config.lifecycle, now=self.clock.now
            ).verdict,
        )


@dataclass(frozen=True)
class BackendKind:
    """One row of the backend registry: the `backend.kind` name, what the backend can do,
    and how to build it."""

    name: str
    capabilities: frozenset[Capability]
    factory: Callable[[BackendDeps], SchedulerBackend]


def step_methods(backend: SchedulerBackend) -> dict[str, Callable[[ActionContext], Outcome]]:
    """Job step kind -> the backend's method for it (one entry per JOB_STEP_KINDS kind)."""
    return {
        "checkpoint": backend.checkpoint,
        "replace": backend.replace,
        "restart": backend.restart,
        "rollback": backend.rollback,
        "stop": backend.stop,
        "collect_stacks": backend.collect_stacks,
        "grow": backend.grow,
    }


@dataclass
class BackendStep:
    """The action handler of one job step kind: it calls the backend's method for the kind,
    or answers `skipped` when the backend does not declare the kind's capability."""

    kind: str
    step: Callable[[ActionContext], Outcome]
    capable: bool
    backend_name: str
    remediation: bool = True

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True  # every backend step keeps its progress and derives its ids from its key

    def run(self, ctx: ActionContext) -> Outcome:
        if not self.capable:
            return Outcome(
                message=f"skipped: {self.kind} is not supported by the {self.backend_name} backend",
                skipped=True,
            )
        return self.step(ctx)


def step_handlers(backend: SchedulerBackend) -> list[BackendStep]:
    """A handler per job step kind, for HandlerRegistry.register."""
    methods = step_methods(backend)
    return [
        BackendStep(
            kind=kind,
            step=methods[kind],
            capable=STEP_CAPABILITY[kind] in backend.capabilities,
            backend_name=backend.name,
        )
        for kind in JOB_STEP_KINDS
    ]


__all__ = [
    "JOB_STEP_KINDS",
    "STEP_CAPABILITY",
    "BackendDeps",
    "BackendKind",
    "BackendStep",
    "Capability",
    "SchedulerBackend",
    "step_handlers",
    "step_methods",
]
