"""In-process rejoin's NCCL path on a real GPU: a rank leaves an NCCL world by aborting its
communicators (trainer/rejoin.py `abort_world`, torch's `_abort_process_group`) and joins the
next epoch's NCCL world in the same process, running that world's store itself. A world of one
rank: NCCL refuses two ranks on one GPU, so a lost peer's hung collective is not reproduced
here (docs/gpu-checks.md)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("rejoin_nccl_job.py")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_nccl_world_is_aborted_and_the_next_epoch_joined_in_the_same_process() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TRAINGUARD_AGENT_SOCKET": ""}
    proc = subprocess.run(
        [sys.executable, str(JOB), str(_free_port()), str(_free_port())],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    report = os.environ.get("TRAINGUARD_GPU_REPORT_DIR")
    if report:
        Path(report, "rejoin_nccl.log").write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {
        "backend_0": "nccl", "sum_0": 1.5, "initialized_after_0": False,
        "backend_1": "nccl", "sum_1": 2.5, "initialized_after_1": False,
    }  # fmt: skip
    assert "event=world_aborted backend=nccl api=abort_process_group" in proc.stderr
    assert proc.stderr.count("event=world_aborted") == 2
