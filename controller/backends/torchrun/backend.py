"""The torchrun backend: jobs submitted to trainguard run as torchrun launched by the agents
(controller.jobs + the agents' start_job/stop_job), and a drain is trainguard's own (node
state in the store, `stop_job` to the node's agent). It wraps the local drain backend and the
job step handlers of controller.actions.jobsteps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from trainguard.controller.actions.base import ActionContext, Outcome
from trainguard.controller.actions.drain import DrainState, LocalDrainBackend
from trainguard.controller.actions.inprocess import InProcessRecovery
from trainguard.controller.actions.jobsteps import (
    CheckpointHandler,
    CollectStacksHandler,
    GrowHandler,
    ReplaceHandler,
    RestartHandler,
    StopHandler,
)
from trainguard.controller.actions.recovery import PhaseObserver
from trainguard.controller.actions.sparecheck import SparePreflight
from trainguard.controller.actions.standbyswap import StandbySwap
from trainguard.controller.backends.base import BackendDeps, Capability
from trainguard.controller.jobs import JobManager
from trainguard.controller.views import JobView


class TorchrunBackend:
    """SchedulerBackend over LocalDrainBackend and the torchrun job steps."""

    name = "torchrun"
    capabilities = frozenset(
        {
            Capability.CHECKPOINT,
            Capability.REPLACE,
            Capability.RESTART,
            Capability.ROLLBACK,
            Capability.STOP,
            Capability.COLLECT_STACKS,
            Capability.GROW,
            Capability.SHRINK,
        }
    )

    def __init__(
        self,
        *,
        drain: LocalDrainBackend,
        jobs: JobManager,
        open_incident_nodes: Callable[[], set[str]],
        observe: PhaseObserver,
        spare_check: SparePreflight | None = None,
    ) -> None:
        self._drain = drain
        self._checkpoint = CheckpointHandler(jobs)
        self._replace = ReplaceHandler(
            jobs,
            open_incident_nodes,
            spare_check=spare_check,
            standby_swap=StandbySwap(jobs, spare_check),
        )
        self._restart = RestartHandler(
            jobs,
            observe,
            open_incident_nodes=open_incident_nodes,
            spare_check=spare_check,
            in_process=InProcessRecovery(jobs, observe),
        )
        self._rollback = RestartHandler(
            jobs,
            observe,
            kind="rollback",
            open_incident_nodes=open_incident_nodes,
            spare_check=spare_check,
        )
        self._stop = StopHandler(jobs)
        self._stacks = CollectStacksHandler(jobs)
        self._grow = GrowHandler(jobs, open_incident_nodes, spare_check=spare_check)

    def drain(
        self,
        node: str,
        *,
        reason: str,
        key: str,
        rule: str | None = None,
        incident_id: int | None = None,
    ) -> tuple[DrainState, dict[str, Any]]:
        return self._drain.drain(node, reason=reason, key=key)

    def poll(self, node: str, *, key: str, progress: dict[str, Any]) -> DrainState:
        return self._drain.poll(node, key=key, progress=progress)

    def undrain(self, node: str, *, key: str, force: bool = False) -> None:
        self._drain.undrain(node, key=key)

    def return_to_pool(self, node: str, *, role: str) -> None:
        pass  # the spares are the node table's role spare: nothing of the scheduler's to move

    def checkpoint(self, ctx: ActionContext) -> Outcome:
        return self._checkpoint.run(ctx)

    def replace(self, ctx: ActionContext) -> Outcome:
        return self._replace.run(ctx)

    def restart(self, ctx: ActionContext) -> Outcome:
        return self._restart.run(ctx)

    def rollback(self, ctx: ActionContext) -> Outcome:
        return self._rollback.run(ctx)

    def stop(self, ctx: ActionContext) -> Outcome:
        return self._stop.run(ctx)

    def collect_stacks(self, ctx: ActionContext) -> Outcome:
        return self._stacks.run(ctx)

    def grow(self, ctx: ActionContext) -> Outcome:
        return self._grow.run(ctx)

    def job_views(self, *, now: float) -> list[JobView]:
        return []  # every torchrun job is in the job table

    def job_nodes(self, job: str) -> frozenset[str] | None:
        return None  # every torchrun job is in the job table

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


_B = TypeVar("_B", bound="TorchrunBackend")


def build(deps: BackendDeps) -> TorchrunBackend:
    """The registry's factory: the local drain over the controller's live node state."""
    return build_as(TorchrunBackend, deps)


def build_as(cls: type[_B], deps: BackendDeps) -> _B:
    """A TorchrunBackend (or a backend built on it, the aws one) over the controller's parts."""
    config = deps.config
    return cls(
        drain=LocalDrainBackend(
            deps.live,
            stop_grace_s=config.actions.drain_stop_grace_s,
            silent_after_s=config.node_silent_after_s,
            presence=deps.jobs.presence,
            grace_of=deps.jobs.drain_grace_s,
        ),
        jobs=deps.jobs,
        open_incident_nodes=deps.open_incident_nodes,
        observe=deps.observe,
        spare_check=deps.spare_check(),
    )


__all__ = ["TorchrunBackend", "build", "build_as"]
