"""Helpers for integration tests that run a real `trainguard-agent` process."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.helpers import short_tmpdir, wait_for
from trainguard.agent.launchrec import load_records

__all__ = [
    "AgentProcess",
    "agent_command",
    "cleanup",
    "kill_launches",
    "launch_pids",
    "sample_value",
    "short_tmpdir",
]


def agent_command() -> list[str]:
    """The installed console script next to this interpreter, else the module."""
    script = Path(sys.executable).with_name("trainguard-agent")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "trainguard.agent.main"]


class AgentProcess:
    """A running agent (sim backend by default) with its stderr in a file."""

    def __init__(
        self,
        workdir: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        log_name: str = "agent.log",
    ) -> None:
        """`log_name`: a restarted agent on the same workdir keeps the earlier one's log."""
        self.workdir = workdir
        self.socket_path = workdir / "hb.sock"
        self.log_path = workdir / log_name
        self._log = self.log_path.open("wb")
        args = [
            *agent_command(),
            "--gpu-backend", "sim", "--gpus", "8", "--ib-ports", "8",
            "--node-name", "node-1", "--metrics-port", "0", "--metrics-address", "127.0.0.1",
            "--heartbeat-socket", str(self.socket_path), "--jobs-dir", str(workdir / "jobs"),
            *extra,
        ]  # fmt: skip
        full_env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=self._log, env=full_env, cwd=workdir
        )
        self.port = int(
            wait_for(
                self._port,
                timeout_s=30,
                what=f"the agent to log its metrics port ({self.log_path})",
            )
        )

    def _port(self) -> str | None:
        if self.proc.poll() is not None:
            pytest.fail(f"agent exited with {self.proc.returncode}:\n{self.log()}")
        m = re.search(r"metrics_port=(\d+)", self.log())
        return m.group(1) if m else None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def inject(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*agent_command(), "inject", "--metrics-port", str(self.port), *args],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip

    def terminate(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


def sample_value(body: str, name: str, **labels: str) -> float | None:
    for line in body.splitlines():
        m = re.match(r"^(\w+)\{(.*)\} (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def cleanup(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def launch_pids(launch_id: str) -> set[int]:
    """Live processes whose environment carries TRAINGUARD_LAUNCH_ID=<launch_id>."""
    needle = f"TRAINGUARD_LAUNCH_ID={launch_id}".encode()
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue
        except OSError:
            continue
        out.add(int(entry))
    return out


def kill_launches(jobs_dir: Path) -> None:
    """SIGKILL every process of the launches recorded under `jobs_dir` (an agent leaves its
    jobs running when it stops: a test ends them itself)."""
    for record in load_records(jobs_dir / "launches"):
        for pid in launch_pids(record.launch_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
