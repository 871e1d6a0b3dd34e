"""The torchrun backend (the default): the agents launch torchrun for the jobs submitted to
trainguard, and a drain is trainguard's own."""

from trainguard.controller.backends.base import BackendKind
from trainguard.controller.backends.torchrun.backend import TorchrunBackend, build

KIND = BackendKind(
    name=TorchrunBackend.name, capabilities=TorchrunBackend.capabilities, factory=build
)

__all__ = ["KIND"]
