"""The trainer examples run as written: README's loop is examples/trainer_single.py verbatim,
docs/trainer.md shows it, examples/trainer_ddp.py and examples/trainer_fsdp2.py verbatim, and
they train, commit checkpoints and resume (DDP and FSDP2 under real torchrun, gloo ranks; the
FSDP2 one resumed on 3 ranks)."""

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
FSDP2 = REPO / "examples" / "trainer_fsdp2.py"
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


def test_docs_fsdp2_section_shows_the_fsdp2_example_verbatim() -> None:
    text = (REPO / "docs" / "trainer.md").read_text()
    section = text.split("## FSDP2 (`fully_shard`) and DTensor state\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks == [FSDP2.read_text()]


def torchrun(tmp_path: Path, script: Path, *, nproc: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
         "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script)],
        cwd=tmp_path, env=env(tmp_path), capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip


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
    run = torchrun(tmp_path, DDP, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    found = find_latest_good(tmp_path / "ckpt" / "ddp")
    assert found is not None and found[0] == 100 and found[2].world_size == 2


def test_fsdp2_example_runs_under_torchrun_and_resumes_on_three_ranks(tmp_path: Path) -> None:
    run = torchrun(tmp_path, FSDP2, nproc=2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "checkpoint_failed" not in run.stderr
    found = find_latest_good(tmp_path / "ckpt" / "fsdp2")
    assert found is not None and found[0] == 100 and found[2].world_size == 2
    assert (found[2].format, sorted(found[2].files)[:2]) == (
        "dcp",
        ["dcp/.metadata", "dcp/__0_0.distcp"],
    )
    again = torchrun(tmp_path, FSDP2, nproc=3)  # nothing left to train: resume, then close
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("event=resumed_at_other_world_size") == 3, again.stderr[-3000:]
