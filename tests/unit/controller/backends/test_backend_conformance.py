"""Every scheduler backend passes the conformance suite (tests/conformance/backend_suite.py):
the recording fake (as a torchrun-like and as a scheduler-like backend), the torchrun backend
in a controller over fake job agents (job_sim.Sim), and the Slurm backend in a controller over
the fake Slurm (tests/fakes/slurm.py), and the aws backend (torchrun's jobs on cloud
instances) over the same fake job agents. Each class gives the suite its harness."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.builders import Reporter
from tests.conformance.backend_suite import BackendSuite
from tests.fakes.slurm import FakeSlurm
from tests.unit.controller.job_sim import Sim, running
from trainguard.clock import FakeClock
from trainguard.controller.backends.base import BackendKind, Capability
from trainguard.controller.backends.recording import STEP_CAPABILITIES, RecordingBackend
from trainguard.controller.backends.registry import REGISTRY
from trainguard.controller.composition import ActionBackends, Controller
from trainguard.protocol import RankState

JOB_NODES = ("n1", "n2")
SPARE = "n3"
IDLE = "n4"


class RecordingHarness:
    job_nodes = JOB_NODES
    spare = SPARE
    idle = IDLE
    registered: BackendKind | None = None

    def __init__(self, capabilities: frozenset[Capability]) -> None:
        self.backend = RecordingBackend(
            capabilities=capabilities, nodes=(*JOB_NODES, IDLE), spares=(SPARE,)
        )
        self.clock = FakeClock()

    def now(self) -> float:
        return self.clock.now()

    def start_job(self) -> str:
        self.backend.run_job("job", JOB_NODES)
        return "job"

    def advance(self) -> None:
        self.clock.advance(1.0)

    def node_state(self, node: str) -> str:
        return self.backend.node_states[node]

    def drain_by_others(self, node: str, *, reason: str) -> None:
        self.backend.drain_by_others(node, reason=reason)


class TorchrunHarness:
    job_nodes = JOB_NODES
    spare = SPARE
    idle = IDLE
    registered = REGISTRY.get("torchrun")

    def __init__(self, sim: Sim) -> None:
        self.sim = sim
        sim.add(IDLE)
        self.backend = sim.c.backend

    def now(self) -> float:
        return self.sim.clock.now()

    def start_job(self) -> str:
        self.sim.submit(nodes=list(JOB_NODES))
        self.sim.until(running(self.sim, attempt=1), max_s=5, what="job running")
        return "job"

    def advance(self) -> None:
        self.sim.second()

    def node_state(self, node: str) -> str:
        return self.sim.c.get_node(node).state

    def drain_by_others(self, node: str, *, reason: str) -> None:
        raise AssertionError("torchrun drains live in trainguard")


class AwsHarness(TorchrunHarness):
    """The aws backend runs jobs as the torchrun one does (its own part, cloud replacement, is
    tests/unit/controller/backends/test_cloud_replacement.py)."""

    registered = REGISTRY.get("aws")


class SlurmHarness:
    job_nodes = JOB_NODES
    spare = SPARE
    idle = IDLE
    registered = REGISTRY.get("slurm")

    def __init__(self, c: Controller, slurm: FakeSlurm, clock: FakeClock) -> None:
        self.c = c
        self.slurm = slurm
        self.clock = clock
        self.reporters = {n: Reporter(n) for n in (*JOB_NODES, SPARE, IDLE)}
        self.job: str | None = None
        self.backend = c.backend
        self._report()

    def _report(self) -> None:
        for i, (node, reporter) in enumerate(self.reporters.items()):
            report = reporter.report(now=self.clock.now())
            if self.job is not None and node in JOB_NODES:
                rank = RankState(job=self.job, rank=i, step=20, pid=100 + i, world_size=2)
                report = dataclasses.replace(report, ranks=(rank,))
            self.c.ingest_report(report, actor="a")
        self.c.backend.refresh()  # type: ignore[attr-defined]

    def now(self) -> float:
        return self.clock.now()

    def start_job(self) -> str:
        self.slurm.submit("7", JOB_NODES)
        self.job = "slurm-7"
        self._report()
        return self.job

    def advance(self) -> None:
        self.clock.advance(1.0)
        for cmd in self.c.store.commands.pending():  # the agents' preflights pass
            if cmd.kind == "preflight":
                self.c.store.commands.finish(cmd.id, ok=True, result="preflight passed")
        self._report()

    def node_state(self, node: str) -> str:
        return self.c.get_node(node).state

    def drain_by_others(self, node: str, *, reason: str) -> None:
        self.slurm.admin(node, state="drain", reason=reason, user="nhc")
        self.c.backend.refresh()  # type: ignore[attr-defined]


class TestRecordingBackend(BackendSuite):
    """The fake as the torchrun backend behaves: every step, local drains, shrink."""

    @pytest.fixture
    def harness(self) -> RecordingHarness:
        return RecordingHarness(STEP_CAPABILITIES | {Capability.SHRINK})


class TestRecordingSchedulerBackend(BackendSuite):
    """The fake as a scheduler behaves: drains in the scheduler, its jobs shown, no grow."""

    @pytest.fixture
    def harness(self) -> RecordingHarness:
        return RecordingHarness(
            (STEP_CAPABILITIES - {Capability.GROW})
            | {Capability.SCHEDULER_SIDE_DRAIN, Capability.EXTERNAL_JOB_VIEWS}
        )


class TestTorchrunBackend(BackendSuite):
    @pytest.fixture
    def harness(self, sim: Sim) -> TorchrunHarness:
        return TorchrunHarness(sim)


class TestAwsBackend(BackendSuite):
    @pytest.fixture
    def harness(
        self, make_core: Callable[..., Controller], core_clock: FakeClock, tmp_path: Path
    ) -> AwsHarness:
        aws = functools.partial(make_core, backend={"kind": "aws", "aws": {"region": "us-east-1"}})
        sim = Sim(aws, core_clock, tmp_path)
        for name in JOB_NODES:
            sim.add(name)
        sim.add(SPARE, role="spare")
        return AwsHarness(sim)


class TestSlurmBackend(BackendSuite):
    @pytest.fixture
    def harness(
        self, core_config: Callable[..., Any], core_clock: FakeClock
    ) -> Iterator[SlurmHarness]:
        slurm = FakeSlurm((*JOB_NODES, SPARE, IDLE), spares=[SPARE])
        c = Controller(
            core_config(backend={"kind": "slurm"}),
            clock=core_clock,
            backends=ActionBackends(notifiers=[], slurm_runner=slurm),
        )
        yield SlurmHarness(c, slurm, core_clock)
        c.stop()
