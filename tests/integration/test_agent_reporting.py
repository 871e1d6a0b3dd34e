"""A real agent process reporting to a controller-shaped HTTP server that goes away and
comes back: no event lost, none duplicated after dedupe, commands executed once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_proc import AgentProcess, FakeController, cleanup, sample_value, short_tmpdir, wait_until

pytestmark = pytest.mark.slow

TOKEN = "integration-token-123"


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = short_tmpdir()
    yield d
    cleanup(d)


@pytest.fixture
def controller() -> Iterator[FakeController]:
    ctl = FakeController(TOKEN)
    yield ctl
    ctl.stop()


def start_agent(workdir: Path, controller: FakeController) -> AgentProcess:
    token = workdir / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    return AgentProcess(
        workdir, "--controller", controller.url, "--token-file", str(token),
        "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
    )  # fmt: skip


def test_outage_loses_no_event_and_receiver_dedupes_to_each_once(
    workdir: Path, controller: FakeController
) -> None:
    agent = start_agent(workdir, controller)
    try:
        wait_until(lambda: controller.reports, what="a first report")
        first = controller.reports[0]
        assert first.node == "node-1" and len(first.gpus) == 8 and len(first.ib_ports) == 8
        assert agent.inject("xid", "--gpu", "0", "--code", "31").returncode == 0
        wait_until(lambda: controller.events_of("xid"), what="the first XID event")

        controller.stop()
        for gpu in range(1, 4):
            assert agent.inject("xid", "--gpu", str(gpu), "--code", "74").returncode == 0
        wait_until(
            lambda: (
                (
                    sample_value(agent.metrics(), "trainguard_agent_reports_total", result="error")
                    or 0
                )
                >= 2
            ),
            what="failed reports while the controller is down",
        )
        # the XID events are spooled by the collect loop, which may lag the failed reports
        wait_until(
            lambda: (sample_value(agent.metrics(), "trainguard_agent_spool_events") or 0) >= 6,
            what="the outage's events in the spool",
        )

        controller.start()
        wait_until(
            lambda: len(controller.events_of("xid")) == 4, what="all XIDs after the outage",
            timeout_s=30,
        )  # fmt: skip
        wait_until(
            lambda: sample_value(agent.metrics(), "trainguard_agent_spool_events") == 0,
            what="the spool to drain",
        )
        instance = first.instance
        ids = sorted(i for inst, i in controller.events if inst == instance)
        assert ids == list(range(1, len(ids) + 1))  # no gap: nothing lost
        xids = sorted((e.gpu, e.code) for e in controller.events_of("xid"))
        assert xids == [(0, 31), (1, 74), (2, 74), (3, 74)]
        assert controller.unauthorized == 0
        assert TOKEN not in agent.log()
    finally:
        assert agent.terminate() == 0


def test_commands_from_the_response_run_once_and_report_their_result(
    workdir: Path, controller: FakeController
) -> None:
    agent = start_agent(workdir, controller)
    try:
        wait_until(lambda: controller.reports, what="a first report")
        cmd = {"id": "cmd-1", "kind": "inject_fault", "args": {"kind": "gpu_lost", "gpu": 5}}
        with controller.lock:
            controller.pending_commands = [cmd, cmd]  # a resend must not run twice
        results = wait_until(
            lambda: controller.events_of("command_result"), what="the command result"
        )
        wait_until(lambda: controller.events_of("gpu_lost"), what="the gpu_lost event")
        assert [(r.data["command_id"], r.data["ok"]) for r in results] == [("cmd-1", True)]
        wait_until(
            lambda: sample_value(agent.metrics(), "trainguard_gpu_lost", gpu="5") == 1,
            what="gpu 5 lost on /metrics",
        )
        with controller.lock:
            controller.pending_commands = [
                {"id": "cmd-2", "kind": "start_job", "args": {"job": "j"}}
            ]
        wait_until(
            lambda: len(controller.events_of("command_result")) == 2, what="the second result"
        )
        (second,) = [
            r for r in controller.events_of("command_result") if r.data["command_id"] == "cmd-2"
        ]
        # the job backend answers: a start_job without its required arguments is refused
        assert second.data["ok"] is False and "start_job: args." in second.data["message"]
        assert (
            len(
                [
                    e
                    for e in controller.events_of("command_result")
                    if e.data["command_id"] == "cmd-1"
                ]
            )
            == 1
        )
    finally:
        assert agent.terminate() == 0
