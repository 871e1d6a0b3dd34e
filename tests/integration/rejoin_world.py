"""The side that re-forms a world of examples/trainer_ddp_rejoin.py processes: it runs the
rendezvous TCPStore, starts ranks and warm standbys, and publishes memberships after a
fault (in its store, or, as the agent relays them, as `rejoin` Controls to a rank's control
socket; with `agent=True` it also takes the ranks' heartbeats, as an agent would). Shared by
the in-process rejoin test and bench/inprocess_restart.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.helpers import short_tmpdir
from trainguard.membership import Membership
from trainguard.protocol import Control, Heartbeat, decode_json, encode_json
from trainguard.trainer.rejoin import publish_membership

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "examples" / "trainer_ddp_rejoin.py"


class AgentSocket:
    """Where the ranks send heartbeats: a thread keeps every one, as the agent does."""

    def __init__(self) -> None:
        self.dir = short_tmpdir("tg-rejoin")  # a unix socket path is at most 107 bytes
        self.path = str(self.dir / "hb.sock")
        self.control_dir = self.dir / "ctl"
        self.control_dir.mkdir()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._sock.settimeout(0.1)
        self._lock = threading.Lock()
        self._beats: list[Heartbeat] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                raw = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._beats.append(decode_json(Heartbeat, raw))

    def heartbeats(self) -> list[Heartbeat]:
        with self._lock:
            return list(self._beats)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class World:
    def __init__(
        self, workdir: Path, *, job: str, port: int, steps: int, agent: bool = False
    ) -> None:
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
        self.agent = AgentSocket() if agent else None

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
        if self.agent is not None:
            env["TRAINGUARD_AGENT_SOCKET"] = self.agent.path
            env["TRAINGUARD_CONTROL_DIR"] = str(self.agent.control_dir)
        with open(self.log(name), "ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                start_new_session=True,
            )  # fmt: skip
        self.procs[name] = proc
        return proc.pid

    def membership(
        self,
        *,
        rank: int,
        world_size: int,
        epoch: int,
        port: int | None = None,
        host_store: bool = False,
    ) -> Membership:
        """A membership of a world whose store is this harness's (or, at `port` with
        `host_store`, run by its rank 0)."""
        return Membership(
            rank=rank, world_size=world_size, store_host="127.0.0.1",
            store_port=self.port if port is None else port, epoch=epoch, timeout_s=30.0,
            host_store=host_store,
        )  # fmt: skip

    def publish(self, pid: int, membership: Membership) -> None:
        publish_membership(self.store, job=self.job, pid=pid, membership=membership)

    def send_rejoin(self, pid: int, membership: Membership, *, request_id: str) -> None:
        """What the agent does with the controller's decision: a `rejoin` Control to the
        control socket the process's heartbeats name."""
        assert self.agent is not None, "send_rejoin needs World(agent=True)"
        path = next(
            h.control_socket for h in self.agent.heartbeats() if h.pid == pid and h.control_socket
        )
        control = Control(
            action="rejoin", request_id=request_id, job=self.job, membership=membership.to_json()
        )
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(encode_json(control), path)

    def heartbeats(self, pid: int) -> list[Heartbeat]:
        assert self.agent is not None
        return [h for h in self.agent.heartbeats() if h.pid == pid]

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
        if self.agent is not None:
            self.agent.close()
