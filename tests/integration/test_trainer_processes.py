"""The trainer library in real processes: examples/train.py alone and under real torchrun
(3 gloo ranks, c10d rendezvous), killed with SIGKILL, resumed, preempted, poisoned with NaN,
and asked for a checkpoint through one rank's real control socket.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import free_port, wait_for
from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.agent.jobs import find_launch_processes
from trainguard.command_args import LAUNCH_ID_ENV
from trainguard.protocol import Control, Heartbeat, encode_json
from trainguard.trainer.checkpoint import load_rank_file, read_tensor_file
from trainguard.trainer.manifest import find_latest_good, list_committed, read_manifest
from trainguard.trainer.state import fill_tensors

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "examples" / "train.py")
pytestmark = pytest.mark.slow


_RUNS: list[Run] = []


@pytest.fixture(autouse=True)
def no_run_left_behind() -> Iterator[None]:
    """Every launch of a test ends with the test: a run that hangs on purpose (chaos) or was
    killed leaves no worker behind."""
    yield
    runs, _RUNS[:] = list(_RUNS), []
    for run in runs:
        run.kill()


class Run:
    """One launch of the example (alone or under torchrun) in its own process group."""

    def __init__(self, workdir: Path, args: list[str], *, nproc: int = 1, env: dict[str, str]):
        self.out = workdir / f"stdout-{time.monotonic_ns()}.jsonl"
        self.err = workdir / f"stderr-{time.monotonic_ns()}.log"
        if nproc == 1:
            cmd = [sys.executable, TRAIN, *args]
        else:
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "1", "--nproc-per-node", str(nproc),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                "--rdzv-id", "tgtest", "--max-restarts", "0",
                TRAIN, *args,
            ]  # fmt: skip
        # torchrun puts its workers in sessions of their own, out of reach of killpg: the
        # launch marker the agent uses finds them (agent.jobs.find_launch_processes)
        self.launch_id = f"test-{os.getpid()}-{time.monotonic_ns()}"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env, LAUNCH_ID_ENV: self.launch_id}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=err, env=full_env, cwd=REPO, start_new_session=True
            )
        _RUNS.append(self)

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for raw in self.out.read_text().splitlines():
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue  # a line cut by SIGKILL
        return out

    def wait(self, timeout_s: float = 120) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"run did not finish in {timeout_s}s: {self.stderr()}") from None

    def live_pids(self) -> set[int]:
        return find_launch_processes(leader_pid=self.proc.pid, launch_id=self.launch_id)

    def kill(self) -> None:
        """SIGKILL the launcher and every worker of this launch; wait until none is left."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in self.live_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)
        wait_for(lambda: not self.live_pids(), timeout_s=30, what="the run's workers to exit")

    def stderr(self) -> str:
        return self.err.read_text()[-3000:]


def losses(lines: list[dict[str, Any]]) -> dict[int, Any]:
    return {line["step"]: line["loss"] for line in lines}


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tgi-"))  # short: unix socket paths are <= 107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def no_agent(tmp_path: Path) -> dict[str, str]:
    return {"TRAINGUARD_AGENT_SOCKET": str(tmp_path / "absent.sock"), "TRAINGUARD_CHAOS": ""}


@pytest.fixture(scope="module")
def baseline_3ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    d = tmp_path_factory.mktemp("baseline3")
    env = {"TRAINGUARD_AGENT_SOCKET": str(d / "absent.sock"), "TRAINGUARD_CHAOS": ""}
    run = Run(
        d,
        ["--steps", "40", "--ckpt-dir", str(d / "ck"), "--checkpoint-every", "10"],
        nproc=3,
        env=env,
    )
    assert run.wait() == 0, run.stderr()
    got = losses(run.lines())
    assert sorted(got) == list(range(1, 41))
    return got


def kill_after_commit(run: Run, ckpt_dir: Path, step: int) -> None:
    wait_for(
        lambda: (
            (ckpt_dir / f"step_{step:06d}" / "manifest.json").exists()
            or run.proc.poll() is not None
        ),
        timeout_s=90,
        what=f"checkpoint {step} to commit",
    )
    assert run.proc.poll() is None, "the run finished before it could be killed"
    run.kill()


def test_single_process_resume_after_kill9_reproduces_losses_bitwise(
    tmp_path: Path, no_agent: dict[str, str]
) -> None:
    common = ["--steps", "40", "--checkpoint-every", "10", "--seed", "3"]
    straight = Run(tmp_path, [*common, "--ckpt-dir", str(tmp_path / "a")], env=no_agent)
    ck = tmp_path / "b"
    killed = Run(tmp_path, [*common, "--ckpt-dir", str(ck), "--step-time-s", "0.05"], env=no_agent)
    kill_after_commit(killed, ck, 20)
    assert straight.wait() == 0, straight.stderr()
    resumed = Run(tmp_path, [*common, "--ckpt-dir", str(ck)], env=no_agent)
    assert resumed.wait() == 0, resumed.stderr()
    got = losses(resumed.lines())
    assert min(got) == 21, got
    expected = losses(straight.lines())
    assert got == {s: expected[s] for s in range(21, 41)}


def test_three_ranks_resume_after_kill9_reproduces_losses_bitwise(
    tmp_path: Path, no_agent: dict[str, str], baseline_3ranks: dict[int, Any]
) -> None:
    ck = tmp_path / "ck"
    args = ["--steps", "40", "--ckpt-dir", str(ck), "--checkpoint-every", "10"]
    killed = Run(tmp_path, args, nproc=3, env={**no_agent, "TRAINGUARD_CHAOS": "hang@step23"})
    kill_after_commit(killed, ck, 20)
    m = read_manifest(find_latest_good(ck)[1])  # type: ignore[index]
    assert m.format == "dcp" and m.world_size == 3
    assert {f"rank_{r:05d}.pt" for r in range(3)} <= set(m.files)
    resumed = Run(tmp_path, args, nproc=3, env=no_agent)
    assert resumed.wait() == 0, resumed.stderr()
    got = losses(resumed.lines())
    assert min(got) == 21, got
    assert got == {s: baseline_3ranks[s] for s in range(21, 41)}


def test_checkpoint_request_sent_to_one_rank_commits_on_all_at_one_step_and_resumes_bitwise(
    tmp_path: Path, sock_dir: Path, baseline_3ranks: dict[int, Any]
) -> None:
    agent = FakeAgent(sock_dir)
    # No periodic checkpoints in this run, and it hangs at step 38 so it cannot end before
    # the request is acted on: the only checkpoint is the requested one.
    env = {
        "TRAINGUARD_AGENT_SOCKET": agent.path,
        "TRAINGUARD_CONTROL_DIR": str(sock_dir),
        "TRAINGUARD_JOB": "odd",
        "TRAINGUARD_CHAOS": "hang@step38",
    }
    ck = tmp_path / "ck"
    args = ["--steps", "40", "--ckpt-dir", str(ck), "--checkpoint-every", "10"]
    try:
        run = Run(
            tmp_path,
            [
                "--steps",
                "40",
                "--ckpt-dir",
                str(ck),
                "--checkpoint-every",
                "0",
                "--step-time-s",
                "0.1",
            ],
            nproc=3,
            env=env,
        )
        rank2 = wait_for(
            lambda: next((h for h in agent.heartbeats() if h.rank == 2 and h.step >= 3), None),
            timeout_s=90,
            what="rank 2 to reach step 3",
        )
        assert rank2.control_socket and rank2.control_socket.startswith(str(sock_dir))
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(
                encode_json(Control(action="checkpoint", request_id="req-odd", job="odd")),
                rank2.control_socket,
            )

        def committed() -> list[Heartbeat]:
            hbs = [
                h
                for h in agent.heartbeats()
                if h.event == "checkpoint_committed" and h.event_data.get("request_id") == "req-odd"
            ]
            return hbs if {h.rank for h in hbs} == {0, 1, 2} else []

        events = wait_for(committed, timeout_s=60, what="all ranks to report the commit")
        steps = {h.event_data["step"] for h in events}
        assert len(steps) == 1, f"ranks checkpointed at different steps: {steps}"
        step = steps.pop()
        m = read_manifest(ck / f"step_{step:06d}")
        assert m.request_id == "req-odd" and m.world_size == 3
        wait_for(
            lambda: all(
                any(h.rank == r and h.ckpt_request_id == "req-odd" for h in agent.heartbeats())
                for r in range(3)
            ),
            timeout_s=30,
            what="the level field ckpt_request_id on every rank",
        )
        run.kill()
    finally:
        agent.close()
    assert [s for s, _ in list_committed(ck)] == [step]
    resumed = Run(
        tmp_path,
        args,
        nproc=3,
        env={
            "TRAINGUARD_AGENT_SOCKET": str(tmp_path / "absent.sock"),
            "TRAINGUARD_CHAOS": "",
            "TRAINGUARD_JOB": "odd",  # the same job: another job's checkpoint is refused
        },
    )
    assert resumed.wait() == 0, resumed.stderr()
    got = losses(resumed.lines())
    assert min(got) == step + 1
    assert got == {s: baseline_3ranks[s] for s in range(step + 1, 41)}


def test_kill9_during_a_checkpoint_write_leaves_the_previous_checkpoint_latest(
    tmp_path: Path, no_agent: dict[str, str]
) -> None:
    ck = tmp_path / "ck"
    args = ["--steps", "40", "--ckpt-dir", str(ck), "--checkpoint-every", "10"]
    run = Run(tmp_path, args, env={**no_agent, "TRAINGUARD_CHAOS": "pause_write@step20"})
    partial = wait_for(
        lambda: next(iter(ck.glob("step_000020.tmp-*/rank_00000.pt")), None),
        timeout_s=60,
        what="the step-20 writer to be mid-write",
    )
    run.kill()
    assert partial.exists()
    found = find_latest_good(ck)
    assert found is not None and found[0] == 10
    resumed = Run(tmp_path, [*args, "--steps", "12"], env=no_agent)
    assert resumed.wait() == 0, resumed.stderr()
    assert min(losses(resumed.lines())) == 11
    assert not list(ck.glob("*.tmp-*")), "the stale temporary directory is cleaned at start"


def test_kill9_during_a_delta_write_resumes_bitwise_through_the_chain(
    tmp_path: Path, no_agent: dict[str, str]
) -> None:
    # full_every 3: 5 full, 10 and 15 deltas of it, 20 full. Killed while 15's delta is
    # written: the newest good one is the delta 10, and resuming from it (decoded against 5)
    # reproduces the uninterrupted run's losses bit for bit.
    common = ["--steps", "20", "--checkpoint-every", "5", "--full-every", "3", "--seed", "4"]
    straight = Run(tmp_path, [*common, "--ckpt-dir", str(tmp_path / "a")], env=no_agent)
    ck = tmp_path / "b"
    killed = Run(
        tmp_path,
        [*common, "--ckpt-dir", str(ck)],
        env={**no_agent, "TRAINGUARD_CHAOS": "pause_write@step15"},
    )
    partial = wait_for(
        lambda: next(iter(ck.glob("step_000015.tmp-*/rank_00000.pt")), None),
        timeout_s=60,
        what="the step-15 writer to be mid-write",
    )
    assert (partial.parent / "delta_00000.bin").exists(), "a delta was being written"
    killed.kill()
    found = find_latest_good(ck)
    assert found is not None and found[0] == 10 and found[2].format == "delta"
    assert straight.wait() == 0, straight.stderr()
    resumed = Run(tmp_path, [*common, "--ckpt-dir", str(ck)], env=no_agent)
    assert resumed.wait() == 0, resumed.stderr()
    got = losses(resumed.lines())
    expected = losses(straight.lines())
    assert got == {s: expected[s] for s in range(11, 21)}
    # keep_last 3 keeps 20, 15, 10, and retention keeps 5 too: the base of the deltas 10, 15
    assert {s: read_manifest(p).format for s, p in list_committed(ck)} == {
        20: "tensors", 15: "delta", 10: "delta", 5: "tensors"
    }  # fmt: skip


def _finite_checkpoint(path: Path) -> bool:
    rank_state = load_rank_file(path / "rank_00000.pt")
    flat = read_tensor_file(path / "tensors_00000.bin", rank_state["tensor_index"])
    state = fill_tensors(rank_state["skeleton"], flat)
    tensors = list(state["model"].values())
    for s in state["optim"]["state"].values():
        tensors += [t for t in s.values() if isinstance(t, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def test_nan_with_rollback_reports_never_commits_nonfinite_state_and_resumes(
    tmp_path: Path, sock_dir: Path
) -> None:
    agent = FakeAgent(sock_dir)
    env = {"TRAINGUARD_AGENT_SOCKET": agent.path, "TRAINGUARD_CHAOS": "nan@step17"}
    ck = tmp_path / "ck"
    args = [
        "--steps",
        "40",
        "--ckpt-dir",
        str(ck),
        "--checkpoint-every",
        "5",
        "--keep-last",
        "0",
        "--nan-policy",
        "rollback",
        "--skip-batches",
        "3",
    ]
    try:
        run = Run(tmp_path, args, env=env)
        assert run.wait() == 0, run.stderr()
        wait_for(
            lambda: any(h.event == "exit" for h in agent.heartbeats()),
            timeout_s=10,
            what="the exit heartbeat",
        )
        hbs = agent.heartbeats()
    finally:
        agent.close()
    nan_events = [h for h in hbs if h.event == "nan_loss"]
    assert [h.event_data["step"] for h in nan_events] == [17]
    assert nan_events[0].loss is not None and math.isnan(nan_events[0].loss)
    lines = run.lines()
    assert [ln["step"] for ln in lines if ln.get("action") == "rollback"] == [17]
    assert lines[-1]["step"] == 40
    committed = [s for s, _ in list_committed(ck)]
    assert committed == [40, 35, 30, 25, 20, 15, 10, 5]
    assert all(_finite_checkpoint(ck / f"step_{s:06d}") for s in committed)
    resumed = Run(tmp_path, [*args, "--steps", "42"], env={"TRAINGUARD_CHAOS": ""})
    assert resumed.wait() == 0, resumed.stderr()
    assert [ln["step"] for ln in resumed.lines()] == [41, 42]


def test_sigterm_takes_an_emergency_checkpoint_and_exits_zero(
    tmp_path: Path, no_agent: dict[str, str]
) -> None:
    ck = tmp_path / "ck"
    run = Run(
        tmp_path,
        [
            "--steps",
            "400",
            "--ckpt-dir",
            str(ck),
            "--checkpoint-every",
            "0",
            "--step-time-s",
            "0.05",
            "--sigterm-grace-s",
            "20",
        ],
        env=no_agent,
    )
    wait_for(lambda: len(run.lines()) >= 5, timeout_s=60, what="five steps")
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(60) == 0, run.stderr()
    last = run.lines()[-1]
    assert last["action"] == "stop" and last["reason"] == "sigterm"
    assert last["ckpt_step"] == last["step"]
    found = find_latest_good(ck)
    assert found is not None and found[0] == last["step"]


# --- DataLoader workers: stop signals and resume with random augmentation ---------------------

_WORKER_ARGS = [
    "--steps", "40", "--checkpoint-every", "0", "--num-workers", "2", "--augment-noise", "0.3",
    "--samples", "512", "--batch-size", "8", "--seed", "5", "--sigterm-grace-s", "30",
]  # fmt: skip


def _sigterm_mid_epoch(run: Run, *, after_step: int) -> None:
    wait_for(
        lambda: len(run.lines()) >= after_step or run.proc.poll() is not None,
        timeout_s=90,
        what=f"step {after_step}",
    )
    assert run.proc.poll() is None, "the run finished before it could be signalled"


def test_sigterm_to_the_process_group_with_loader_workers_checkpoints_and_resumes_bitwise(
    tmp_path: Path, no_agent: dict[str, str]
) -> None:
    # 64 batches an epoch: the signal lands mid-epoch. killpg reaches the DataLoader's workers
    # too, as a launcher's stop does.
    straight = Run(tmp_path, [*_WORKER_ARGS, "--ckpt-dir", str(tmp_path / "a")], env=no_agent)
    ck = tmp_path / "b"
    run = Run(
        tmp_path, [*_WORKER_ARGS, "--ckpt-dir", str(ck), "--step-time-s", "0.05"], env=no_agent
    )
    _sigterm_mid_epoch(run, after_step=8)
    os.killpg(run.proc.pid, signal.SIGTERM)
    assert run.wait(60) == 0, run.stderr()
    last = run.lines()[-1]
    assert last["action"] == "stop" and last["reason"] == "sigterm", last
    found = find_latest_good(ck)
    assert found is not None and found[0] == last["step"]
    assert straight.wait() == 0, straight.stderr()
    resumed = Run(tmp_path, [*_WORKER_ARGS, "--ckpt-dir", str(ck)], env=no_agent)
    assert resumed.wait() == 0, resumed.stderr()
    got = losses(resumed.lines())
    assert min(got) == last["step"] + 1
    expected = losses(straight.lines())
    assert got == {s: expected[s] for s in range(last["step"] + 1, 41)}


def test_sigterm_forwarded_by_torchrun_with_loader_workers_checkpoints_all_ranks_and_resumes(
    tmp_path: Path, no_agent: dict[str, str]
) -> None:
    # torchrun forwards SIGTERM to each rank's process group, the rank's DataLoader workers
    # included; 2 gloo ranks, 2 workers each, random augmentation.
    straight = Run(
        tmp_path, [*_WORKER_ARGS, "--ckpt-dir", str(tmp_path / "a")], nproc=2, env=no_agent
    )
    assert straight.wait() == 0, straight.stderr()
    ck = tmp_path / "b"
    run = Run(
        tmp_path,
        [*_WORKER_ARGS, "--ckpt-dir", str(ck), "--step-time-s", "0.05"],
        nproc=2,
        env=no_agent,
    )
    _sigterm_mid_epoch(run, after_step=8)
    run.proc.send_signal(signal.SIGTERM)  # the launcher only: it signals the ranks
    run.wait(90)  # torchrun itself exits non-zero after a signal; the ranks' outcome counts
    last = run.lines()[-1]
    assert last["action"] == "stop" and last["reason"] == "sigterm", (last, run.stderr())
    found = find_latest_good(ck)
    assert found is not None and found[0] == last["step"]
    assert read_manifest(found[1]).world_size == 2
    assert "killed by signal" not in run.stderr()
    resumed = Run(tmp_path, [*_WORKER_ARGS, "--ckpt-dir", str(ck)], nproc=2, env=no_agent)
    assert resumed.wait() == 0, resumed.stderr()
    got = losses(resumed.lines())
    assert min(got) == last["step"] + 1
    expected = losses(straight.lines())
    assert got == {s: expected[s] for s in range(last["step"] + 1, 41)}
