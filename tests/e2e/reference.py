"""The uninterrupted run a scenario's losses are compared with (examples/train.py,
tests/e2e/chaos.py's arguments, world 3, `torchrun --standalone`), one for the session: its
losses depend on neither the step time nor a cluster (tests/e2e/conftest.py `reference`)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.e2e.chaos import STEPS, train_args
from trainguard.devkit.devcluster import REPO_ROOT, read_step_lines, wait_until

WORLD = 3


class Reference:
    """The one reference run of the session (started on first use, ended at the end)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.log_path = run_dir / "reference.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self._lines: list[dict[str, Any]] | None = None

    def start(self) -> None:
        """Start the run in the background (once; later calls do nothing)."""
        if self._proc is not None:
            return
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET",)}
        env.pop("TRAINGUARD_CHAOS", None)
        env["PYTHONUNBUFFERED"] = "1"
        argv = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(WORLD), str(REPO_ROOT / "examples" / "train.py"),
            *train_args(step_time_s=0.05), "--ckpt-dir", str(self.run_dir / "ckpt"),
        ]  # fmt: skip
        with self.log_path.open("wb") as log:
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO_ROOT),
                start_new_session=True,
            )

    def lines(self) -> list[dict[str, Any]]:
        """Every step line of the finished run (starting it if no module did yet)."""
        if self._lines is None:
            self.start()
            proc = self._proc
            assert proc is not None
            wait_until(lambda: proc.poll() is not None, timeout_s=120, what="the reference run")
            lines = read_step_lines(self.log_path)
            assert [x["step"] for x in lines] == list(range(1, STEPS + 1)), (
                f"reference run incomplete (exit {proc.returncode}):\n"
                + self.log_path.read_text(errors="replace")[-3000:]
            )
            self._lines = lines
        return self._lines

    def close(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
