"""Fixtures for the scheduler backends' unit tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.controller.backends.fake_asg import OLD, FakeAsg
from tests.unit.controller.job_sim import Sim
from trainguard.clock import FakeClock
from trainguard.controller.composition import ActionBackends, Controller
from trainguard.controller.config import ControllerConfig


@pytest.fixture
def cloud(
    core_config: Callable[..., ControllerConfig], core_clock: FakeClock, tmp_path: Path
) -> Iterator[tuple[Sim, FakeAsg, dict[str, Any]]]:
    """A Sim on the aws backend over FakeAsg: n1, n2, n4 on instances of one group. The dict
    holds the overrides the next controller is made with (backend.aws fields under "aws")."""
    asg = FakeAsg()
    made: list[Controller] = []
    settings: dict[str, Any] = {"aws": {}}

    def make(**overrides: Any) -> Controller:
        aws = {"region": "us-east-1", "poll_interval_s": 1.0, **settings["aws"]}
        extra = {k: v for k, v in settings.items() if k != "aws"}
        c = Controller(
            core_config(backend={"kind": "aws", "aws": aws}, **overrides, **extra),
            clock=core_clock,
            backends=ActionBackends(notifiers=[], asg_client=lambda region: asg),  # type: ignore[arg-type,return-value]
        )
        made.append(c)
        return c

    sim = Sim(make, core_clock, tmp_path)
    for node, instance_id in OLD.items():
        sim.add(node, aws_instance_id=instance_id)
    yield sim, asg, settings
    for c in made:
        c.stop()
