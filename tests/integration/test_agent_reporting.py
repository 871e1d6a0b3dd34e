"""A real agent process reporting to the fake controller, which goes away and comes back:
no event lost, none duplicated after dedupe, commands executed once."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.controller_service import FakeController
from tests.helpers import wait_for
from tests.integration.agent_proc import AgentProcess, sample_value
from trainguard.protocol import Command

pytestmark = pytest.mark.slow


def start_agent(workdir: Path, controller: FakeController) -> AgentProcess:
    token = workdir / "token"
    token.write_text(controller.agent_token + "\n")
    token.chmod(0o600)
    return AgentProcess(
        workdir, "--controller", controller.url, "--token-file", str(token),
        "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
    )  # fmt: skip


def test_outage_loses_no_event_and_receiver_dedupes_to_each_once(
    short_tmp: Path, fake_controller: FakeController
) -> None:
    agent = start_agent(short_tmp, fake_controller)
    try:
        wait_for(lambda: fake_controller.reports, timeout_s=30, what="a first report")
        first = fake_controller.reports[0]
        assert first.node == "node-1" and len(first.gpus) == 8 and len(first.ib_ports) == 8
        assert agent.inject("xid", "--gpu", "0", "--code", "31").returncode == 0
        wait_for(lambda: fake_controller.events_of("xid"), timeout_s=30, what="the first XID event")

        fake_controller.stop()
        for gpu in range(1, 4):
            assert agent.inject("xid", "--gpu", str(gpu), "--code", "74").returncode == 0
        wait_for(
            lambda: (
                (
                    sample_value(agent.metrics(), "trainguard_agent_reports_total", result="error")
                    or 0
                )
                >= 2
            ),
            timeout_s=30,
            what="failed reports while the controller is down",
        )
        # the XID events are spooled by the collect loop, which may lag the failed reports
        wait_for(
            lambda: (sample_value(agent.metrics(), "trainguard_agent_spool_events") or 0) >= 6,
            timeout_s=30,
            what="the outage's events in the spool",
        )

        fake_controller.start()
        wait_for(
            lambda: len(fake_controller.events_of("xid")) == 4,
            timeout_s=30,
            what="all XIDs after the outage",
        )
        wait_for(
            lambda: sample_value(agent.metrics(), "trainguard_agent_spool_events") == 0,
            timeout_s=30,
            what="the spool to drain",
        )
        instance = first.instance
        ids = sorted(i for inst, i in fake_controller.events if inst == instance)
        assert ids == list(range(1, len(ids) + 1))  # no gap: nothing lost
        xids = sorted((e.gpu, e.code) for e in fake_controller.events_of("xid"))
        assert xids == [(0, 31), (1, 74), (2, 74), (3, 74)]
        assert fake_controller.statuses(401) == 0
        assert fake_controller.agent_token not in agent.log()
    finally:
        assert agent.terminate() == 0


def test_commands_from_the_response_run_once_and_report_their_result(
    short_tmp: Path, fake_controller: FakeController
) -> None:
    agent = start_agent(short_tmp, fake_controller)
    try:
        wait_for(lambda: fake_controller.reports, timeout_s=30, what="a first report")
        cmd = Command(id="cmd-1", kind="inject_fault", args={"kind": "gpu_lost", "gpu": 5})
        # handed out on every report until its result arrives, and twice in one response:
        # the agent runs it once
        fake_controller.queue_command("node-1", cmd)
        fake_controller.queue_command("node-1", cmd)
        results = wait_for(
            lambda: fake_controller.events_of("command_result"),
            timeout_s=30,
            what="the command result",
        )
        wait_for(
            lambda: fake_controller.events_of("gpu_lost"), timeout_s=30, what="the gpu_lost event"
        )
        assert [(r.data["command_id"], r.data["ok"]) for r in results] == [("cmd-1", True)]
        wait_for(
            lambda: sample_value(agent.metrics(), "trainguard_gpu_lost", gpu="5") == 1,
            timeout_s=30,
            what="gpu 5 lost on /metrics",
        )
        fake_controller.queue_command(
            "node-1", Command(id="cmd-2", kind="start_job", args={"job": "j"})
        )
        wait_for(
            lambda: len(fake_controller.events_of("command_result")) == 2,
            timeout_s=30,
            what="the second result",
        )
        (second,) = [
            r
            for r in fake_controller.events_of("command_result")
            if r.data["command_id"] == "cmd-2"
        ]
        # the job backend answers: a start_job without its required arguments is refused
        assert second.data["ok"] is False and "start_job: args." in second.data["message"]
        assert (
            len(
                [
                    e
                    for e in fake_controller.events_of("command_result")
                    if e.data["command_id"] == "cmd-1"
                ]
            )
            == 1
        )
    finally:
        assert agent.terminate() == 0
