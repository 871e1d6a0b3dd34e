"""A simulated cluster for the job-remediation tests: a Controller on a FakeClock with
FakeJobAgents fed through ingest_report, stepped one simulated second at a time; the rules
it runs (JOB_RULES) and `running`, the check tests wait on. The `sim` fixture (conftest.py)
builds one with nodes n1, n2 and spare n3."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.fakes.job_agent import FakeJobAgent, SharedCheckpoints
from trainguard.clock import FakeClock
from trainguard.controller.composition import Controller
from trainguard.controller.jobs import JobSpec
from trainguard.strict import build

JOB_RULES = """
rules:
  - name: gpu_dbe
    scope: gpu
    condition: ecc_uncorrected_volatile_total > 0
    severity: critical
    actions: [notify, checkpoint, drain, replace, restart]
    summary: uncorrectable ECC errors
  - name: node_silent
    scope: node
    condition: report_age_s > 5 and role == "active" and state == "active"
    severity: critical
    actions: [notify, checkpoint, drain, replace, restart]
    summary: node silent
  - name: job_process_failed
    scope: job
    condition: state == "crashed"
    severity: critical
    actions: [notify, replace, restart]
    summary: training process exited unexpectedly
  - name: nan_loss
    scope: rank
    condition: present(loss) and not finite(loss)
    severity: critical
    actions: [notify, rollback]
    summary: NaN loss
"""


class Sim:
    RULES = JOB_RULES  # the rules file's text (a subclass may run others)

    def __init__(self, make_core: Callable[..., Controller], clock: FakeClock, tmp: Path) -> None:
        rules = tmp / "job_rules.yaml"
        rules.write_text(self.RULES)
        self.make_core = make_core
        self.clock = clock
        self.rules = str(rules)
        self.c = self.new_controller()
        self.ckpts = SharedCheckpoints()
        self.agents: dict[str, FakeJobAgent] = {}

    def new_controller(self) -> Controller:
        return self.make_core(
            rules=[self.rules],
            jobs={
                "checkpoint_timeout_s": 5.0,
                "stop_grace_s": 2.0,
                "stop_timeout_s": 5.0,
                "spare_wait_s": 10.0,
                "progress_timeout_s": 60.0,
                "start_timeout_s": 90.0,
            },
            # spares are preflighted when a job needs one; tests of keep_warm turn this on
            lifecycle={"spare_preflight_ahead": False},
        )

    def add(self, name: str, *, role: str = "active", **labels: str) -> FakeJobAgent:
        agent = FakeJobAgent(
            name, ckpts=self.ckpts, role=role, labels={"address": f"10.0.0.{len(self.agents)}"}
        )
        agent.labels.update(labels)
        self.agents[name] = agent
        self._report(agent)
        if role == "spare":  # a report's role hint makes no spare: an operator does
            self.c.set_role(name, role="spare", actor="operator")
        return agent

    def _report(self, agent: FakeJobAgent) -> None:
        if not agent.silent:
            agent.acked(self.c.ingest_report(agent.report(now=self.clock.now()), actor="t"))

    def second(self, n: int = 1) -> None:
        for _ in range(n):
            self.clock.advance(1.0)
            for agent in self.agents.values():
                agent.train()
                self._report(agent)
            self.c.tick()

    def until(self, cond: Callable[[], bool], *, max_s: int, what: str) -> None:
        for _ in range(max_s):
            if cond():
                return
            self.second()
        assert cond(), f"not within {max_s} simulated s: {what}"

    def submit(self, **spec: Any) -> None:
        data = {"name": "job", "command": ["examples/train.py", "--steps", "1000"], **spec}
        self.c.submit_job(build(JobSpec, data, source="test"), actor="ops")

    def cmds(self, node: str, kind: str) -> list[dict[str, Any]]:
        return [c.args for c in self.agents[node].commands if c.kind == kind]

    def incident(self, rule: str) -> Any:
        found = [i for i in self.c.list_incidents() if i.rule == rule]
        assert found, f"no {rule} incident"
        return self.c.get_incident(found[0].id)


def running(sim: Sim, *, attempt: int) -> Callable[[], bool]:
    def check() -> bool:
        job = sim.c.get_job("job")
        return job.state == "running" and job.attempt == attempt

    return check
