"""Shared fixtures for the controller-core unit tests: a Controller on a FakeClock over a
real SQLite file, with recording notifiers and a small rules file."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.clock import FakeClock
from trainguard.controller.actions.notify import RecordingNotifier
from trainguard.controller.config import ControllerConfig
from trainguard.controller.core import ActionBackends, Controller
from trainguard.model import GpuSample
from trainguard.protocol import Event, JobProcess, Report
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


def gpu(index: int = 0, *, dbe: int = 0, temp: float = 50.0) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        pci_bus_id=f"0000:{index:02x}:00.0",
        name="H100",
        temperature_celsius=temp,
        ecc_uncorrected_volatile_total=dbe,
    )


class Reporter:
    """Builds successive reports for one node the way an agent would."""

    def __init__(self, node: str, *, instance: str = "inst-1", role: str | None = None) -> None:
        self.node = node
        self.instance = instance
        self.role = role
        self.seq = 0

    def report(
        self,
        *,
        now: float,
        dbe: int = 0,
        temp: float = 50.0,
        events: tuple[Event, ...] = (),
        job: str | None = None,
    ) -> Report:
        self.seq += 1
        jobs = (JobProcess(job=job, attempt=1, state="running", pid=100),) if job else ()
        return Report(
            node=self.node,
            instance=self.instance,
            seq=self.seq,
            sent_at=now,
            role_hint=self.role,  # type: ignore[arg-type]
            gpus=(gpu(0, dbe=dbe, temp=temp),),
            jobs=jobs,
            events=events,
        )


@pytest.fixture
def core_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def core_config(tmp_path: Path) -> Callable[..., ControllerConfig]:
    rules = tmp_path / "rules.yaml"
    rules.write_text(CORE_RULES)

    def make(**overrides: Any) -> ControllerConfig:
        data: dict[str, Any] = {
            "store": {"path": str(tmp_path / "controller.db")},
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
