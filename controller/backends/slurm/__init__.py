"""The Slurm backend: Slurm runs the jobs and trainguard remediates them through Slurm's
client commands (backend.py the steps and the sync, cli.py the commands and their
parsers)."""

from trainguard.controller.backends.base import BackendKind
from trainguard.controller.backends.slurm.backend import SlurmBackend, build

KIND = BackendKind(name=SlurmBackend.name, capabilities=SlurmBackend.capabilities, factory=build)

__all__ = ["KIND"]
