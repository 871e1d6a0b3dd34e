"""The agent side of the loop, end to end: a real agent process, the fake controller
handing out commands, and a real `examples/train.py` under torchrun (2 gloo ranks)
started by `start_job`. checkpoint reaches the ranks and commits, collect_stacks returns
both ranks' Python stacks, a SIGTERM to the agent leaves the job running, and stop_job to
the next agent instance stops it gracefully with the job's exit reaching the controller."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes.controller_service import FakeController
from tests.helpers import free_port, wait_for
from tests.integration.agent_proc import AgentProcess, kill_launches
from trainguard.protocol import Command, Event, RankState

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def result_of(controller: FakeController, command_id: str) -> Event | None:
    for ev in controller.events_of("command_result"):
        if ev.data.get("command_id") == command_id:
            return ev
    return None


def latest_ranks(controller: FakeController) -> tuple[RankState, ...]:
    with controller.lock:
        return controller.reports[-1].ranks if controller.reports else ()


def send(controller: FakeController, command: Command) -> Event:
    controller.queue_command("node-1", command)
    return wait_for(
        lambda: result_of(controller, command.id),
        timeout_s=30,
        what=f"the result of {command.kind} {command.id}",
    )


def test_start_checkpoint_stacks_and_graceful_stop_of_a_real_training_job(
    short_tmp: Path, fake_controller: FakeController
) -> None:
    token = short_tmp / "token"
    token.write_text(fake_controller.agent_token)
    token.chmod(0o600)
    # the job runs as this (root) test's user; its program must be on the allow-list
    config = short_tmp / "agent.yaml"
    config.write_text(
        f"jobs:\n  allow_jobs_as_root: true\n  allowed_paths: [{REPO / 'examples'}]\n"
    )
    args = [
        "--config", str(config),
        "--controller", fake_controller.url, "--token-file", str(token),
        "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
        "--advertise-address", "127.0.0.1",
    ]  # fmt: skip
    agent = AgentProcess(short_tmp, *args)
    stopped = False
    try:
        started = send(
            fake_controller,
            Command(
                id="start-1",
                kind="start_job",
                args={
                    "job": "demo",
                    "attempt": 0,
                    "command": [
                        str(REPO / "examples" / "train.py"),
                        "--steps",
                        "100000",
                        "--ckpt-dir",
                        str(short_tmp / "ckpt"),
                        "--checkpoint-every",
                        "0",
                        "--step-time-s",
                        "0.05",
                    ],
                    "nproc_per_node": 2,
                    "nnodes": 1,
                    "node_rank": 0,
                    "rdzv_endpoint": f"127.0.0.1:{free_port()}",
                    "rdzv_id": "demo-0",
                    "cwd": str(REPO),
                },
            ),
        )
        assert started.data["ok"] is True, started.data["message"]
        with fake_controller.lock:
            assert fake_controller.reports[-1].labels.get("address") == "127.0.0.1"
        wait_for(
            lambda: (
                len([r for r in latest_ranks(fake_controller) if r.job == "demo" and r.step > 2])
                == 2
            ),
            timeout_s=90,
            what="both ranks training (heartbeats in the report)",
        )
        with fake_controller.lock:
            (job,) = fake_controller.reports[-1].jobs
        assert (job.job, job.attempt, job.state) == ("demo", 0, "running")

        ckpt = send(
            fake_controller,
            Command(id="ckpt-1", kind="checkpoint", args={"job": "demo", "request_id": "req-1"}),
        )
        assert ckpt.data["ok"] is True and ckpt.data["message"] == "sent to 2 rank(s)"
        wait_for(
            lambda: (
                [r.ckpt_request_id for r in latest_ranks(fake_controller) if r.job == "demo"]
                == ["req-1", "req-1"]
            ),
            timeout_s=60,
            what="both ranks reporting the committed request",
        )
        wait_for(
            lambda: (
                {
                    e.rank
                    for e in fake_controller.events_of("checkpoint_committed")
                    if e.data.get("request_id") == "req-1"
                }
                == {0, 1}
            ),
            timeout_s=30,
            what="checkpoint_committed events of both ranks",
        )

        stacks = send(
            fake_controller, Command(id="stk-1", kind="collect_stacks", args={"job": "demo"})
        )
        assert stacks.data["ok"] is True, stacks.data["message"]
        text = stacks.data["stacks"]
        assert "--- rank 0 pid" in text and "--- rank 1 pid" in text
        assert 'train.py", line' in text and "in main" in text
        assert len(text.encode()) <= 16384
        assert [r["status"] for r in stacks.data["ranks"]] == ["dumped", "dumped"]
        # the dump did not hurt the ranks: they keep stepping
        before = max(r.step for r in latest_ranks(fake_controller) if r.job == "demo")
        wait_for(
            lambda: min(r.step for r in latest_ranks(fake_controller) if r.job == "demo") > before,
            timeout_s=30,
            what="the ranks to keep training after the dump",
        )

        # the agent's own stop leaves the job running (docs/agent.md, "Jobs outlive the
        # agent"); the next instance adopts it and stops it on stop_job
        assert agent.terminate(timeout_s=60) == 0
        assert fake_controller.events_of("job_exit") == []
        agent = AgentProcess(short_tmp, *args, log_name="agent-2.log")
        stop = send(
            fake_controller,
            Command(id="stop-1", kind="stop_job", args={"job": "demo", "grace_s": 30}),
        )
        assert stop.data["signalled"] is True
        (exit_ev,) = wait_for(
            lambda: fake_controller.events_of("job_exit") or None,
            timeout_s=60,
            what="the job's exit",
        )
        assert agent.terminate(timeout_s=60) == 0
        stopped = True
        assert exit_ev.job == "demo" and exit_ev.data["stopped"] is True
        assert exit_ev.data["killed"] is False, exit_ev.message
        trainer_exits = {
            e.rank for e in fake_controller.events_of("trainer_exit") if e.job == "demo"
        }
        assert trainer_exits == {0, 1}
    finally:
        if not stopped:
            print(agent.log()[-6000:])
            agent.kill()
        kill_launches(short_tmp / "jobs")  # the agent leaves its jobs running
