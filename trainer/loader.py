"""`resumable_loader`: a DataLoader whose worker random state follows the data position.

A DataLoader seeds each worker once, when the worker starts, from a draw of the loader's
generator, and each worker's random state then advances with every sample it loads. A run
resumed mid-epoch starts new workers that load other batches than the same workers did in the
uninterrupted run, so random augmentation (`torch.rand` in `__getitem__`) differs. Here the
random state is a function of the position instead: before loading sample `index` of epoch
`epoch`, a worker seeds Python's `random`, numpy's global generator and torch's CPU generator
from (seed, epoch, index). The position is already in the checkpoint (`ResumableSampler`), so
a resumed run loads every later sample exactly as the uninterrupted run did, whatever worker
loads it, with any number of workers. Without workers the dataset runs in the rank itself,
on the rank's own generators, which the checkpoint saves: nothing is reseeded there.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from trainguard.trainer.sampler import ResumableSampler
from trainguard.trainer.workers import WorkerInit, stop_signals_blocked

__all__ = [
    "GuardedDataLoader",
    "PositionSampler",
    "PositionSeededDataset",
    "resumable_loader",
    "sample_seed",
]


def sample_seed(*, seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for sample `index` of `epoch`, stable across processes and runs."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class PositionSampler(Sampler[tuple[int, int]]):
    """Yields `(epoch, index)` for each index of a `ResumableSampler`, from its position."""

    def __init__(self, sampler: ResumableSampler) -> None:
        self.sampler = sampler

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.sampler.epoch
        return ((epoch, i) for i in self.sampler)


class PositionSeededDataset(Dataset[Any]):
    """Wraps a map-style dataset; `ds[(epoch, index)]` is `inner[index]`, loaded (in a worker)
    with the random state of `sample_seed(seed, epoch, index)`."""

    def __init__(self, inner: Any, *, seed: int) -> None:
        self.inner = inner
        self.seed = seed

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if get_worker_info() is not None:
            s = sample_seed(seed=self.seed, epoch=epoch, index=index)
            random.seed(s)
            np.random.seed(s & 0xFFFF_FFFF)
            torch.random.default_generator.manual_seed(s)
        return self.inner[index]


class GuardedDataLoader(DataLoader[Any]):
    """A DataLoader that starts its workers with the stop signals blocked (`WorkerInit`
    unblocks them once it has installed its handler), however it is iterated."""

    def _get_iterator(self) -> Any:
        with stop_signals_blocked():
            return super()._get_iterator()


def resumable_loader(
    dataset: Any,
    *,
    sampler: ResumableSampler,
    seed: int | None = None,
    worker_init_fn: Callable[[int], Any] | None = None,
    **loader_kwargs: Any,
) -> DataLoader[Any]:
    """A DataLoader over `dataset` in `sampler`'s order, batch size and drop_last, whose
    workers (if `num_workers > 0`) ignore the rank's stop signals (`WorkerInit`, wrapping
    `worker_init_fn`) and load each sample with the random state of its position.

    `seed` defaults to the inner DistributedSampler's seed. Other keyword arguments go to
    `DataLoader` (num_workers, collate_fn, pin_memory, persistent_workers, ...); `sampler`,
    `batch_sampler` and `shuffle` are this function's to set, and `batch_size` / `drop_last`,
    when given, must match the sampler's."""
    for name in ("batch_sampler", "shuffle"):
        if name in loader_kwargs:
            raise ValueError(f"resumable_loader sets {name} itself; drop it from the arguments")
    for name, want in (("batch_size", sampler.batch_size), ("drop_last", sampler.drop_last)):
        if name in loader_kwargs and loader_kwargs.pop(name) != want:
            raise ValueError(f"{name} must match the ResumableSampler's ({want})")
    if seed is None:
        seed = int(getattr(sampler.inner, "seed", 0))
    workers = loader_kwargs.get("num_workers", 0) > 0
    generator = loader_kwargs.pop("generator", None)
    if generator is None:
        # Every iter(loader) draws from this generator; the global one would make the rank's
        # random state depend on when iterators were created (a resume creates one more).
        generator = torch.Generator().manual_seed(seed)
    return GuardedDataLoader(
        PositionSeededDataset(dataset, seed=seed),
        batch_size=sampler.batch_size,
        drop_last=sampler.drop_last,
        sampler=PositionSampler(sampler),
        generator=generator,
        worker_init_fn=WorkerInit(worker_init_fn) if workers else worker_init_fn,
        **loader_kwargs,
    )
