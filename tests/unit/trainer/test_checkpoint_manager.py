"""`CheckpointManager` alone (no `Trainguard`, no loop): a job that keeps its own loop saves
and loads its state through it, and the directory is fenced as under `Trainguard`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.trainer.trainer_helpers import TinyJob
from trainguard.trainer.checkpoint import SaveResult
from trainguard.trainer.checkpoint_manager import (
    CheckpointManager,
    CheckpointSettings,
    TrainState,
)
from trainguard.trainer.fence import LaunchLock, LaunchLocked, StaleAttempt, raise_epoch
from trainguard.trainer.manifest import list_committed
from trainguard.trainer.sync import LocalCoordinator


class Unstorable:
    def state_dict(self) -> Any:
        return {"thing": object()}

    def load_state_dict(self, state: Any) -> None:
        return None


def manager(
    job: TinyJob, ckpt: Path, results: list[SaveResult], **settings: Any
) -> CheckpointManager:
    extra = settings.pop("extra", {})
    return CheckpointManager(
        state=TrainState(
            model=job.model,
            optimizer=job.opt,
            scheduler=job.sched,
            sampler=job.sampler,
            extra=extra,
        ),
        settings=CheckpointSettings(ckpt_dir=ckpt, **settings),
        coordinator=LocalCoordinator(),
        job="unit",
        on_result=results.append,
    )


def train(job: TinyJob, steps: int) -> None:
    batches = job.sampler.batches(job.loader)
    for _ in range(steps):
        job.train_step(batches)
        job.sampler.mark_step()


def test_a_saved_state_loads_back_into_other_objects_exactly(tmp_path: Path) -> None:
    results: list[SaveResult] = []
    saved = TinyJob()
    m = manager(saved, tmp_path, results)
    train(saved, 3)
    assert m.save(3, request_id="r1")
    assert m.wait()
    m.collect()
    assert [(r.step, r.request_id, r.ok) for r in results] == [(3, "r1", True)]
    m.close()

    other = TinyJob(init_seed=99)
    loaded = manager(other, tmp_path, [])
    found = loaded.restore_latest()
    assert found is not None and found[0] == 3 and found[1].request_id == "r1"
    for a, b in zip(saved.model.parameters(), other.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert other.sched.state_dict() == saved.sched.state_dict()
    assert other.sampler.state_dict() == saved.sampler.state_dict()
    loaded.close()


def test_an_empty_directory_has_no_latest(tmp_path: Path) -> None:
    m = manager(TinyJob(), tmp_path / "ck", [])
    assert m.latest() is None and m.restore_latest() is None
    m.close()


def test_periodic_steps_follow_checkpoint_every(tmp_path: Path) -> None:
    m = manager(TinyJob(), tmp_path, [], checkpoint_every=5)
    assert [s for s in range(12) if m.is_periodic(s)] == [5, 10]
    m.close()


def test_a_state_that_cannot_be_captured_is_reported_as_a_failed_save(tmp_path: Path) -> None:
    results: list[SaveResult] = []
    m = manager(TinyJob(), tmp_path, results, extra={"bad": Unstorable()})
    assert not m.save(1, request_id="r1")
    assert len(results) == 1 and not results[0].ok and results[0].request_id == "r1"
    assert "cannot be checkpointed" in results[0].reason
    m.close()
    assert list_committed(tmp_path) == []


def test_a_refused_commit_makes_the_manager_stale_and_it_starts_no_more_saves(
    tmp_path: Path,
) -> None:
    results: list[SaveResult] = []
    m = manager(TinyJob(), tmp_path, results, epoch=3)
    raise_epoch(tmp_path, 4)  # a newer attempt started
    assert m.save(1)
    m.wait()
    m.collect()
    assert m.stale and results[-1].stale
    assert not m.save(2)
    m.close()
    assert list_committed(tmp_path) == []


def test_an_older_attempt_is_refused_at_construction_and_holds_no_lock(tmp_path: Path) -> None:
    raise_epoch(tmp_path, 5)
    with pytest.raises(StaleAttempt):
        manager(TinyJob(), tmp_path, [], epoch=4)
    LaunchLock(tmp_path, epoch=4).acquire(timeout_s=0)  # free again


def test_the_launch_lock_is_held_until_close(tmp_path: Path) -> None:
    m = manager(TinyJob(), tmp_path, [], epoch=1)
    assert m.launch_lock is not None and m.launch_lock.held
    with pytest.raises(LaunchLocked):
        manager(TinyJob(), tmp_path, [], epoch=1, launch_lock_timeout_s=0)
    m.close()
    assert not m.launch_lock.held


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"checkpoint_every": -1}, "checkpoint_every"),
        ({"keep_last": -1}, "keep_last"),
        ({"checkpoint_timeout_s": 0}, "checkpoint_timeout_s"),
        ({"epoch": -1}, "epoch"),
        ({"launch_lock_timeout_s": -1}, "launch_lock_timeout_s"),
    ],
    ids=["negative-every", "negative-keep", "zero-timeout", "negative-epoch", "negative-lock"],
)
def test_bad_settings_fail_naming_the_argument(
    tmp_path: Path, settings: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ValueError, match=needle):
        CheckpointSettings(ckpt_dir=tmp_path, **settings)


def test_the_directory_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert CheckpointSettings(ckpt_dir=Path("ck")).ckpt_dir == tmp_path / "ck"


def test_a_commit_says_how_long_the_save_held_the_loop(tmp_path: Path) -> None:
    """`block_s`: what save() itself took (the snapshot), at most the whole save's
    `duration_s` plus that; the controller takes it as the job's checkpoint cost."""
    results: list[SaveResult] = []
    job = TinyJob()
    m = manager(job, tmp_path, results)
    train(job, 2)
    assert m.save(2)
    assert m.wait()
    m.collect()
    (r,) = results
    assert r.ok and r.block_s is not None and 0 <= r.block_s < 60
    m.close()
