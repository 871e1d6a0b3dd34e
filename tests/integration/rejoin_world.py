"""The side that re-forms a world of examples/trainer_ddp_rejoin.py processes: it runs the
rendezvous TCPStore, starts ranks and warm standbys, and publishes memberships after a
fault. Shared by the in-process rejoin test and bench/inprocess_restart.py."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from trainguard.membership import Membership
from trainguard.trainer.rejoin import publish_membership

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "examples" / "trainer_ddp_rejoin.py"


class World:
    def __init__(self, workdir: Path, *, job: str, port: int, steps: int) -> None:
        self.workdir = workdir
        self.job = job
        self.port = port
        self.steps = steps
        self.store = dist.TCPStore(
            "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60),
            wait_for_workers=False,
        )  # fmt: skip
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ckpt_dir = workdir / "ck"

    def start(self, name: str, *, membership: Membership | None, extra: list[str] = ()) -> int:
        """Start one process (`membership` None: a warm standby); returns its pid."""
        cmd = [
            sys.executable, str(WORKER), "--store", f"127.0.0.1:{self.port}", "--job", self.job,
            "--ckpt-dir", str(self.ckpt_dir), "--out", str(self.out(name)),
            "--steps", str(self.steps), *extra,
        ]  # fmt: skip
        cmd += ["--membership", membership.to_json()] if membership else ["--standby"]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "TRAINGUARD_AGENT_SOCKET": str(self.workdir / "absent.sock"),
            "TRAINGUARD_CHAOS": "",
        }
        with open(self.log(name), "ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                start_new_session=True,
            )  # fmt: skip
        self.procs[name] = proc
        return proc.pid

    def membership(self, *, rank: int, world_size: int, epoch: int) -> Membership:
        return Membership(
            rank=rank, world_size=world_size, store_host="127.0.0.1", store_port=self.port,
            epoch=epoch, timeout_s=30.0,
        )  # fmt: skip

    def publish(self, pid: int, membership: Membership) -> None:
        publish_membership(self.store, job=self.job, pid=pid, membership=membership)

    def out(self, name: str) -> Path:
        return self.workdir / f"{name}.jsonl"

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def rows(self, name: str) -> list[dict[str, Any]]:
        path = self.out(name)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def losses(self, name: str) -> dict[int, str]:
        return {r["step"]: r["loss"] for r in self.rows(name)}

    def kill(self, name: str) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(30)

    def wait(self, name: str, timeout_s: float) -> int:
        try:
            return self.procs[name].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} did not finish in {timeout_s}s:\n{self.output()}"
            ) from None

    def output(self) -> str:
        return "\n".join(f"--- {name}\n{self.log(name).read_text()[-3000:]}" for name in self.procs)

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name)
