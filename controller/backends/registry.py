"""The scheduler backends by kind: each registered with its factory and its declared
capabilities (controller.backends.base.Capability). build.py builds the configured one from
here; a new backend is a package with a KIND row registered below, and starts from the
conformance suite (tests/conformance/backend_suite.py)."""

from __future__ import annotations

from trainguard.controller.backends import aws, slurm, torchrun
from trainguard.controller.backends.base import BackendKind, Capability


class BackendRegistry:
    """`backend.kind` name -> BackendKind."""

    def __init__(self) -> None:
        self._kinds: dict[str, BackendKind] = {}

    def register(self, kind: BackendKind) -> None:
        if kind.name in self._kinds:
            raise ValueError(f"backend kind {kind.name!r} is registered twice")
        self._kinds[kind.name] = kind

    def get(self, name: str) -> BackendKind:
        kind = self._kinds.get(name)
        if kind is None:
            known = ", ".join(sorted(self._kinds))
            raise ValueError(f"unknown backend kind {name!r} (known: {known})")
        return kind

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._kinds))

    def capabilities(self, name: str) -> frozenset[Capability]:
        return self.get(name).capabilities


REGISTRY = BackendRegistry()
REGISTRY.register(torchrun.KIND)
REGISTRY.register(slurm.KIND)
REGISTRY.register(aws.KIND)

__all__ = ["REGISTRY", "BackendRegistry"]
