"""Start a script as the ranks of one gloo process group (RANK / WORLD_SIZE / MASTER_*), each
in its own session, and wait for all of them; no launcher in between. Also the comparison of
the states such ranks dump."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]


class Ranks:
    def __init__(self, script: Path, args: list[str], *, world_size: int, workdir: Path) -> None:
        port = free_port()
        self.logs = [workdir / f"rank{r}-{os.getpid()}-{port}.log" for r in range(world_size)]
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "TRAINGUARD_AGENT_SOCKET": str(workdir / "absent.sock"),
                "TRAINGUARD_CHAOS": "",
            }
            with open(self.logs[rank], "wb") as log:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(script), *args],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=REPO,
                        start_new_session=True,
                    )
                )

    def wait(self, timeout_s: float = 120) -> list[int]:
        """Every rank's exit code; on timeout all are killed and the test fails with logs."""
        try:
            return [p.wait(timeout_s) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"ranks did not finish in {timeout_s}s:\n{self.output()}"
            ) from None

    def kill(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)

    def output(self) -> str:
        return "\n".join(
            f"--- rank {r}\n{log.read_text()[-3000:]}" for r, log in enumerate(self.logs)
        )


def assert_same_state(got: Any, want: Any, where: str) -> None:
    """Tensors equal bitwise, structures and plain values equal, `where` names a mismatch."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for k in want:
            assert_same_state(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{where}[{i}]")
    else:
        assert got == want, where
