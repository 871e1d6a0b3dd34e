"""The HF Transformers Trainer example (examples/train_hf.py) under torchrun, 2 gloo ranks on
CPU, heartbeats to a fake agent socket: a controller's checkpoint request commits at one step
on both ranks; a kill -9, a corrupted newest checkpoint, and the relaunch resumes from the
newest one that verifies with the same losses as the run before the kill; SIGTERM saves and
stops both ranks at one step, exit 0. Two launches in all (each pays transformers' import)."""

from __future__ import annotations

import contextlib
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

from tests.helpers import wait_for
from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.protocol import Control, Heartbeat, encode_json
from trainguard.trainer.integrations.hf_checksums import CHECKSUMS_NAME

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

_START_TIMEOUT_S = 150.0  # two interpreters importing torch and transformers on a busy machine
_WAIT_S = 60.0


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    d = Path(tempfile.mkdtemp(prefix="tghf-"))  # short: unix socket paths are <= 107 bytes
    a = FakeAgent(d)
    yield a
    a.close()
    shutil.rmtree(d, ignore_errors=True)


class Launch:
    """One `torchrun --nproc-per-node 2 examples/train_hf.py` in its own process group."""

    def __init__(self, *, out: Path, agent: FakeAgent, log: Path) -> None:
        self.agent = agent
        env = {
            **os.environ,
            "TRAINGUARD_AGENT_SOCKET": agent.path,
            "TRAINGUARD_JOB": "hf-it",
            "TRAINGUARD_CHAOS": "",
            "OMP_NUM_THREADS": "1",
        }
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(REPO / "examples" / "train_hf.py"), "--output-dir", str(out), "--steps", "400",
            "--save-steps", "4", "--save-total-limit", "6", "--step-time-s", "0.1",
        ]  # fmt: skip
        self.log = log
        self.stdout = open(log.with_suffix(".out"), "w")
        self.stderr = open(log.with_suffix(".err"), "w")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=self.stdout, stderr=self.stderr, start_new_session=True
        )
        self.since = len(agent.heartbeats())

    def losses(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for line in self.log.with_suffix(".out").read_text().splitlines():
            if line.startswith('{"step"'):
                rec = json.loads(line)
                out[rec["step"]] = rec["loss"]
        return out

    def stderr_text(self) -> str:
        return self.log.with_suffix(".err").read_text()

    def kill9(self) -> None:
        """SIGKILL to the ranks (torchrun starts each in a session of its own) and torchrun."""
        for pid in {h.pid for h in self.agent.heartbeats()[self.since :] if h.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill9()
        self.stdout.close()
        self.stderr.close()


def mine(agent: FakeAgent, launch: Launch) -> list[Heartbeat]:
    return agent.heartbeats()[launch.since :]


def per_rank(hbs: list[Heartbeat], **match: Any) -> dict[int, Heartbeat]:
    """The first heartbeat of each rank whose fields equal `match`."""
    found: dict[int, Heartbeat] = {}
    for h in hbs:
        if h.rank not in found and all(getattr(h, k) == v for k, v in match.items()):
            found[h.rank] = h
    return found


def send(control_socket: str | None, action: str, request_id: str) -> None:
    assert control_socket is not None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.sendto(encode_json(Control(action=action, request_id=request_id)), control_socket)  # type: ignore[arg-type]
    finally:
        s.close()


def test_hf_trainer_request_kill9_resume_verified_and_sigterm(
    tmp_path: Path, agent: FakeAgent
) -> None:
    out = tmp_path / "out"
    first = Launch(out=out, agent=agent, log=tmp_path / "first")
    try:
        # Heartbeats from both ranks, with the loss, throughput and compute time of a step.
        train = wait_for(
            lambda: (
                t
                if len(t := per_rank([h for h in mine(agent, first) if h.step >= 3], phase="train"))
                == 2
                else None
            ),
            timeout_s=_START_TIMEOUT_S,
            what="train heartbeats of both ranks",
        )
        for h in train.values():
            assert h.job == "hf-it" and h.world_size == 2
            assert h.loss is not None and h.samples_per_s and h.compute_time_s is not None

        # A checkpoint request reaching the ranks one after the other commits at one step.
        for h in train.values():
            send(h.control_socket, "checkpoint", "hf-req")
        commits = wait_for(
            lambda: (
                c
                if len(
                    c := per_rank(
                        [
                            h
                            for h in mine(agent, first)
                            if h.event == "checkpoint_committed"
                            and h.event_data["request_id"] == "hf-req"
                        ]
                    )
                )
                == 2
                else None
            ),
            timeout_s=_WAIT_S,
            what="checkpoint_committed for the request on both ranks",
        )
        req_step = {h.event_data["step"] for h in commits.values()}
        assert len(req_step) == 1
        (req,) = req_step
        assert (out / f"checkpoint-{req}" / "model.safetensors").is_file()

        # Two periodic commits after it, a few steps more, then kill -9 of the whole launch.
        def periodic_after() -> list[int] | None:
            steps = sorted(
                {
                    h.event_data["step"]
                    for h in mine(agent, first)
                    if h.event == "checkpoint_committed" and h.event_data["step"] > req
                }
            )
            return steps if len(steps) >= 2 else None

        wait_for(periodic_after, timeout_s=_WAIT_S, what="two periodic commits after the request")
        last = max(h.step for h in mine(agent, first))
        wait_for(
            lambda: max(h.step for h in mine(agent, first)) >= last + 2,
            timeout_s=_WAIT_S,
            what="two more steps",
        )
        first.kill9()
    finally:
        first.close()
    before = first.losses()

    # Corrupt the newest checkpoint with checksums: the relaunch must skip it.
    with_checksums = [d for d in out.glob("checkpoint-*") if (d / CHECKSUMS_NAME).is_file()]
    recorded = sorted((int(d.name.split("-")[1]) for d in with_checksums), reverse=True)
    newest, resume_step = recorded[0], recorded[1]
    weights = out / f"checkpoint-{newest}" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))

    second = Launch(out=out, agent=agent, log=tmp_path / "second")
    try:
        resumed = wait_for(
            lambda: (
                t
                if len(
                    t := per_rank(
                        [h for h in mine(agent, second) if h.step > resume_step + 1],
                        phase="train",
                    )
                )
                == 2
                else None
            ),
            timeout_s=_START_TIMEOUT_S,
            what="train heartbeats of the relaunch",
        )
        assert {h.ckpt_step for h in resumed.values()} >= {resume_step}
        # SIGTERM to each rank: a save, then a stop, at one step on both; exit 0.
        for h in resumed.values():
            os.kill(h.pid, signal.SIGTERM)
        assert second.proc.wait(_WAIT_S) == 0
    finally:
        second.close()
    err = second.stderr_text()
    assert f"event=checkpoint_skipped step={newest} " in err
    assert "sha256_mismatch" in err
    for rank in (0, 1):
        assert f"event=resumed job=hf-it rank={rank} step={resume_step} " in err
    hbs = mine(agent, second)
    stops = per_rank([h for h in hbs if h.event == "stop"])
    assert {h.event_data["reason"] for h in stops.values()} == {"sigterm"}
    (stop_step,) = {h.event_data["step"] for h in stops.values()}
    saved = per_rank([h for h in hbs if h.event == "checkpoint_committed"], step=stop_step)
    assert len(saved) == 2
    assert (out / f"checkpoint-{stop_step}" / CHECKSUMS_NAME).is_file()

    # The steps run again after the resume have the losses of the run before the kill, bitwise.
    after = second.losses()
    overlap = sorted(set(before) & set(after))
    assert overlap and overlap[0] == resume_step + 1 and overlap[-1] >= newest
    assert {s: after[s] for s in overlap} == {s: before[s] for s in overlap}
