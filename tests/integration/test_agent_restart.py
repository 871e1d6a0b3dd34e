"""Agent restarts never cost a training job: a real agent process starts a real torchrun job
(examples/train.py, 2 gloo ranks) on the fake controller's start_job; the agent is restarted
with SIGTERM and then with kill -9 while the job trains. The job keeps training to its last
step with the losses of an uninterrupted run (bitwise), each new agent reports it running
with the same pid and attempt from its very first report, the ranks' heartbeats reach the
new agent on the rebound socket, and the job's exit is reported once. The controller's
job_attempts makes an agent stop a stale attempt, every process of it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.controller_service import FakeController
from tests.helpers import alive, free_port, wait_for
from tests.integration.agent_proc import AgentProcess, kill_launches, launch_pids
from trainguard.agent.launchrec import load_records
from trainguard.devkit.devcluster import compare_losses, read_step_lines
from trainguard.protocol import Command, Event, JobProcess, Report

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
STEPS = 70


def train_args(*, step_time_s: float, steps: int = STEPS) -> list[str]:
    # the step time only pads each step: runs with different step times log the same losses
    return [
        "--steps", str(steps), "--checkpoint-every", "10", "--step-time-s", str(step_time_s),
        "--seed", "0",
    ]  # fmt: skip


def result_of(controller: FakeController, command_id: str) -> Event | None:
    for ev in controller.events_of("command_result"):
        if ev.data.get("command_id") == command_id:
            return ev
    return None


def send(controller: FakeController, command: Command) -> Event:
    controller.queue_command("node-1", command)
    return wait_for(
        lambda: result_of(controller, command.id),
        timeout_s=30,
        what=f"the result of {command.kind} {command.id}",
    )


def reports_of(controller: FakeController, instance: str) -> list[Report]:
    with controller.lock:
        return [r for r in controller.reports if r.instance == instance]


def top_step(controller: FakeController, instance: str | None = None) -> int:
    """The step both ranks passed, in the latest report (of that agent instance)."""
    with controller.lock:
        reports = [r for r in controller.reports if instance in (None, r.instance)]
    ranks = [r for r in (reports[-1].ranks if reports else ()) if r.job == "demo"]
    return min(r.step for r in ranks) if len(ranks) == 2 else -1


class Node:
    """node-1's agent, restartable on the same directory (socket, jobs dir, launch records)."""

    def __init__(self, workdir: Path, controller: FakeController) -> None:
        self.workdir = workdir
        self.controller = controller
        token = workdir / "token"
        token.write_text(controller.agent_token)
        token.chmod(0o600)
        config = workdir / "agent.yaml"
        config.write_text(
            "jobs:\n  allow_jobs_as_root: true\n  transient_units: never\n"
            f"  allowed_paths: [{REPO / 'examples'}]\n"
        )
        self.args = [
            "--config", str(config), "--controller", controller.url, "--token-file", str(token),
            "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
        ]  # fmt: skip
        self.generation = 0
        self.agent = self.start()

    def start(self) -> AgentProcess:
        self.generation += 1
        self.agent = AgentProcess(self.workdir, *self.args, log_name=f"agent-{self.generation}.log")
        return self.agent

    def instance(self) -> str:
        """This agent's instance id (from its log), once its first report has arrived."""
        found = wait_for(
            lambda: re.search(r"event=agent_started .*instance=(\w+)", self.agent.log()),
            timeout_s=30,
            what="the agent to start",
        )
        instance = found.group(1)
        wait_for(
            lambda: reports_of(self.controller, instance),
            timeout_s=30,
            what="the agent's first report",
        )
        return instance


def start_demo(
    node: Node, *, attempt: int, step_time_s: float, command_id: str, steps: int = STEPS
) -> None:
    started = send(
        node.controller,
        Command(
            id=command_id,
            kind="start_job",
            args={
                "job": "demo",
                "attempt": attempt,
                "command": [
                    str(REPO / "examples" / "train.py"),
                    *train_args(step_time_s=step_time_s, steps=steps),
                    "--ckpt-dir",
                    str(node.workdir / "ckpt"),
                ],
                "nproc_per_node": 2,
                "nnodes": 1,
                "node_rank": 0,
                "rdzv_endpoint": f"127.0.0.1:{free_port()}",
                "rdzv_id": f"demo-{attempt}",
                "rdzv_conf": {"join_timeout": "60"},
                "cwd": str(REPO),
            },
        ),
    )
    assert started.data["ok"] is True, started.data["message"]


def reference_losses(workdir: Path) -> list[dict[str, object]]:
    out = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2", str(REPO / "examples" / "train.py"), *train_args(step_time_s=0.0),
            "--ckpt-dir", str(workdir / "ref-ckpt"),
        ],
        cwd=REPO, capture_output=True, timeout=300, check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")},
    )  # fmt: skip
    log = workdir / "reference.log"
    log.write_bytes(out.stdout + out.stderr)
    assert out.returncode == 0, log.read_text()[-3000:]
    lines = read_step_lines(log)
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
    return lines


def test_the_job_trains_to_its_last_step_through_agent_restarts_by_sigterm_and_kill9(
    short_tmp: Path, fake_controller: FakeController
) -> None:
    reference = reference_losses(short_tmp)
    node = Node(short_tmp, fake_controller)
    try:
        start_demo(node, attempt=0, step_time_s=0.25, command_id="start-0")
        wait_for(lambda: top_step(fake_controller) >= 3, timeout_s=90, what="both ranks training")
        (rec,) = load_records(short_tmp / "jobs" / "launches")
        before = set(launch_pids(rec.launch_id))
        assert rec.pid in before and len(before) >= 4  # wrapper, torchrun, 2 workers

        for how in ("SIGTERM", "SIGKILL"):
            step_before = top_step(fake_controller)
            if how == "SIGTERM":
                assert node.agent.terminate(timeout_s=30) == 0, node.agent.log()[-3000:]
                assert "event=job_left_running" in node.agent.log()
            else:
                node.agent.kill()
            assert launch_pids(rec.launch_id) == before, f"the job lost processes ({how})"
            node.start()
            instance = node.instance()
            first = reports_of(fake_controller, instance)[0]
            assert first.jobs == (
                JobProcess(
                    job="demo", attempt=0, state="running", pid=rec.pid,
                    output_tail=first.jobs[0].output_tail,
                ),
            ), f"first report after {how}: {first.jobs}"  # fmt: skip
            assert f"event=job_adopted job=demo attempt=0 pid={rec.pid}" in (node.agent.log())
            # the ranks' heartbeats reach the new agent on the rebound socket
            wait_for(
                lambda: top_step(fake_controller, instance) > step_before + 2,  # noqa: B023
                timeout_s=60,
                what=f"the ranks' steps in the new agent's reports ({how})",
            )
        assert fake_controller.events_of("job_exit") == []

        (ev,) = wait_for(
            lambda: fake_controller.events_of("job_exit") or None,
            timeout_s=180,
            what="the job to finish",
        )
        assert ev.job == "demo" and ev.code == 0 and ev.data["stopped"] is False, ev.message
        assert ev.data["attempt"] == 0 and ev.data["adopted"] is True
        lines = read_step_lines(short_tmp / "jobs" / "demo-0.log")
        assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
        assert compare_losses([lines], reference) == []
        assert load_records(short_tmp / "jobs" / "launches") == []
        wait_for(lambda: not launch_pids(rec.launch_id), timeout_s=10, what="no process left")
        with fake_controller.lock:
            assert fake_controller.reports[-1].jobs[0].state == "exited"
        assert len(fake_controller.events_of("job_exit")) == 1
    finally:
        node.agent.terminate()
        kill_launches(short_tmp / "jobs")


def test_job_attempts_make_the_agent_stop_every_process_of_a_stale_attempt(
    short_tmp: Path, fake_controller: FakeController
) -> None:
    node = Node(short_tmp, fake_controller)
    try:
        start_demo(node, attempt=3, step_time_s=0.2, command_id="start-3", steps=100000)
        wait_for(lambda: top_step(fake_controller) >= 1, timeout_s=90, what="both ranks training")
        (rec,) = load_records(short_tmp / "jobs" / "launches")
        node.agent.kill()
        node.start()
        node.instance()
        pids = launch_pids(rec.launch_id)
        assert len(pids) >= 4
        # the controller moved the job on to attempt 4: this node's attempt 3 is stale
        fake_controller.service.job_attempts["node-1"] = {"demo": 4}
        (ev,) = wait_for(
            lambda: fake_controller.events_of("job_exit") or None,
            timeout_s=60,
            what="the stale attempt's exit",
        )
        assert ev.data["attempt"] == 3 and ev.data["stopped"] is True, ev.message
        assert ev.data["stop_reason"] == "stale_attempt_current_4"
        assert ev.data["adopted"] is True
        assert "event=job_stale_attempt job=demo attempt=3 current_attempt=4" in (node.agent.log())
        wait_for(lambda: not any(alive(p) for p in pids), timeout_s=30, what="every process gone")
        assert launch_pids(rec.launch_id) == set()
    finally:
        fake_controller.service.job_attempts.clear()
        node.agent.terminate()
        kill_launches(short_tmp / "jobs")


def test_stop_job_after_re_adoption_stops_every_worker(
    short_tmp: Path, fake_controller: FakeController
) -> None:
    node = Node(short_tmp, fake_controller)
    try:
        start_demo(node, attempt=1, step_time_s=0.2, command_id="start-1", steps=100000)
        wait_for(lambda: top_step(fake_controller) >= 1, timeout_s=90, what="both ranks training")
        (rec,) = load_records(short_tmp / "jobs" / "launches")
        node.agent.kill()
        node.start()
        node.instance()
        pids = launch_pids(rec.launch_id)
        assert len(pids) >= 4  # wrapper, torchrun, 2 workers
        stopped = send(
            fake_controller,
            Command(id="stop-1", kind="stop_job", args={"job": "demo", "grace_s": 30}),
        )
        assert stopped.data["signalled"] is True
        (ev,) = wait_for(
            lambda: fake_controller.events_of("job_exit") or None,
            timeout_s=60,
            what="the adopted job's exit",
        )
        assert ev.data["stopped"] is True and ev.data["killed"] is False, ev.message
        assert ev.data["adopted"] is True
        # the ranks took their emergency checkpoint and exited within the grace
        assert {e.rank for e in fake_controller.events_of("trainer_exit")} == {0, 1}
        wait_for(lambda: not any(alive(p) for p in pids), timeout_s=30, what="every process gone")
        assert launch_pids(rec.launch_id) == set()
    finally:
        node.agent.terminate()
        kill_launches(short_tmp / "jobs")
