"""A save that fails, whatever it raises, is reported and cleaned up, and training goes on.

DCP's writer raises `CheckpointException`, a `BaseException`: the save thread must report it
like any other failure (event with the cause, a log line, no `step_*.tmp-*` left behind), never
die with it. A real full file system (a 1 MiB tmpfs, where this process may mount one) shows the
same for an ENOSPC of the tensor writer. The next save after the failure commits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint import CheckpointException

from tests.unit.trainer.trainer_helpers import FakeAgent, TinyJob
from trainguard.trainer import checkpoint as checkpoint_module
from trainguard.trainer.manifest import list_committed, step_dir_name


@pytest.fixture
def thread_deaths(monkeypatch: pytest.MonkeyPatch) -> list[threading.ExceptHookArgs]:
    """Every exception that escapes a thread (none may)."""
    deaths: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", deaths.append)
    return deaths


def leftovers(ckpt_dir: Path) -> list[str]:
    return sorted(p.name for p in ckpt_dir.iterdir() if ".tmp-" in p.name)


def run_steps(job: TinyJob, tg: Any, steps: range) -> None:
    batches = job.sampler.batches(job.loader)
    for step in steps:
        tg.step(step, loss=job.train_step(batches))
        assert tg.checkpoints.writer.wait(30)


def test_a_dcp_checkpoint_exception_is_reported_cleaned_up_and_the_next_save_commits(
    tmp_path: Path,
    agent: FakeAgent,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    thread_deaths: list[threading.ExceptHookArgs],
) -> None:
    real_write = checkpoint_module.write_tensor_file

    def write_or_fill_up(path: Path, tensors: dict[str, Any], **kw: Any) -> Any:
        if path.parent.name.startswith(f"{step_dir_name(4)}.tmp-"):
            path.write_bytes(b"\0" * 4096)  # a partial shard, as a filling disk leaves it
            raise CheckpointException("save", {0: (OSError(28, "No space left on device"), None)})
        return real_write(path, tensors, **kw)

    monkeypatch.setattr(checkpoint_module, "write_tensor_file", write_or_fill_up)
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=2)
    with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
        run_steps(job, tg, range(1, 7))
    tg.close()

    assert thread_deaths == [], "the save thread never dies with the error"
    failed = agent.events("checkpoint_failed")
    assert [h.event_data["step"] for h in failed] == [4]
    reason = failed[0].event_data["reason"]
    assert "CheckpointException" in reason and "No space left on device" in reason
    logged = [r for r in caplog.records if "event=checkpoint_failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno >= logging.WARNING
    assert "step=4" in logged[0].getMessage() and "rank=0" in logged[0].getMessage()
    assert "No_space_left_on_device" in logged[0].getMessage()
    assert leftovers(tmp_path) == []
    # Training went on, and the save after the failure committed.
    assert sorted(s for s, _ in list_committed(tmp_path)) == [2, 6]
    assert tg.ckpt_step == 6
    # The heartbeats' committed step never showed the failed save.
    seen = [h.ckpt_step for h in agent.drain() if h.step in (4, 5)]
    assert seen and set(seen) == {2}


def test_any_base_exception_in_the_save_thread_ends_in_a_reported_failure(
    tmp_path: Path,
    agent: FakeAgent,
    monkeypatch: pytest.MonkeyPatch,
    thread_deaths: list[threading.ExceptHookArgs],
) -> None:
    class Odd(BaseException):
        pass

    def explode(*a: Any, **kw: Any) -> Any:
        raise Odd("beyond Exception")

    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=2)
    # Outside the write itself: the decision step of the save thread raises.
    monkeypatch.setattr(tg.checkpoints.writer, "_decide", explode)
    run_steps(job, tg, range(1, 3))
    monkeypatch.undo()
    run_steps(job, tg, range(3, 5))
    tg.close()
    assert thread_deaths == []
    failed = agent.events("checkpoint_failed")
    assert [h.event_data["step"] for h in failed] == [2]
    assert "Odd: beyond Exception" in failed[0].event_data["reason"]
    assert leftovers(tmp_path) == []
    assert [s for s, _ in list_committed(tmp_path)] == [4]


@contextlib.contextmanager
def small_tmpfs(where: Path) -> Iterator[Path]:
    where.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace')}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=10, check=False)


def fill(path: Path) -> None:
    """Write zeros until the file system is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        block = b"\0" * 65536
        while True:
            try:
                os.write(fd, block)
            except OSError:
                block = block[: len(block) // 2]
                if not block:
                    return
    finally:
        os.close(fd)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_fails_the_save_cleanly_and_the_next_save_commits_once_space_is_back(
    tmp_path: Path,
    agent: FakeAgent,
    caplog: pytest.LogCaptureFixture,
    thread_deaths: list[threading.ExceptHookArgs],
) -> None:
    with small_tmpfs(tmp_path / "small") as ckpt_dir:
        job = TinyJob()
        tg = job.guard(ckpt_dir, checkpoint_every=2)
        run_steps(job, tg, range(1, 3))
        fill(ckpt_dir / "filler")
        with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
            run_steps(job, tg, range(3, 5))
        assert leftovers(ckpt_dir) == []
        (ckpt_dir / "filler").unlink()
        run_steps(job, tg, range(5, 7))
        tg.close()
        committed = sorted(s for s, _ in list_committed(ckpt_dir))
        assert leftovers(ckpt_dir) == []
    assert thread_deaths == []
    failed = agent.events("checkpoint_failed")
    assert [h.event_data["step"] for h in failed] == [4]
    assert "No space left on device" in failed[0].event_data["reason"]
    assert any(
        "event=checkpoint_failed" in r.getMessage() and "step=4" in r.getMessage()
        for r in caplog.records
    )
    assert committed == [2, 6]
    assert tg.ckpt_step == 6
