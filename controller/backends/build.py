"""Builds the scheduler backend the controller's `backend:` section names, from the
registry."""

from __future__ import annotations

from collections.abc import Callable

from trainguard.clock import Clock
from trainguard.controller.actions.recovery import PhaseObserver
from trainguard.controller.backends.base import BackendDeps, SchedulerBackend
from trainguard.controller.backends.registry import REGISTRY
from trainguard.controller.backends.slurm.cli import SlurmRunner
from trainguard.controller.config import ControllerConfig
from trainguard.controller.jobs import JobManager
from trainguard.controller.livestate import LiveState


def build_backend(
    config: ControllerConfig,
    *,
    live: LiveState,
    jobs: JobManager,
    clock: Clock,
    open_incident_nodes: Callable[[], set[str]],
    observe: PhaseObserver,
    slurm_runner: SlurmRunner | None = None,
) -> SchedulerBackend:
    """The configured backend; `slurm_runner` replaces the real Slurm commands (tests)."""
    kind = REGISTRY.get(config.backend.kind)
    return kind.factory(
        BackendDeps(
            config=config,
            live=live,
            jobs=jobs,
            clock=clock,
            open_incident_nodes=open_incident_nodes,
            observe=observe,
            slurm_runner=slurm_runner,
        )
    )


__all__ = ["build_backend"]
