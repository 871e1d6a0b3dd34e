"""Builds the scheduler backend the controller's `backend:` section names."""

from __future__ import annotations

from collections.abc import Callable

from trainguard.clock import Clock
from trainguard.controller.actions.drain import LocalDrainBackend
from trainguard.controller.actions.jobsteps import PhaseObserver
from trainguard.controller.backends.base import SchedulerBackend
from trainguard.controller.backends.slurm import SlurmBackend
from trainguard.controller.backends.slurmcli import SlurmCli, SlurmCommands, SlurmRunner
from trainguard.controller.backends.torchrun import TorchrunBackend
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
    if config.backend.kind == "slurm":
        sc = config.backend.slurm
        runner = slurm_runner or SlurmCli(
            bin_dir=sc.bin_dir, slurm_conf=sc.slurm_conf, timeout_s=sc.command_timeout_s
        )
        return SlurmBackend(
            config=sc,
            commands=SlurmCommands(runner),
            live=live,
            jobs=jobs,
            clock=clock,
            node_silent_after_s=config.node_silent_after_s,
            spare_wait_s=config.jobs.spare_wait_s,
            progress_timeout_s=config.jobs.progress_timeout_s,
            open_incident_nodes=open_incident_nodes,
            observe=observe,
        )
    return TorchrunBackend(
        drain=LocalDrainBackend(
            live,
            stop_grace_s=config.actions.drain_stop_grace_s,
            silent_after_s=config.node_silent_after_s,
            presence=jobs.presence,
        ),
        jobs=jobs,
        open_incident_nodes=open_incident_nodes,
        observe=observe,
    )


__all__ = ["build_backend"]
