"""Host snapshot buffers prepared in the background: a first save that only copies, a save
that comes before they are ready (it takes over), shapes that change between saves, bitwise
resume."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.unit.trainer.trainer_helpers import TinyJob
from trainguard.trainer import state as state_mod
from trainguard.trainer.state import SnapshotPool

GATE_TIMEOUT_S = 30.0


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def hold_preparation_until_a_snapshot_takes_over(
    monkeypatch: pytest.MonkeyPatch,
) -> threading.Event:
    """Stop the preparing thread in its first buffer until a snapshot tells it to stop (if
    none does, the preparation fails and the snapshot has to allocate every buffer). The
    returned event is set once the thread is held there."""
    touch: Callable[[torch.Tensor, threading.Event], None] = state_mod._touch_pages
    held = threading.Event()

    def gated_touch(buf: torch.Tensor, stop: threading.Event) -> None:
        held.set()
        if not stop.wait(GATE_TIMEOUT_S):
            raise AssertionError("no snapshot took over the buffers being prepared")
        touch(buf, stop)

    monkeypatch.setattr(state_mod, "_touch_pages", gated_touch)
    return held


def test_prepared_buffers_are_reused_by_the_first_snapshot() -> None:
    pool = SnapshotPool()
    state = {"w": torch.randn(64, 1024), "opt": [torch.arange(10), 3], "step": 7}
    assert pool.prepare(state)
    assert pool.wait_ready(GATE_TIMEOUT_S)
    assert pool.held_bytes == pool.prepared_bytes == nbytes(state["w"], state["opt"][0])
    state["w"].add_(1)  # what counts is the state at snapshot time, not at prepare time
    snap = pool.snapshot(state)
    assert pool.allocated_bytes == 0, "the first snapshot should only copy"
    assert torch.equal(snap["w"], state["w"]) and snap["w"].data_ptr() != state["w"].data_ptr()
    assert torch.equal(snap["opt"][0], torch.arange(10)) and snap["opt"][1] == 3
    assert snap["step"] == 7
    assert not pool.prepare(state), "nothing left to prepare once every buffer fits"


def test_snapshot_before_buffers_are_ready_takes_over_and_is_correct(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held = hold_preparation_until_a_snapshot_takes_over(monkeypatch)
    pool = SnapshotPool()
    state = {"a": torch.randn(300, 300), "b": torch.randn(5)}
    assert pool.prepare(state)
    assert held.wait(GATE_TIMEOUT_S), "the preparation never reached its first buffer"
    state["a"].mul_(2)
    snap = pool.snapshot(state)
    assert pool.ready()
    # "a" was being prepared (kept, although not pre-faulted); "b" was not reached yet
    assert pool.allocated_bytes == nbytes(state["b"]), "only the missing buffer is allocated"
    assert pool.held_bytes == nbytes(state["a"], state["b"]), "one set of buffers"
    assert torch.equal(snap["a"], state["a"]) and torch.equal(snap["b"], state["b"])
    state["b"].add_(1)
    assert torch.equal(pool.snapshot(state)["b"], state["b"])
    assert pool.allocated_bytes == 0


def test_failed_preparation_leaves_the_snapshot_to_allocate_and_copy(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_touch(buf: torch.Tensor, stop: threading.Event) -> None:
        raise RuntimeError("no memory")

    monkeypatch.setattr(state_mod, "_touch_pages", broken_touch)
    pool = SnapshotPool()
    state = {"a": torch.randn(100), "b": torch.randn(7)}
    with caplog.at_level("WARNING", logger="trainguard.trainer"):
        assert pool.prepare(state)
        assert pool.wait_ready(GATE_TIMEOUT_S)
    assert "event=snapshot_prepare_failed" in caplog.text
    snap = pool.snapshot(state)
    assert pool.allocated_bytes == nbytes(state["a"], state["b"])
    assert torch.equal(snap["a"], state["a"]) and torch.equal(snap["b"], state["b"])


@pytest.mark.parametrize("prepare_again", [False, True], ids=["snapshot-only", "prepare-first"])
def test_changed_shapes_get_new_buffers_and_the_old_ones_are_freed(prepare_again: bool) -> None:
    pool = SnapshotPool()
    first = {"keep": torch.randn(50), "grow": torch.randn(10), "gone": torch.randn(1000)}
    pool.prepare(first)
    pool.snapshot(first)
    kept_ptr = pool.snapshot(first)["keep"].data_ptr()

    second = {"keep": torch.randn(50), "grow": torch.randn(20, 3), "new": torch.ones(4).long()}
    if prepare_again:
        assert pool.prepare(second)
        assert pool.wait_ready(GATE_TIMEOUT_S)
    snap = pool.snapshot(second)

    assert set(snap) == set(second)
    for name, t in second.items():
        assert torch.equal(snap[name], t) and snap[name].dtype == t.dtype, name
    assert snap["keep"].data_ptr() == kept_ptr, "an unchanged buffer is reused"
    assert pool.held_bytes == nbytes(*second.values()), "one set of buffers, the old ones freed"
    changed = nbytes(second["grow"], second["new"])
    assert pool.allocated_bytes == (0 if prepare_again else changed)


def test_save_right_after_the_first_step_takes_over_the_buffers_and_resumes_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    straight = TinyJob()
    tg = straight.guard(tmp_path / "a")
    expected = straight.run(tg, tg.resume(first_step=1), 8)
    tg.close()

    held = hold_preparation_until_a_snapshot_takes_over(monkeypatch)
    interrupted = TinyJob()
    tg = interrupted.guard(tmp_path / "b")
    interrupted.run(tg, tg.resume(first_step=1), 1)  # the first step starts the preparation
    assert held.wait(GATE_TIMEOUT_S), "the preparation never reached its first buffer"
    assert tg.save(1, wait=True)
    pool = tg.checkpoints.pool
    assert 0 < pool.allocated_bytes < pool.bytes, "it kept the buffer being prepared"
    assert tg.ckpt_step == 1
    tg.close()

    resumed = TinyJob(init_seed=99)  # other initial weights: everything must come from disk
    tg = resumed.guard(tmp_path / "b")
    start = tg.resume(first_step=1)
    assert start == 2
    got = resumed.run(tg, start, 8)
    tg.close()
    assert got == {s: expected[s] for s in range(2, 9)}


def test_first_step_prepares_every_buffer_a_save_needs(tmp_path: Path) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path)
    job.run(tg, 1, 1)
    assert tg.checkpoints.pool.wait_ready(GATE_TIMEOUT_S)
    assert tg.checkpoints.pool.prepared_bytes > 0
    assert tg.save(1, wait=True)
    assert tg.checkpoints.pool.allocated_bytes == 0
    assert tg.checkpoints.pool.held_bytes == tg.checkpoints.pool.bytes
    tg.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux only")
def test_preparing_thread_runs_at_the_lowest_cpu_priority_and_the_caller_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[int] = []

    def recording_touch(buf: torch.Tensor, stop: threading.Event) -> None:
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    monkeypatch.setattr(state_mod, "_touch_pages", recording_touch)
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = SnapshotPool()
    assert pool.prepare({"a": torch.zeros(3)})
    assert pool.wait_ready(GATE_TIMEOUT_S)
    assert seen == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


EXIT_WHILE_PREPARING = """
import sys, torch
from trainguard.trainer.state import SnapshotPool
pool = SnapshotPool()
assert pool.prepare({"w": [torch.empty(64 * 1024 * 1024) for _ in range(4)]})
sys.exit(0)
"""


@pytest.mark.slow  # a fresh interpreter importing torch
def test_exiting_while_buffers_are_prepared_exits_cleanly() -> None:
    # A preparing thread still inside torch at interpreter exit aborted the process
    # ("terminate called without an active exception", exit -6): exit stops it first.
    root = Path(__file__).resolve().parents[4]
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_PREPARING],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
