"""`preflight` and `repair` through the agent's command path (sim backend): they run on the
slow-command worker, off the collect loop; a preflight answers a `preflight_result` event and
then the `command_result` that completes the command; a failing preflight, a GPU reset and a
passing one in turn, in the spool and through the fake controller's report responses."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.controller_service import FakeController
from tests.helpers import wait_for
from trainguard.agent.config import (
    AgentConfig,
    ControllerConfig,
    HardwareConfig,
    HeartbeatConfig,
    JobsConfig,
    NodeConfig,
    RepairConfig,
)
from trainguard.agent.daemon import SLOW_COMMANDS, Agent
from trainguard.clock import FakeClock
from trainguard.command_args import PreflightArgs, RepairArgs, command
from trainguard.model import GpuCollection, HardwareEvent
from trainguard.protocol import Command, CommandKind, Event, EventKind, FaultSpec

FAST_CHECKS = ["nvml_health", "row_remaps", "ecc", "compute_burn", "ckpt_storage"]


@pytest.fixture
def agent(short_tmp: Path) -> Any:
    token = short_tmp / "token"
    token.write_text("t0ken")
    token.chmod(0o600)
    cfg = AgentConfig(
        node=NodeConfig(name="node-3"),
        hardware=HardwareConfig(gpu_backend="sim", sim_gpus=2, sim_ib_ports=0),
        heartbeat=HeartbeatConfig(socket_path=str(short_tmp / "hb.sock")),
        jobs=JobsConfig(work_dir=str(short_tmp / "jobs")),
        # a closed port: nothing is delivered, the spool is what the controller would get
        controller=ControllerConfig(url="http://127.0.0.1:1", token_file=str(token)),
        repair=RepairConfig(allow_reboot=True),
    )
    a = Agent(cfg, clock=FakeClock(), serve_http=False, inline_sources=True)
    a.start()
    yield a
    a.close()


def answers(agent: Agent, command_id: str, count: int) -> list[Event]:
    def done() -> list[Event] | None:
        mine = [e for e in agent.spool.pending(1000) if e.data.get("command_id") == command_id]
        return mine if len(mine) >= count else None

    return wait_for(done, timeout_s=60, what=f"the answer(s) to {command_id}")


def test_preflight_and_repair_run_on_the_slow_worker() -> None:
    assert {CommandKind.PREFLIGHT, CommandKind.REPAIR} <= SLOW_COMMANDS


def test_failing_preflight_then_reset_then_passing_preflight(agent: Agent, short_tmp: Path) -> None:
    assert agent._backends.sim is not None
    agent._backends.sim.inject(FaultSpec(kind="dbe", gpu=1))
    args = PreflightArgs(checks=FAST_CHECKS, ckpt_dir=str(short_tmp), burn_s=0.2)

    agent.execute(command("p1", args))
    result, done = answers(agent, "p1", 2)
    assert (result.kind, done.kind) == ("preflight_result", "command_result")
    assert result.id < done.id
    assert result.data["passed"] is False
    by_name = {c["name"]: c for c in result.data["checks"]}
    assert [c["name"] for c in result.data["checks"]] == FAST_CHECKS
    assert by_name["ecc"]["passed"] is False and by_name["row_remaps"]["passed"] is False
    assert by_name["compute_burn"]["passed"] is True and by_name["ckpt_storage"]["passed"] is True
    assert (done.data["ok"], done.data["kind"]) == (False, "preflight")
    assert done.message.startswith("preflight failed: row_remaps: GPU 1: row remap pending")

    agent.execute(command("r1", RepairArgs(method="gpu_reset", gpus=[1])))
    (reset,) = answers(agent, "r1", 1)
    assert (reset.kind, reset.data["ok"], reset.message) == ("command_result", True, "reset GPU 1")

    agent.execute(command("p2", args))
    result, done = answers(agent, "p2", 2)
    assert result.data["passed"] is True and done.data["ok"] is True
    assert result.data["duration_s"] >= 0


def test_a_bad_preflight_is_answered_by_its_command_result_alone(agent: Agent) -> None:
    agent.execute(Command(id="p2", kind="preflight", args={"checks": ["burn_everything"]}))
    (bad,) = answers(agent, "p2", 1)
    assert bad.kind == "command_result" and bad.data["ok"] is False
    assert "args.checks[0]: unknown check 'burn_everything'" in bad.message


def test_reboot_through_the_agent_resets_the_sim(agent: Agent) -> None:
    sim = agent._backends.sim
    assert sim is not None
    sim.inject(FaultSpec(kind="remap_failure", gpu=0))
    agent.execute(command("r1", RepairArgs(method="reboot")))
    (done,) = answers(agent, "r1", 1)
    assert done.data["ok"] is True
    assert sim.reboots_total == 1 and sim.active_faults() == []


def test_a_gpu_lost_edge_seen_by_the_preflights_read_still_reaches_the_spool(
    agent: Agent,
) -> None:
    sim = agent._backends.sim
    assert sim is not None
    # the loop has not collected since: the preflight's read is the first to see the loss
    sim.inject(FaultSpec(kind="gpu_lost", gpu=1))
    real = sim.collect

    def collect_with_edge() -> GpuCollection:
        coll = real()
        lost = HardwareEvent(kind=EventKind.GPU_LOST, ts=0.0, gpu=1, message="NVML: GPU is lost")
        return dataclasses.replace(coll, events=(lost,))

    sim.collect = collect_with_edge  # type: ignore[method-assign]
    agent.execute(command("p1", PreflightArgs(checks=["nvml_health"])))
    result, _ = answers(agent, "p1", 2)
    assert result.data["passed"] is False
    sim.collect = real  # type: ignore[method-assign]
    agent.tick()
    assert [e.gpu for e in agent.spool.pending(1000) if e.kind == "gpu_lost"] == [1]


def test_preflight_and_repair_ride_on_report_responses_to_the_controller(
    short_tmp: Path, fake_controller: FakeController
) -> None:
    token = short_tmp / "token"
    token.write_text(fake_controller.agent_token)
    token.chmod(0o600)
    cfg = AgentConfig(
        node=NodeConfig(name="node-4"),
        hardware=HardwareConfig(gpu_backend="sim", sim_gpus=2, sim_ib_ports=0),
        heartbeat=HeartbeatConfig(socket_path=str(short_tmp / "hb.sock")),
        jobs=JobsConfig(work_dir=str(short_tmp / "jobs")),
        controller=ControllerConfig(
            url=fake_controller.url, token_file=str(token), report_interval_s=0.2
        ),
    )
    agent = Agent(cfg, serve_http=False)
    agent.start()
    loop = threading.Thread(target=agent.run, name="agent-loop", daemon=True)
    loop.start()
    try:
        assert agent._backends.sim is not None
        agent._backends.sim.inject(FaultSpec(kind="remap_pending", gpu=0))
        args = PreflightArgs(checks=["nvml_health", "row_remaps", "ecc"])
        fake_controller.service.queue_command("node-4", command("p1", args))
        fake_controller.service.queue_command("node-4", command("r1", RepairArgs(gpus=[0])))
        fake_controller.service.queue_command("node-4", command("p2", args))

        def delivered() -> dict[str, Event] | None:
            seen = {
                (e.kind, e.data.get("command_id")): e
                for e in fake_controller.events.values()
                if e.kind in ("preflight_result", "command_result")
            }
            return seen if len(seen) == 5 else None

        seen = wait_for(delivered, timeout_s=30, what="the three commands' answers")
        assert seen[("preflight_result", "p1")].data["passed"] is False
        assert seen[("command_result", "r1")].data["ok"] is True
        assert seen[("preflight_result", "p2")].data["passed"] is True
        assert seen[("command_result", "p2")].data["ok"] is True
        # each command ran once: its command_result took it off the pending list
        wait_for(
            lambda: not fake_controller.service.pending.get("node-4"),
            timeout_s=10,
            what="no command pending",
        )
        assert agent._backends.sim.resets == [0]
    finally:
        agent.stop()
        loop.join(10)
        agent.close()
