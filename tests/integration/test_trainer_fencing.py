"""Fencing between attempts in real processes: two torchrun launches of one job, attempts 1
and 2, against one checkpoint directory. Attempt 1 keeps running while attempt 2 starts; its
next commit is refused, it stops, and every checkpoint committed from then on is attempt 2's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_for
from trainguard.agent.jobs import find_launch_processes
from trainguard.command_args import LAUNCH_ID_ENV
from trainguard.trainer.fence import read_epoch
from trainguard.trainer.manifest import list_committed, read_manifest

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "examples" / "train.py")
pytestmark = pytest.mark.slow


class Launch:
    """One `torchrun --standalone` launch of examples/train.py as attempt `attempt`."""

    def __init__(self, workdir: Path, *, attempt: int, args: list[str], nproc: int = 2) -> None:
        self.attempt = attempt
        self.out = workdir / f"attempt{attempt}.jsonl"
        self.err = workdir / f"attempt{attempt}.log"
        self.launch_id = f"fence-{os.getpid()}-{attempt}-{time.monotonic_ns()}"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TRAINGUARD_AGENT_SOCKET": str(workdir / "absent.sock"),
            "TRAINGUARD_CHAOS": "",
            "TRAINGUARD_JOB": "fence-job",
            "TRAINGUARD_ATTEMPT": str(attempt),
            LAUNCH_ID_ENV: self.launch_id,
        }
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "--max-restarts", "0", TRAIN, *args,
        ]  # fmt: skip
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=err, env=env, cwd=REPO, start_new_session=True
            )

    def lines(self) -> list[dict[str, Any]]:
        out = []
        for raw in self.out.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    def log(self) -> str:
        return self.err.read_text()

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"attempt {self.attempt} did not finish in {timeout_s}s: {self.log()[-3000:]}"
            ) from None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        # torchrun's workers live in sessions of their own: the launch marker finds them
        for pid in find_launch_processes(leader_pid=self.proc.pid, launch_id=self.launch_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)


@pytest.fixture
def launches() -> Iterator[list[Launch]]:
    started: list[Launch] = []
    yield started
    for launch in started:
        launch.kill()


def committed_epochs(ckpt: Path) -> dict[int, int | None]:
    return {step: read_manifest(path).extra.get("epoch") for step, path in list_committed(ckpt)}


def test_an_older_attempt_still_running_is_fenced_off_by_the_newer_one(
    tmp_path: Path, launches: list[Launch]
) -> None:
    ckpt = tmp_path / "ck"
    common = ["--ckpt-dir", str(ckpt), "--checkpoint-every", "5", "--keep-last", "0"]
    first = Launch(tmp_path, attempt=1, args=[*common, "--step-time-s", "0.1", "--steps", "100000"])
    launches.append(first)
    wait_for(
        lambda: (
            any(step >= 10 for step, _ in list_committed(ckpt)) or first.proc.poll() is not None
        ),
        timeout_s=120,
        what="attempt 1 to commit its checkpoint of step 10",
    )
    assert first.proc.poll() is None, first.log()[-3000:]
    assert read_epoch(ckpt) == 1

    # attempt 1 keeps running (a partitioned node, or workers of a killed launcher)
    # --steps is absolute: attempt 2 trains well past wherever attempt 1 has got to by the time
    # it starts (600 of attempt 1's 0.1 s steps: a minute of start-up on a loaded machine), and
    # steps faster itself, so the run stays short when start-up is quick
    end = max(step for step, _ in list_committed(ckpt)) + 600
    second = Launch(
        tmp_path, attempt=2, args=[*common, "--step-time-s", "0.02", "--steps", str(end)]
    )
    launches.append(second)
    assert second.wait(240) == 0, second.log()[-3000:]
    assert first.wait(120) == 0, first.log()[-3000:]
    assert read_epoch(ckpt) == 2

    # attempt 2 resumed from attempt 1's newest checkpoint and trained to the end
    got2 = second.lines()
    resumed_from = got2[0]["step"] - 1
    assert resumed_from >= 10
    assert [line["step"] for line in got2] == list(range(resumed_from + 1, end + 1))

    # attempt 1 trained on past that point, its next commit was refused and it stopped
    got1 = first.lines()
    last1 = got1[-1]
    assert last1.get("action") == "stop" and last1["reason"] == "stale_attempt", last1
    assert last1["step"] > resumed_from
    assert "checkpoint refused: attempt 1 is older than the directory's attempt 2" in first.log()
    # ... and never counted a commit after attempt 2 started
    assert max(line["ckpt_step"] or 0 for line in got1) == resumed_from

    # every checkpoint after attempt 2 started is attempt 2's; no partial one is left over
    epochs = committed_epochs(ckpt)
    assert {s: e for s, e in epochs.items() if s > resumed_from} == {
        s: 2 for s in range(resumed_from + 1, end + 1) if s % 5 == 0
    }
    assert all(e == 1 for s, e in epochs.items() if s <= resumed_from)
    assert not [p for p in os.listdir(ckpt) if ".tmp-" in p or ".replaced-" in p]
