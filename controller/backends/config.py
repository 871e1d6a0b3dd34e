"""The controller's `backend:` section: which scheduler runs the jobs, and the Slurm
backend's settings. Strict like every config: unknown keys and broken invariants fail at
load with file, key and reason."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from trainguard.strict import Invalid

_RESERVATION = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise Invalid(key, f"must be > 0, got {value}")


@dataclass(frozen=True)
class SlurmBackendConfig:
    # Directory of the Slurm client commands (scontrol, squeue, sinfo, scancel); empty =
    # found on PATH. The controller host needs the slurm-client package and munge's key.
    bin_dir: str = ""
    # slurm.conf for the client commands (exported as SLURM_CONF); empty = Slurm's own
    # default (/etc/slurm/slurm.conf, or configless from DNS).
    slurm_conf: str = ""
    # Seconds one Slurm command may take before the step fails (transient: retried with
    # backoff, then paged). slurmctld answers in milliseconds unless it is overloaded.
    command_timeout_s: float = 20.0
    # How often the node drain states, the spare reservation and the jobs are read from
    # Slurm (sinfo --json, squeue --json, scontrol show reservation), seconds. 5 s keeps
    # `agentctl get nodes` close to `sinfo` at ~3 cheap RPCs per interval.
    sync_interval_s: float = 5.0
    # The reservation that holds the hot spares: general work cannot run on its nodes.
    # trainguard takes a spare out of it when the spare replaces a node (docs/slurm.md).
    spare_reservation: str = "trainguard_spares"
    # Agent node name -> Slurm NodeName where they differ (default: the same name).
    node_names: dict[str, str] = field(default_factory=dict)
    # Steps a job's processes take to leave the drained node after the requeue (KillWait +
    # epilog), seconds; past it the restart fails and pages.
    requeue_timeout_s: float = 120.0
    # A node whose agent is silent is set DOWN, not DRAIN: a dead node cannot finish its
    # job steps, and DOWN is what makes slurmctld stop waiting for them.
    down_silent_nodes: bool = True

    def __post_init__(self) -> None:
        _positive("command_timeout_s", self.command_timeout_s)
        _positive("sync_interval_s", self.sync_interval_s)
        _positive("requeue_timeout_s", self.requeue_timeout_s)
        if not _RESERVATION.fullmatch(self.spare_reservation):
            raise Invalid(
                "spare_reservation",
                f"must match {_RESERVATION.pattern}, got {self.spare_reservation!r}",
            )
        slurm_names = list(self.node_names.values())
        if len(set(slurm_names)) != len(slurm_names):
            raise Invalid("node_names", "two agent nodes map to the same Slurm node")
        for agent, slurm in self.node_names.items():
            if not agent or not slurm or any(c in slurm for c in " ,[]="):
                raise Invalid(f"node_names.{agent}", f"not a Slurm node name: {slurm!r}")


@dataclass(frozen=True)
class BackendConfig:
    # torchrun: jobs submitted to trainguard run as torchrun launched by the agents, and a
    # drain lives in trainguard's store. slurm: Slurm runs the jobs; drain, spares and
    # restart are Slurm's (scontrol drain, a spare reservation, requeue).
    kind: Literal["torchrun", "slurm"] = "torchrun"
    # Only read with kind: slurm.
    slurm: SlurmBackendConfig = field(default_factory=SlurmBackendConfig)


__all__ = ["BackendConfig", "SlurmBackendConfig"]
