"""The trainer examples run as written: README's loop is examples/trainer_single.py verbatim,
docs/trainer.md shows it and examples/trainer_ddp.py verbatim, and both train, commit
checkpoints and resume (the DDP one under real torchrun, 2 gloo ranks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port
from trainguard.trainer.manifest import find_latest_good

REPO = Path(__file__).resolve().parents[2]
SINGLE = REPO / "examples" / "trainer_single.py"
DDP = REPO / "examples" / "trainer_ddp.py"
pytestmark = pytest.mark.slow


def readme_loop() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("## Trainer library in a loop\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section shows one python block"
    return blocks[0]


def env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRAINGUARD_AGENT_SOCKET": str(tmp_path / "absent.sock"),
        "TRAINGUARD_CHAOS": "",
    }


def test_readme_loop_is_the_single_process_example_verbatim() -> None:
    assert readme_loop() == SINGLE.read_text()


def test_docs_quick_start_shows_both_examples_verbatim() -> None:
    text = (REPO / "docs" / "trainer.md").read_text()
    section = text.split("## Quick start\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks == [SINGLE.read_text(), DDP.read_text()]


def test_single_process_example_runs_as_written_and_resumes(tmp_path: Path) -> None:
    first = subprocess.run(
        [sys.executable, str(SINGLE)], cwd=tmp_path, env=env(tmp_path),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    # Its INFO lines are visible, and the committed path is absolute.
    assert "event=trainer_start" in first.stderr
    ckpt = tmp_path / "ckpt" / "single"
    assert f"dir={ckpt}/step_000200" in first.stderr
    found = find_latest_good(ckpt)
    assert found is not None and found[0] == 200
    again = subprocess.run(
        [sys.executable, str(SINGLE)], cwd=tmp_path, env=env(tmp_path),
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "event=resumed job=default rank=0 step=200 next_step=201" in again.stderr


def test_ddp_example_runs_under_torchrun(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
         "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(DDP)],
        cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    found = find_latest_good(tmp_path / "ckpt" / "ddp")
    assert found is not None and found[0] == 100 and found[2].world_size == 2
