"""A real trainer process (examples/train.py) whose checkpoint directory is a 1 MiB tmpfs: the
first checkpoint (~640 KB) commits, every later one finds the disk full.

Each failed save is a `checkpoint_failed` heartbeat event naming the cause (ENOSPC, "No space
left on device") and an `event=checkpoint_failed` line in the trainer's stderr; no
`step_*.tmp-*` directory is left behind; training goes on to its last step and exits 0; the
heartbeat's `ckpt_step` never advances past the one commit.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import run_trainer
from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.trainer.manifest import list_committed

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "examples" / "train.py")
HIDDEN = 1152  # one checkpoint of this model is ~640 KB: one fits in 1 MiB, two do not
STEPS = 40
pytestmark = pytest.mark.slow


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted on a fresh directory, unmounted at the end."""
    ck = tmp_path / "ck"
    ck.mkdir()
    mount = shutil.which("mount")
    if mount is None:
        pytest.skip("no mount binary: a tiny tmpfs cannot be mounted here")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ck)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here (needs root): {done.stderr.strip()}")
    try:
        yield ck
    finally:
        subprocess.run(["umount", str(ck)], capture_output=True, timeout=30, check=False)


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    d = Path(tempfile.mkdtemp(prefix="tgdf-"))  # short: unix socket paths are <= 107 bytes
    a = FakeAgent(d)
    yield a
    a.close()
    shutil.rmtree(d, ignore_errors=True)


def test_a_full_checkpoint_disk_fails_the_saves_loudly_and_training_goes_on(
    full_disk: Path, agent: FakeAgent
) -> None:
    ck = full_disk
    cmd = [
        TRAIN, "--steps", str(STEPS), "--ckpt-dir", str(ck),
        "--checkpoint-every", "10", "--keep-last", "0", "--hidden", str(HIDDEN),
    ]  # fmt: skip
    proc = run_trainer(cmd, agent_socket=agent.path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hbs = agent.drain()

    # one commit (step 10), the others failed for the full disk and left nothing behind
    assert [s for s, _ in list_committed(ck)] == [10], proc.stderr[-3000:]
    leftovers = sorted(p.name for p in ck.iterdir() if ".tmp-" in p.name)
    assert leftovers == [], leftovers
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("step_")) == ["step_000010"]

    failed = [h.event_data for h in hbs if h.event == "checkpoint_failed"]
    assert [d["step"] for d in failed] == [20, 30, 40], failed
    for d in failed:
        reason = str(d["reason"])
        assert "No space left" in reason or "ENOSPC" in reason or "Errno 28" in reason, d

    lines = [ln for ln in proc.stderr.splitlines() if "event=checkpoint_failed" in ln]
    assert [ln for ln in lines if "step=20" in ln], proc.stderr[-3000:]
    assert all("No_space_left" in ln or "Errno_28" in ln for ln in lines), lines

    # training went on to its last step; the checkpoint step never passed the one commit
    assert max(h.step for h in hbs) == STEPS
    assert {h.ckpt_step for h in hbs} <= {None, 10}
    assert hbs[-1].ckpt_step == 10
