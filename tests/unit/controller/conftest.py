"""Shared fixtures for the controller-core unit tests: a Controller on a FakeClock over a
real SQLite file (or a PostgreSQL database, for tests parametrised over `store_backend`),
with recording notifiers and a small rules file; `sim`, a simulated cluster running jobs on
it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.controller.job_sim import Sim
from trainguard.clock import FakeClock
from trainguard.controller.actions.notify import RecordingNotifier
from trainguard.controller.composition import ActionBackends, Controller
from trainguard.controller.config import ControllerConfig
from trainguard.strict import build

CORE_RULES = """
rules:
  - name: gpu_dbe
    scope: gpu
    condition: ecc_uncorrected_volatile_total > 0
    severity: critical
    actions: [notify, drain]
    cooldown: 10m
    summary: uncorrectable ECC errors
  - name: gpu_hot
    scope: gpu
    condition: temperature_celsius > 90
    severity: warning
    actions: [notify]
    summary: GPU hot
  - name: node_silent
    scope: node
    condition: report_age_s > 5
    severity: critical
    actions: [notify]
    summary: node stopped reporting
"""


@pytest.fixture
def core_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def core_config(tmp_path: Path, store_location: str) -> Callable[..., ControllerConfig]:
    """The config maker; the store is SQLite unless the test is parametrised over
    `store_backend` (tests/conftest.py, BOTH_STORES)."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(CORE_RULES)
    store = {"url" if "://" in store_location else "path": store_location}

    def make(**overrides: Any) -> ControllerConfig:
        data: dict[str, Any] = {
            "store": store,
            "rules": [str(rules)],
            "actions": {"backoff_initial_s": 2.0, "backoff_max_s": 16.0, "max_attempts": 3},
        }
        for key, value in overrides.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return build(ControllerConfig, data, source="test")

    return make


@pytest.fixture
def core_notifier() -> RecordingNotifier:
    return RecordingNotifier("rec", min_severity="warning")


@pytest.fixture
def make_core(
    core_config: Callable[..., ControllerConfig],
    core_clock: FakeClock,
    core_notifier: RecordingNotifier,
) -> Iterator[Callable[..., Controller]]:
    made: list[Controller] = []

    def make(*, notifiers: list[Any] | None = None, **overrides: Any) -> Controller:
        c = Controller(
            core_config(**overrides),
            clock=core_clock,
            backends=ActionBackends(
                notifiers=notifiers if notifiers is not None else [core_notifier]
            ),
        )
        made.append(c)
        return c

    yield make
    for c in made:
        try:
            c.stop()
        except Exception:  # already stopped/closed by the test
            pass


@pytest.fixture
def sim(make_core: Callable[..., Controller], core_clock: FakeClock, tmp_path: Path) -> Sim:
    """A simulated cluster (job_sim.Sim): active nodes n1 and n2, spare n3."""
    s = Sim(make_core, core_clock, tmp_path)
    for name in ("n1", "n2"):
        s.add(name)
    s.add("n3", role="spare")
    return s
