"""examples/train_lightning.py (Lightning, DDP on 2 gloo CPU ranks, trainguard's callback)
under real torchrun, heartbeats to a fake agent: a checkpoint request sent to one rank
commits at one step on both ranks through Lightning's own save; kill -9 of both ranks and a
relaunch resume from it with the losses the killed launch computed after that step, bit for
bit, across an epoch boundary; SIGTERM saves and stops; the last relaunch resumes from that
save."""

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

from tests.helpers import alive, free_port, wait_for
from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.protocol import Control, Heartbeat, encode_json
from trainguard.trainer.manifest import find_latest_good, read_manifest

pytest.importorskip("lightning")

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = str(REPO / "examples" / "train_lightning.py")
pytestmark = pytest.mark.slow


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    d = Path(tempfile.mkdtemp(prefix="tgl-"))  # short: unix socket paths are <= 107 bytes
    a = FakeAgent(d)
    yield a
    a.close()
    shutil.rmtree(d, ignore_errors=True)


class Launch:
    """One torchrun launch of the example, rank 0's JSON lines in `out`."""

    def __init__(self, agent: FakeAgent, out: Path, args: list[str]) -> None:
        self.out = out
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TRAINGUARD_AGENT_SOCKET": agent.path,
            "TRAINGUARD_CONTROL_DIR": str(Path(agent.path).parent),
            "TRAINGUARD_JOB": "pl",
            "TRAINGUARD_CHAOS": "",
        }
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "0",
            EXAMPLE, *args,
        ]  # fmt: skip
        with open(out, "wb") as f:
            self.proc = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.PIPE, env=env, cwd=REPO, start_new_session=True
            )

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(r) for r in self.out.read_text().splitlines() if r.startswith("{")]

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.lines()}

    def finish(self, timeout_s: float = 90) -> str:
        try:
            _, err = self.proc.communicate(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return err.decode(errors="replace")


def newest(agent: FakeAgent, rank: int, since: int) -> Heartbeat | None:
    return next(
        (h for h in reversed(agent.heartbeats()[since:]) if h.rank == rank and h.phase == "train"),
        None,
    )


def test_lightning_request_kill9_sigterm_and_resume_bitwise(
    tmp_path: Path, agent: FakeAgent
) -> None:
    ck = tmp_path / "ck"
    args = ["--ckpt-dir", str(ck), "--checkpoint-every", "0", "--step-time-s", "0.03",
            "--batch-size", "64"]  # fmt: skip

    # A request to rank 1 only: both ranks save at one step, through Lightning's save.
    first = Launch(agent, tmp_path / "first.jsonl", ["--steps", "200", *args])
    rank1 = wait_for(lambda: newest(agent, 1, 0), timeout_s=60, what="rank 1 training")
    assert rank1.control_socket is not None and rank1.compute_time_s is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(encode_json(Control(action="checkpoint", request_id="r1")), rank1.control_socket)

    def committed() -> list[Heartbeat]:
        hbs = [
            h
            for h in agent.heartbeats()
            if h.event == "checkpoint_committed" and h.event_data.get("request_id") == "r1"
        ]
        return hbs if {h.rank for h in hbs} == {0, 1} else []

    events = wait_for(committed, timeout_s=30, what="both ranks to report the commit")
    (requested,) = {h.event_data["step"] for h in events}
    found = find_latest_good(ck)
    assert found is not None and found[0] == requested
    assert read_manifest(found[1]).world_size == 2

    # kill -9 of both ranks more than an epoch (8 steps) later
    wait_for(lambda: len(first.lines()) >= requested + 10, timeout_s=30, what="10 more steps")
    pids = {h.pid for h in agent.heartbeats() if h.pid}
    assert len(pids) == 2
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    first.finish()
    assert not any(alive(p) for p in pids)
    uninterrupted = first.losses()  # every step up to the kill

    # Relaunch: resumes from the requested step, the same losses as before the kill, bit for
    # bit (across an epoch boundary); SIGTERM then saves and stops.
    seen = len(agent.heartbeats())
    second = Launch(agent, tmp_path / "second.jsonl", ["--steps", "200", *args])
    wait_for(
        lambda: (
            len(second.lines()) >= len(uninterrupted) - requested + 2
            or second.proc.poll() is not None
        ),
        timeout_s=60,
        what="the steps of the first launch again, and 2 more",
    )
    second.proc.send_signal(signal.SIGTERM)  # the launcher only: it signals the ranks
    err = second.finish()
    assert "killed by signal" not in err, err[-3000:]
    lines = second.lines()
    assert lines[0]["step"] == requested + 1, lines[0]
    again = second.losses()
    overlap = [s for s in uninterrupted if s > requested]
    assert len(overlap) >= 10
    assert {s: again[s] for s in overlap} == {s: uninterrupted[s] for s in overlap}
    last = lines[-1]
    assert (last.get("action"), last.get("reason")) == ("stop", "sigterm"), last
    stopped = last["step"]
    assert last["ckpt_step"] == stopped
    stops = [h for h in agent.heartbeats()[seen:] if h.event == "stop"]
    assert {h.rank for h in stops} == {0, 1} and {h.event_data["step"] for h in stops} == {stopped}

    # The last relaunch resumes from the SIGTERM's checkpoint and finishes.
    third = Launch(agent, tmp_path / "third.jsonl", ["--steps", str(stopped + 2), *args])
    err = third.finish()
    assert third.proc.returncode == 0, err[-3000:]
    assert sorted(third.losses()) == [stopped + 1, stopped + 2]
