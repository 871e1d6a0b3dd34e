"""examples/train_own_ckpt.py (a job with its own DCP checkpointer) under real torchrun, 2 gloo
ranks, heartbeats to a fake agent: a checkpoint request sent to one rank is served by the
job's save at one step on both ranks and reported committed; SIGTERM saves and stops (no
rank killed); a relaunch resumes from the job's own checkpoint with the same losses, bit for
bit."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import free_port, wait_for
from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.protocol import Control, Heartbeat, encode_json

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "train_own_ckpt.py")
pytestmark = pytest.mark.slow


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    d = Path(tempfile.mkdtemp(prefix="tgo-"))  # short: unix socket paths are <= 107 bytes
    a = FakeAgent(d)
    yield a
    a.close()
    shutil.rmtree(d, ignore_errors=True)


def launch(agent: FakeAgent, out: Path, args: list[str]) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRAINGUARD_AGENT_SOCKET": agent.path,
        "TRAINGUARD_CONTROL_DIR": str(Path(agent.path).parent),
        "TRAINGUARD_JOB": "own",
        "TRAINGUARD_CHAOS": "",
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
        "--max-restarts", "0", EXAMPLE, *args,
    ]  # fmt: skip
    with open(out, "wb") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.PIPE, env=env, cwd=REPO, start_new_session=True
        )


def lines(out: Path) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in out.read_text().splitlines() if raw.startswith("{")]


def test_request_sigterm_and_resume_with_the_jobs_own_checkpointer(
    tmp_path: Path, agent: FakeAgent
) -> None:
    ck = tmp_path / "ck"
    out = tmp_path / "first.jsonl"
    args = ["--ckpt-dir", str(ck), "--checkpoint-every", "0", "--step-time-s", "0.05"]
    run = launch(agent, out, ["--steps", "400", *args])
    try:
        rank1 = wait_for(
            lambda: next((h for h in agent.heartbeats() if h.rank == 1 and h.step >= 3), None),
            timeout_s=60,
            what="rank 1 to reach step 3",
        )
        assert rank1.control_socket is not None
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:  # one rank only
            s.sendto(
                encode_json(Control(action="checkpoint", request_id="r1")), rank1.control_socket
            )

        def committed() -> list[Heartbeat]:
            hbs = [
                h
                for h in agent.heartbeats()
                if h.event == "checkpoint_committed" and h.event_data.get("request_id") == "r1"
            ]
            return hbs if {h.rank for h in hbs} == {0, 1} else []

        events = wait_for(committed, timeout_s=30, what="both ranks to report the commit")
        (requested,) = {h.event_data["step"] for h in events}
        assert (ck / f"step_{requested:06d}").is_dir()
        wait_for(lambda: len(lines(out)) >= requested + 3, timeout_s=30, what="3 more steps")
        run.send_signal(signal.SIGTERM)  # the launcher only: it signals the ranks
        # torchrun itself exits non-zero after a signal; the ranks' outcome counts
        _, err = run.communicate(timeout=60)
        assert b"killed by signal" not in err, err.decode()[-3000:]
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    first = lines(out)
    last = first[-1]
    assert (last["action"], last["reason"]) == ("stop", "sigterm")
    stopped = last["step"]
    assert last["ckpt_step"] == stopped and (ck / f"step_{stopped:06d}").is_dir()

    # Without the SIGTERM's checkpoint the relaunch resumes from the requested one and runs
    # the steps after it again: the same losses, bit for bit.
    shutil.rmtree(ck / f"step_{stopped:06d}")
    again = tmp_path / "again.jsonl"
    rerun = launch(agent, again, ["--steps", str(stopped), *args])
    _, err = rerun.communicate(timeout=90)
    assert rerun.returncode == 0, err.decode()[-3000:]
    resumed = lines(again)
    assert resumed[0]["step"] == requested + 1
    before = {r["step"]: r["loss"] for r in first if r["step"] > requested}
    assert {r["step"]: r["loss"] for r in resumed} == before
