"""Checkpoint health from a real trainer process (examples/train.py) whose saves fail: the
tensor file write raises ENOSPC at chosen steps. Its heartbeats count the saves failed in a
row and carry the newest commit's age and the periodic interval; its log warns once at the
first failure and tells when a commit ends the run of failures."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import run_trainer
from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.trainer.manifest import list_committed

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "examples" / "train.py")
pytestmark = pytest.mark.slow

# Runs the example with the tensor file write failing for the step directories named in argv[1]
_FAILING_SAVES = """
import errno, runpy, sys
from trainguard.trainer import checkpoint

failing = sys.argv[1].split(",")
real = checkpoint.write_tensor_file


def write_tensor_file(path, *args, **kwargs):
    if any(f"step_{int(s):06d}." in str(path) for s in failing):
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(path, *args, **kwargs)


checkpoint.write_tensor_file = write_tensor_file
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture
def agent() -> Iterator[FakeAgent]:
    d = Path(tempfile.mkdtemp(prefix="tgh-"))  # short: unix socket paths are <= 107 bytes
    a = FakeAgent(d)
    yield a
    a.close()
    shutil.rmtree(d, ignore_errors=True)


def test_failed_saves_show_in_the_heartbeat_and_the_log_until_a_commit(
    tmp_path: Path, agent: FakeAgent
) -> None:
    wrapper = tmp_path / "failing_saves.py"
    wrapper.write_text(_FAILING_SAVES)
    ck = tmp_path / "ck"
    cmd = [
        str(wrapper), "20,30", TRAIN,
        "--steps", "40", "--ckpt-dir", str(ck), "--checkpoint-every", "10", "--keep-last", "0",
    ]  # fmt: skip
    proc = run_trainer(cmd, agent_socket=agent.path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hbs = agent.drain()
    assert [s for s, _ in list_committed(ck)] == [40, 10]

    # A save's outcome is collected at a later step (the write runs in the background): while
    # the commit of step 10 is the newest, the failures count up to 2 (the heartbeat of each
    # checkpoint_failed event carries its count) and that commit ages; the commit of step 40
    # (collected at close) resets them.
    before = [h for h in hbs if h.ckpt_step == 10]  # in the order sent
    failures = [h.ckpt_failures for h in before]
    assert max(failures) == 2 and failures == sorted(failures)
    ages = [h.ckpt_age_s for h in before if h.ckpt_failures > 0]
    assert all(a is not None for a in ages) and ages == sorted(ages)  # type: ignore[type-var]
    train = [h for h in hbs if h.phase == "train" and h.step >= 2]
    assert train and all(h.ckpt_interval_s is not None and h.ckpt_interval_s > 0 for h in train)
    last = hbs[-1]
    assert (last.ckpt_step, last.ckpt_failures) == (40, 0)
    assert last.ckpt_age_s is not None and last.ckpt_age_s < ages[-1]  # type: ignore[operator]
    failed = [h.event_data["step"] for h in hbs if h.event == "checkpoint_failed"]
    assert failed == [20, 30]

    log = proc.stderr
    warnings = [ln for ln in log.splitlines() if "event=checkpoint_failing" in ln]
    assert len(warnings) == 1 and " WARNING " in warnings[0] and "step=20" in warnings[0]
    recovered = [ln for ln in log.splitlines() if "event=checkpoint_recovered" in ln]
    assert len(recovered) == 1 and " INFO " in recovered[0] and "failures=2" in recovered[0]
