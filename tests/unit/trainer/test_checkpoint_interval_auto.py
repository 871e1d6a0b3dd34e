"""The periodic checkpoint interval set at run time (`checkpoint_every="auto"`, or the job
spec's TRAINGUARD_CHECKPOINT_INTERVAL): which interval a rank starts with, a `set_interval`
taken once at the agreed step, and ignored by a job with a fixed interval (one process; the
two-rank case is tests/integration/test_trainer_auto_interval.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.unit.trainer.trainer_helpers import TinyJob
from trainguard.ckpt_env import CheckpointInterval
from trainguard.protocol import Control, encode_json
from trainguard.trainer import Trainguard
from trainguard.trainer.core import checkpoint_interval


def _set_interval(tg: Trainguard, every_steps: int, request_id: str) -> None:
    assert tg.channel.control_socket is not None
    control = Control(action="set_interval", request_id=request_id, every_steps=every_steps)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(encode_json(control), tg.channel.control_socket)


@pytest.mark.parametrize(
    ("arg", "env", "want"),
    [
        (100, None, CheckpointInterval(100)),
        ("auto", None, CheckpointInterval(0, auto=True)),
        (100, "auto", CheckpointInterval(100, auto=True)),
        ("auto", "auto:50", CheckpointInterval(50, auto=True)),
        (100, "auto:50", CheckpointInterval(50, auto=True)),
        (100, "20", CheckpointInterval(20)),
    ],
    ids=["fixed", "auto-without-start", "spec-makes-it-auto", "auto-starts-at-spec", "spec-wins",
         "spec-fixed"],
)  # fmt: skip
def test_the_starting_interval_comes_from_the_spec_then_the_argument(
    arg: int | str, env: str | None, want: CheckpointInterval
) -> None:
    environ = {} if env is None else {"TRAINGUARD_CHECKPOINT_INTERVAL": env}
    assert checkpoint_interval(arg, environ) == want  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["auto:x", "-1", "often", "auto:99999999999"])
def test_a_bad_interval_variable_fails_naming_it(bad: str) -> None:
    with pytest.raises(ValueError, match="TRAINGUARD_CHECKPOINT_INTERVAL"):
        checkpoint_interval(10, {"TRAINGUARD_CHECKPOINT_INTERVAL": bad})
    with pytest.raises(ValueError, match="checkpoint_every must be steps or 'auto'"):
        checkpoint_interval("sometimes")  # type: ignore[arg-type]


def test_an_auto_job_takes_the_new_interval_once_from_the_next_step(tmp_path: Path) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every="auto", job="auto")
    assert tg.checkpoint_every == 0 and tg.interval_auto
    tg.resume(first_step=1)
    job.run(tg, 1, 3)
    _set_interval(tg, 4, "ivl-1")
    _set_interval(tg, 4, "ivl-1")  # the same decision again (a retried command)
    job.run(tg, 4, 4)
    assert tg.checkpoint_every == 4
    _set_interval(tg, 9, "ivl-1")  # a handled id is never taken again, whatever it carries
    job.run(tg, 5, 8)
    assert tg.checkpoint_every == 4
    tg.checkpoints.wait()
    tg.checkpoints.collect()
    assert tg.ckpt_step == 8  # the periodic save of step 8, at the new interval
    tg.close()


def test_a_job_with_a_fixed_interval_ignores_set_interval(tmp_path: Path) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=10, job="fixed")
    tg.resume(first_step=1)
    job.run(tg, 1, 2)
    _set_interval(tg, 3, "ivl-1")
    job.run(tg, 3, 6)
    assert tg.checkpoint_every == 10 and not tg.interval_auto
    tg.close()
