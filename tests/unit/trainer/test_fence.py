"""Fencing of a checkpoint directory between attempts: the EPOCH file, refused commits of a
stale attempt, the launch lock. Real files, real flocks, a real (tiny) torch model."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.unit.trainer.trainer_helpers import FakeAgent, TinyJob
from trainguard.trainer import LaunchLocked, StaleAttempt
from trainguard.trainer import fence as fence_mod
from trainguard.trainer.fence import (
    EPOCH_NAME,
    LaunchLock,
    epoch_from_env,
    raise_epoch,
    read_epoch,
    write_epoch,
)
from trainguard.trainer.manifest import list_committed, read_manifest


def committed_steps(ckpt: Path) -> list[int]:
    return sorted(step for step, _ in list_committed(ckpt))


def test_commit_of_an_older_attempt_is_refused_and_the_stale_rank_stops(
    tmp_path: Path, agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "ck"
    job = TinyJob()
    tg = job.guard(ckpt, checkpoint_every=5, epoch=1)
    assert read_epoch(ckpt) == 1
    start = tg.resume(first_step=1)
    job.run(tg, start, 6)
    tg.checkpoints.writer.wait(10)
    assert committed_steps(ckpt) == [5]

    raise_epoch(ckpt, 2)  # what attempt 2's rank 0 does when it starts
    with caplog.at_level(logging.INFO, logger="trainguard.trainer"):
        losses = job.run(tg, 7, 30)
        tg.close()

    assert committed_steps(ckpt) == [5]  # nothing of attempt 1 after attempt 2 started
    assert not [p for p in os.listdir(ckpt) if p.startswith("step_") and p != "step_000005"]
    # the refused commit is reported, and the step that learns of it stops the loop
    failed = agent.events("checkpoint_failed")
    assert [h.event_data["step"] for h in failed] == [10]
    reason = "checkpoint refused: attempt 1 is older than the directory's attempt 2"
    assert failed[0].event_data["reason"] == reason
    stops = agent.events("stop")
    assert [h.event_data["reason"] for h in stops] == ["stale_attempt"]
    assert 10 < stops[0].event_data["step"] == max(losses) < 30
    assert f'reason=stale_attempt epoch=1 detail="{reason}"' in caplog.text
    assert read_epoch(ckpt) == 2


def test_stale_rank_step_returns_stop_with_its_reason(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    job = TinyJob()
    tg = job.guard(ckpt, epoch=3)
    tg.resume(first_step=1)
    raise_epoch(ckpt, 4)
    assert tg.save(1, wait=True) is True  # started; the commit is refused
    batches = job.sampler.batches(job.loader)
    action = tg.step(2, loss=job.train_step(batches))
    assert action.stop and action.reason == "stale_attempt"
    assert tg.save(2, wait=True) is False  # a stale attempt starts no more saves
    tg.close()
    assert committed_steps(ckpt) == []


@pytest.mark.parametrize("directory_epoch", [1, 2], ids=["same-epoch", "older-directory"])
def test_equal_and_newer_attempts_commit(tmp_path: Path, directory_epoch: int) -> None:
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    write_epoch(ckpt, directory_epoch)
    job = TinyJob()
    tg = job.guard(ckpt, checkpoint_every=5, epoch=2)
    assert read_epoch(ckpt) == 2
    job.run(tg, tg.resume(first_step=1), 10)
    tg.close()
    assert committed_steps(ckpt) == [5, 10]
    assert [read_manifest(p).extra["epoch"] for _, p in list_committed(ckpt)] == [2] * 2


def test_without_an_epoch_there_is_no_fencing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRAINGUARD_ATTEMPT", raising=False)
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    write_epoch(ckpt, 7)  # even a directory fenced by others: an unfenced run writes as before
    job = TinyJob()
    tg = job.guard(ckpt, checkpoint_every=5)
    assert tg.epoch is None
    job.run(tg, tg.resume(first_step=1), 10)
    tg.close()
    assert committed_steps(ckpt) == [5, 10]
    assert read_epoch(ckpt) == 7
    assert not list(ckpt.glob(".launch.*"))


def test_a_fresh_directory_without_an_epoch_gets_no_epoch_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TRAINGUARD_ATTEMPT", raising=False)
    ckpt = tmp_path / "ck"
    job = TinyJob()
    tg = job.guard(ckpt, checkpoint_every=5)
    job.run(tg, tg.resume(first_step=1), 5)
    tg.close()
    assert not (ckpt / EPOCH_NAME).exists()


def test_epoch_comes_from_the_environment_and_the_argument_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_ATTEMPT", "4")
    job = TinyJob()
    tg = job.guard(tmp_path / "a")
    assert tg.epoch == 4
    tg.close()
    assert read_epoch(tmp_path / "a") == 4
    tg = job.guard(tmp_path / "b", epoch=6)
    assert tg.epoch == 6
    tg.close()
    assert read_epoch(tmp_path / "b") == 6


@pytest.mark.parametrize(
    ("raw", "expected"), [("", None), (" 3 ", 3), ("0", 0)], ids=["empty", "spaces", "zero"]
)
def test_epoch_from_env_reads_the_attempt(raw: str, expected: int | None) -> None:
    assert epoch_from_env({"TRAINGUARD_ATTEMPT": raw}) == expected
    assert epoch_from_env({}) is None


@pytest.mark.parametrize("raw", ["x", "-1", "1.5"])
def test_a_bad_attempt_value_fails_with_a_clear_error(raw: str) -> None:
    with pytest.raises(ValueError, match="TRAINGUARD_ATTEMPT"):
        epoch_from_env({"TRAINGUARD_ATTEMPT": raw})


def test_a_launch_older_than_the_directory_is_refused_at_start(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    write_epoch(ckpt, 5)
    with pytest.raises(StaleAttempt, match="attempt 4 is older than the directory's attempt 5"):
        TinyJob().guard(ckpt, epoch=4)
    assert read_epoch(ckpt) == 5


def test_epoch_file_is_replaced_atomically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_epoch(tmp_path, 1)
    calls: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        calls.append("fsync")
        real_fsync(fd)

    def rename(src: str | Path, dst: str | Path) -> None:
        calls.append(f"rename {Path(src).name} -> {Path(dst).name}")
        assert Path(src).read_text() == "2\n"  # complete before it takes the name
        assert (tmp_path / EPOCH_NAME).read_text() == "1\n"  # the old value until the rename
        real_rename(src, dst)

    monkeypatch.setattr(fence_mod.os, "fsync", fsync)
    monkeypatch.setattr(fence_mod.os, "rename", rename)
    write_epoch(tmp_path, 2)
    assert calls[0] == "fsync"  # the temp file is durable before the rename
    assert calls[1].startswith("rename EPOCH.tmp-") and calls[1].endswith(" -> EPOCH")
    assert calls[2] == "fsync"  # and so is the rename (the directory)
    assert read_epoch(tmp_path) == 2
    assert sorted(os.listdir(tmp_path)) == [EPOCH_NAME]


def test_a_failed_epoch_write_keeps_the_old_value_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_epoch(tmp_path, 1)

    def broken_rename(src: str | Path, dst: str | Path) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fence_mod.os, "rename", broken_rename)
    with pytest.raises(OSError):
        write_epoch(tmp_path, 2)
    assert read_epoch(tmp_path) == 1
    assert sorted(os.listdir(tmp_path)) == [EPOCH_NAME]


def test_raise_epoch_never_lowers_it(tmp_path: Path) -> None:
    assert raise_epoch(tmp_path, 2) is None
    assert raise_epoch(tmp_path, 2) == 2
    with pytest.raises(StaleAttempt):
        raise_epoch(tmp_path, 1)
    assert read_epoch(tmp_path) == 2
    assert raise_epoch(tmp_path, 3) == 2
    assert read_epoch(tmp_path) == 3


def test_a_relaunch_of_the_same_attempt_cannot_run_beside_a_live_one(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    leftover = LaunchLock(ckpt, epoch=1)  # a worker of a killed launch still holds it
    leftover.acquire(timeout_s=0)
    with pytest.raises(LaunchLocked, match=f"held by pid {os.getpid()}"):
        TinyJob().guard(ckpt, epoch=1, launch_lock_timeout_s=0)
    leftover.release()
    tg = TinyJob().guard(ckpt, epoch=1, launch_lock_timeout_s=0)
    assert tg.checkpoints.launch_lock is not None and tg.checkpoints.launch_lock.held
    # the lock lives as long as the launch: a second launch of attempt 1 now waits
    with pytest.raises(LaunchLocked):
        LaunchLock(ckpt, epoch=1).acquire(timeout_s=0)
    tg.close()
    LaunchLock(ckpt, epoch=1).acquire(timeout_s=0)


def test_a_newer_attempt_is_not_held_by_the_older_attempts_lock(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    job = TinyJob()
    old = job.guard(ckpt, epoch=1)
    new = TinyJob().guard(ckpt, epoch=2, launch_lock_timeout_s=0)
    assert read_epoch(ckpt) == 2
    assert not (ckpt / ".launch.1.lock").exists()  # a fenced attempt's lock guards nothing
    new.close()
    old.close()
