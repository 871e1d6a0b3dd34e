"""`ReportResponse.report_in_s`: the controller asks a node for its next report sooner while
it acts on it (a command on the answer, then for actions.fast_reports_window_s), and asks
the spares while an incident's remediation step is open; otherwise the agent's own
interval (None). On a FakeClock through Controller.ingest_report (job_sim.Sim)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.builders import gpu
from tests.unit.controller.job_sim import Sim, running
from trainguard.clock import FakeClock
from trainguard.command_args import CheckpointArgs
from trainguard.controller.composition import Controller
from trainguard.controller.config import ActionsConfig, ControllerConfig
from trainguard.strict import ConfigError

FAST_S = ActionsConfig.fast_reports_s
WINDOW_S = ActionsConfig.fast_reports_window_s


def _answer(sim: Sim, node: str) -> tuple[float | None, int]:
    agent = sim.agents[node]
    resp = sim.c.ingest_report(agent.report(now=sim.clock.now()), actor="t")
    agent.acked(resp)
    return resp.report_in_s, len(resp.commands)


def test_fast_while_a_command_rides_on_the_answer_then_for_the_window_then_not(sim: Sim) -> None:
    assert _answer(sim, "n1") == (None, 0)  # nothing to do: the agent's interval
    sim.submit(nodes=["n1", "n2"])
    sim.c.tick()  # the start_job commands are queued
    assert _answer(sim, "n1") == (FAST_S, 1)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    assert _answer(sim, "n1") == (FAST_S, 0)  # answered, but within the window
    sim.second(int(WINDOW_S) + 1)
    assert _answer(sim, "n1") == (None, 0)
    assert _answer(sim, "n3") == (None, 0)  # a spare, no remediation open


def test_spares_are_fast_while_a_remediation_step_is_open_and_not_after(sim: Sim) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(int(WINDOW_S) + 1)
    assert _answer(sim, "n3")[0] is None and _answer(sim, "n2")[0] is None
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.second()  # the DBE's incident opens; its checkpoint step is open
    assert sim.incident("gpu_dbe")
    assert _answer(sim, "n3")[0] == FAST_S  # its standby may be assigned
    sim.until(running(sim, attempt=2), max_s=60, what="the job restarted onto n3")
    sim.second(int(WINDOW_S) + 2)  # every step ended; the last commands' window passed
    assert all(a.state in ("succeeded", "skipped") for a in sim.incident("gpu_dbe").actions)
    assert _answer(sim, "n2")[0] is None


def test_off_when_fast_reports_s_is_zero(
    make_core: Callable[..., Controller], core_clock: FakeClock, tmp_path: Path
) -> None:
    sim = Sim(lambda **kw: make_core(**kw, actions={"fast_reports_s": 0}), core_clock, tmp_path)
    sim.add("n1")
    sim.submit(nodes=["n1"])
    sim.c.tick()
    assert _answer(sim, "n1") == (None, 1)


def test_no_more_nodes_report_fast_than_the_budget(
    make_core: Callable[..., Controller], core_clock: FakeClock, tmp_path: Path
) -> None:
    """One fast place: n1 takes it with its start_job; n2's start_job rides on answers at
    its own interval; once n1's window passed, the place is free again."""
    sim = Sim(
        lambda **kw: make_core(**kw, actions={"fast_reports_max_nodes": 1}), core_clock, tmp_path
    )
    sim.add("n1")
    sim.add("n2")
    sim.submit(nodes=["n1", "n2"])
    sim.c.tick()
    assert _answer(sim, "n1") == (FAST_S, 1)
    assert _answer(sim, "n2") == (None, 1)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(int(WINDOW_S) + 1)
    sim.c.queue_command("n2", CheckpointArgs(job="job", request_id="r1"), command_id="ckpt-1")
    assert _answer(sim, "n2") == (FAST_S, 1)


def test_config_refuses_a_fast_interval_out_of_bounds(
    core_config: Callable[..., ControllerConfig],
) -> None:
    with pytest.raises(ConfigError) as e:
        core_config(actions={"fast_reports_s": 0.01})
    assert "fast_reports_s" in str(e.value)
