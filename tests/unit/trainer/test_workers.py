"""DataLoader workers ignore the stop signals meant for the rank, and still end with it."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from tests.helpers import alive, wait_for
from trainguard.trainer import (
    ResumableSampler,
    WorkerInit,
    guard_workers,
    resumable_loader,
    worker_init_fn,
)

_TAG = -1


def _tag_worker(worker_id: int) -> None:
    global _TAG
    _TAG = 100 + worker_id


class Tagged(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, _TAG])


def _worker_pids(before: set[int]) -> list[int]:
    return sorted(p.pid for p in multiprocessing.active_children() if p.pid and p.pid not in before)


def _signal_workers_then_read(it: Iterator[torch.Tensor], n: int) -> torch.Tensor:
    """Take one batch (the workers exist then), SIGTERM + SIGINT every worker, take the rest."""
    rows = [next(it)]
    workers = _worker_pids(_BEFORE)
    assert len(workers) == 2
    for pid in workers:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
    rows.extend(next(it) for _ in range(n - 1))
    return torch.cat(rows)


_BEFORE: set[int] = set()


@pytest.fixture(autouse=True)
def known_children() -> None:
    _BEFORE.clear()
    _BEFORE.update(p.pid for p in multiprocessing.active_children() if p.pid is not None)


def test_workers_of_sampler_batches_survive_sigterm_and_sigint_and_run_the_users_init() -> None:
    data = Tagged()
    sampler = ResumableSampler(
        DistributedSampler(data, num_replicas=1, rank=0, shuffle=False), batch_size=4
    )
    loader = DataLoader(
        data, batch_size=4, sampler=sampler, drop_last=True, num_workers=2,
        worker_init_fn=_tag_worker,
    )  # fmt: skip
    rows = _signal_workers_then_read(sampler.batches(loader), 64)
    assert rows[:, 0].tolist() == list(range(256))
    assert set(rows[:, 1].tolist()) == {100, 101}, "the user's worker_init_fn ran in each worker"


def test_workers_of_resumable_loader_survive_sigterm_and_sigint_when_iterated_directly() -> None:
    data = Tagged()
    sampler = ResumableSampler(
        DistributedSampler(data, num_replicas=1, rank=0, shuffle=False), batch_size=4
    )
    loader = resumable_loader(data, sampler=sampler, num_workers=2, worker_init_fn=_tag_worker)
    rows = _signal_workers_then_read(iter(loader), 64)
    assert rows[:, 0].tolist() == list(range(256))
    assert set(rows[:, 1].tolist()) == {100, 101}


def test_unguarded_workers_die_of_the_same_signals() -> None:
    # The failure the guard exists for. In a process of its own: a worker killed while it
    # holds one of the loader's shared locks leaves the rank blocked on that lock for good
    # (torch's own race), which is the same failure seen from outside: the rank trains no more.
    script = textwrap.dedent(
        """
        import os, signal, torch
        from torch.utils.data import DataLoader, Dataset

        class Data(Dataset):
            def __len__(self):
                return 256
            def __getitem__(self, index):
                return torch.tensor([index])

        it = iter(DataLoader(Data(), batch_size=4, num_workers=2))
        next(it)
        for w in it._workers:
            os.kill(w.pid, signal.SIGTERM)
            os.kill(w.pid, signal.SIGINT)
        for _ in range(63):
            next(it)
        print("read all", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        assert b"read all" not in out  # blocked on a dead worker's lock: it never got there
        return
    finally:
        proc.kill()
    assert b"read all" not in out
    assert proc.returncode != 0
    # which error depends on where the workers died: RuntimeError from the loader's watch,
    # ConnectionResetError/EOFError from a half-sent batch
    assert b"Traceback" in err, err.decode()[-2000:]


def test_guard_wraps_once_and_leaves_loaders_without_workers_alone() -> None:
    plain = DataLoader(Tagged(), batch_size=4)
    assert guard_workers(plain).worker_init_fn is None
    loader = DataLoader(Tagged(), batch_size=4, num_workers=2, worker_init_fn=_tag_worker)
    guard_workers(loader)
    first = loader.worker_init_fn
    assert isinstance(first, WorkerInit) and first.inner is _tag_worker
    guard_workers(loader)
    assert loader.worker_init_fn is first
    assert worker_init_fn(first).inner is _tag_worker


def test_sampler_batches_guards_the_loader_it_iterates() -> None:
    data = TensorDataset(torch.arange(32.0))
    sampler = ResumableSampler(DistributedSampler(data, num_replicas=1, rank=0), batch_size=4)
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=True, num_workers=2)
    batches = sampler.batches(loader)
    next(batches)
    assert isinstance(loader.worker_init_fn, WorkerInit)
    batches.close()


def test_persistent_workers_already_started_are_reported_not_rewrapped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loader = DataLoader(Tagged(), batch_size=4, num_workers=2, persistent_workers=True)
    next(iter(loader))
    with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
        guard_workers(loader)
    assert loader.worker_init_fn is None
    assert any("loader_workers_unguarded" in r.getMessage() for r in caplog.records)
    del loader


def test_a_rank_exiting_with_a_live_iterator_does_not_wait_for_guarded_workers(
    tmp_path: Path,
) -> None:
    # multiprocessing terminates daemonic children at exit with SIGTERM and joins them: a
    # worker that ignored it for good would hang the exit forever.
    script = tmp_path / "live_iterator.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from torch.utils.data import DataLoader, TensorDataset
            from trainguard.trainer import guard_workers

            loader = guard_workers(
                DataLoader(TensorDataset(torch.arange(100.0)), batch_size=2, num_workers=2)
            )
            it = iter(loader)  # module level: still alive when the interpreter exits
            next(it)
            print("ok", flush=True)
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert out.decode().strip() == "ok"


def test_guarded_workers_end_when_the_rank_is_killed() -> None:
    script = textwrap.dedent(
        """
        import os, sys, torch
        from torch.utils.data import DataLoader, TensorDataset
        from trainguard.trainer import guard_workers

        loader = guard_workers(
            DataLoader(TensorDataset(torch.arange(100.0)), batch_size=2, num_workers=2)
        )
        it = iter(loader)
        next(it)
        print(" ".join(str(w.pid) for w in it._workers), flush=True)
        sys.stdin.read()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # its resource tracker reports the SIGKILLed rank's semaphores
    )
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        proc.kill()
        proc.wait(30)

        # WorkerInit watches the rank (every 1 s), also in a worker still starting when it died
        wait_for(
            lambda: not any(alive(p) for p in pids), timeout_s=30, what="orphaned workers to exit"
        )
    finally:
        proc.kill()
