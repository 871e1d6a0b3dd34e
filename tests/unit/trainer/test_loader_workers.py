"""Resume with DataLoader worker processes and random augmentation is bitwise exact: each
sample is loaded with the random state of its position (trainer.loader), and the workers
ignore the stop signals meant for the rank (trainer.workers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from trainguard.trainer import ResumableSampler, Trainguard, resumable_loader
from trainguard.trainer.loader import sample_seed


class NoisyDataset(TensorDataset):
    """Random augmentation in __getitem__, as real pipelines do (crops, flips, noise)."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        x, y = super().__getitem__(index)
        return x + 0.5 * torch.rand(x.shape), y


class WorkerJob:
    def __init__(self, *, init_seed: int = 0, num_workers: int = 2) -> None:
        torch.manual_seed(init_seed)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Linear(16, 3))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(123)
        x, y = torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
        data = NoisyDataset(x, y)
        inner: DistributedSampler[Any] = DistributedSampler(
            data, num_replicas=1, rank=0, shuffle=True, seed=7
        )
        self.sampler = ResumableSampler(inner, batch_size=4)  # 16 batches per epoch
        self.loader = resumable_loader(data, sampler=self.sampler, num_workers=num_workers)

    def guard(self, ckpt_dir: Path, **kw: Any) -> Trainguard:
        return Trainguard(
            model=self.model,
            optimizer=self.opt,
            sampler=self.sampler,
            ckpt_dir=ckpt_dir,
            handle_sigterm=False,
            **kw,
        )

    def run(self, tg: Trainguard, start: int, end: int) -> dict[int, float]:
        losses: dict[int, float] = {}
        batches = self.sampler.batches(self.loader)
        for step in range(start, end + 1):
            x, y = next(batches)
            self.opt.zero_grad()
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            losses[step] = loss.item()
            if tg.step(step, loss=loss).stop:
                break
        return losses


@pytest.mark.parametrize("stop_at", [10, 20], ids=["mid-first-epoch", "mid-second-epoch"])
def test_resume_with_two_workers_and_random_augmentation_is_bitwise(
    tmp_path: Path, stop_at: int
) -> None:
    straight = WorkerJob()
    tg = straight.guard(tmp_path / "a")
    expected = straight.run(tg, 1, 36)
    tg.close()

    first = WorkerJob()
    tg = first.guard(tmp_path / "b")
    before = first.run(tg, 1, stop_at)
    assert tg.save(stop_at, wait=True)
    tg.close()
    assert before == {s: expected[s] for s in range(1, stop_at + 1)}

    resumed = WorkerJob(init_seed=99)  # other weights: everything must come from the checkpoint
    tg = resumed.guard(tmp_path / "b")
    start = tg.resume(first_step=1)
    assert start == stop_at + 1
    got = resumed.run(tg, start, 36)
    tg.close()
    assert got == {s: expected[s] for s in range(stop_at + 1, 37)}


def test_worker_count_does_not_change_what_a_sample_looks_like(tmp_path: Path) -> None:
    def first_batches(num_workers: int) -> list[torch.Tensor]:
        job = WorkerJob(num_workers=num_workers)
        batches = job.sampler.batches(job.loader)
        out = []
        for _ in range(6):
            out.append(next(batches)[0])
            job.sampler.mark_step()
        return out

    one, three = first_batches(1), first_batches(3)
    assert all(torch.equal(a, b) for a, b in zip(one, three, strict=True))


def test_sample_seeds_differ_by_epoch_and_index_and_are_stable() -> None:
    seeds = {sample_seed(seed=0, epoch=e, index=i) for e in range(3) for i in range(50)}
    assert len(seeds) == 150
    assert all(0 <= s < 2**63 for s in seeds)
    assert sample_seed(seed=1, epoch=2, index=3) == sample_seed(seed=1, epoch=2, index=3)


def test_loader_arguments_that_contradict_the_sampler_are_refused() -> None:
    data = TensorDataset(torch.zeros(8, 1))
    sampler = ResumableSampler(DistributedSampler(data, num_replicas=1, rank=0), batch_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        resumable_loader(data, sampler=sampler, batch_size=4)
    with pytest.raises(ValueError, match="shuffle"):
        resumable_loader(data, sampler=sampler, shuffle=True)
    loader = resumable_loader(data, sampler=sampler, batch_size=2, drop_last=True)
    assert loader.batch_size == 2


def _first_batch(sampler: ResumableSampler, loader: Any) -> None:
    batches = sampler.batches(loader)
    next(batches)
    batches.close()


@pytest.mark.parametrize(
    ("resumable", "num_workers", "warns"),
    [
        pytest.param(False, 1, True, id="plain-loader-with-workers-warns"),
        pytest.param(True, 1, False, id="resumable-loader-with-workers"),
        pytest.param(False, 0, False, id="plain-loader-without-workers"),
    ],
)
def test_a_plain_loader_with_workers_is_warned_about_once_naming_the_fix(
    caplog: pytest.LogCaptureFixture, resumable: bool, num_workers: int, warns: bool
) -> None:
    data = NoisyDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    sampler = ResumableSampler(DistributedSampler(data, num_replicas=1, rank=0), batch_size=4)
    if resumable:
        loader: Any = resumable_loader(data, sampler=sampler, num_workers=num_workers)
    else:
        loader = torch.utils.data.DataLoader(
            data, batch_size=4, sampler=sampler, drop_last=True, num_workers=num_workers
        )
    with caplog.at_level("WARNING", logger="trainguard.trainer"):
        _first_batch(sampler, loader)
        _first_batch(sampler, loader)  # a rollback iterates again: no second warning
    warnings = [r for r in caplog.records if "event=loader_not_resumable" in r.getMessage()]
    assert len(warnings) == (1 if warns else 0)
    if warns:
        assert "resumable_loader(dataset, sampler=sampler" in warnings[0].getMessage()
