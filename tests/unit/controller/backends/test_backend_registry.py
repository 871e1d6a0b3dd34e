"""The backend registry: every kind the config accepts is registered, each with the
capabilities its backend class declares, every job step kind needs one capability, and a
step whose capability the backend lacks answers `skipped` without asking the backend."""

from __future__ import annotations

from typing import get_args, get_type_hints

import pytest

from trainguard.controller.backends.base import (
    JOB_STEP_KINDS,
    STEP_CAPABILITY,
    BackendStep,
    Capability,
)
from trainguard.controller.backends.config import BackendConfig
from trainguard.controller.backends.registry import REGISTRY, BackendRegistry
from trainguard.controller.backends.slurm import KIND as SLURM
from trainguard.controller.backends.torchrun import KIND as TORCHRUN


def test_every_kind_the_config_accepts_is_registered() -> None:
    accepted = get_args(get_type_hints(BackendConfig)["kind"])
    assert sorted(accepted) == list(REGISTRY.names())


def test_every_job_step_kind_needs_one_capability() -> None:
    assert set(STEP_CAPABILITY) == set(JOB_STEP_KINDS)
    assert all(cap.value == kind for kind, cap in STEP_CAPABILITY.items())


def test_only_the_torchrun_backend_grows_and_only_slurm_drains_in_the_scheduler() -> None:
    assert Capability.GROW in REGISTRY.capabilities("torchrun")
    assert Capability.GROW not in REGISTRY.capabilities("slurm")
    assert Capability.SCHEDULER_SIDE_DRAIN in REGISTRY.capabilities("slurm")
    assert Capability.SCHEDULER_SIDE_DRAIN not in REGISTRY.capabilities("torchrun")


def test_an_unknown_kind_or_a_second_registration_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown backend kind 'lsf'"):
        REGISTRY.get("lsf")
    registry = BackendRegistry()
    registry.register(TORCHRUN)
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(TORCHRUN)
    registry.register(SLURM)
    assert registry.names() == ("slurm", "torchrun")


def test_a_step_without_its_capability_is_skipped_without_asking_the_backend() -> None:
    asked: list[object] = []
    step = BackendStep(kind="grow", step=asked.append, capable=False, backend_name="slurm")  # type: ignore[arg-type]
    outcome = step.run(None)  # type: ignore[arg-type]
    assert (
        outcome.skipped and outcome.message == "skipped: grow is not supported by the slurm backend"
    )
    assert asked == []
