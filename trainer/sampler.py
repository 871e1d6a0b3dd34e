"""A resumable wrapper around `DistributedSampler`: the data position is part of the checkpoint.

`ResumableSampler` yields exactly the indices its inner `DistributedSampler` would (same
shuffle, seed and per-rank split), starting from a saved position {epoch, batches done in
that epoch}. The position advances only when a training step completes (`mark_step()`,
called by `Trainguard.step`), never when a DataLoader prefetches, so a checkpoint taken after
step k resumes with the batch of step k+1. Epochs roll over by themselves.

The position is also kept in samples: the job's ranks together have consumed a prefix of the
epoch's order (rank r takes every num_replicas-th index), so "samples done this epoch" fixes
the data position whatever the world size. A checkpoint written by N ranks and loaded into a
sampler over M ranks (or another batch size) continues the epoch with exactly the samples
not yet seen, split over the M ranks the way DistributedSampler splits an epoch (what does
not divide evenly is dropped or padded as its `drop_last` says); the next epochs are plain
DistributedSampler epochs over M ranks.

    sampler = ResumableSampler(DistributedSampler(ds, shuffle=True, seed=0), batch_size=8)
    loader = DataLoader(ds, batch_size=8, sampler=sampler, drop_last=True)
    batches = sampler.batches(loader)       # endless, restart-safe iterator over epochs
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils.data import DistributedSampler, Sampler

from trainguard.trainer.workers import guard_workers, stop_signals_blocked

__all__ = ["ResumableSampler"]

log = logging.getLogger("trainguard.trainer")

B = TypeVar("B")


class ResumableSampler(Sampler[int]):
    def __init__(
        self, inner: DistributedSampler[Any], *, batch_size: int, drop_last: bool = True
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.inner = inner
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.epoch = 0
        self.batches_done = 0  # this rank's batches of this epoch since `offset`
        # Samples of this epoch (all ranks) consumed before this world size took over: non-zero
        # only after a resume at another world size or batch size, until the epoch ends.
        self.offset = 0
        self._warned_loader = False

    @property
    def batches_per_epoch(self) -> int:
        """This rank's batches in the current epoch (from `offset` after a world change)."""
        n = self._rank_samples()
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def samples_done(self) -> int:
        """Samples of the current epoch the whole job has consumed (every rank's)."""
        return self.offset + self.batches_done * self.batch_size * self.inner.num_replicas

    def __len__(self) -> int:
        """Samples left to this rank in the current epoch: after a mid-epoch resume a
        DataLoader's len() is the rest of the epoch, not a whole one."""
        remaining = self._rank_samples() - self.batches_done * self.batch_size
        return max(0, remaining)

    def __iter__(self) -> Iterator[int]:
        if self.offset == 0:
            self.inner.set_epoch(self.epoch)
            indices = list(iter(self.inner))
        else:
            indices = self._rest_of_epoch()
        return iter(indices[self.batches_done * self.batch_size :])

    def mark_step(self, batches: int = 1) -> None:
        """One training step consumed `batches` batches; roll over to the next epoch at its end."""
        if self.batches_per_epoch <= 0 and self.offset == 0:
            raise ValueError("the dataset is smaller than one batch on this rank")
        self.batches_done += batches
        while self.batches_done >= (per_epoch := self.batches_per_epoch):
            self.batches_done -= per_epoch
            self.epoch += 1
            self.offset = 0
            if self.batches_per_epoch <= 0:
                raise ValueError("the dataset is smaller than one batch on this rank")

    def _rank_samples(self) -> int:
        """Indices this rank gets in the current epoch (DistributedSampler's split of the
        epoch's order from `offset` on)."""
        if self.offset == 0:
            return len(self.inner)
        rest = max(0, len(self.inner.dataset) - self.offset)  # type: ignore[arg-type]
        replicas = self.inner.num_replicas
        return rest // replicas if self.inner.drop_last else -(-rest // replicas)

    def _rest_of_epoch(self) -> list[int]:
        """This rank's share of the epoch's order after the first `offset` samples."""
        inner = self.inner
        n = len(inner.dataset)  # type: ignore[arg-type]
        if inner.shuffle:
            # The same permutation DistributedSampler draws for this epoch.
            g = torch.Generator()
            g.manual_seed(inner.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        rest = order[self.offset :]
        replicas = inner.num_replicas
        if inner.drop_last:
            rest = rest[: len(rest) - len(rest) % replicas]
        elif rest and len(rest) % replicas:
            pad = replicas - len(rest) % replicas
            rest += (rest * (pad // len(rest) + 1))[:pad]
        return rest[inner.rank :: replicas]

    def batches(self, loader: Iterable[B]) -> Generator[B, None, None]:
        """Endless iterator over `loader`'s batches across epochs, from the current position.

        A DataLoader with worker processes gets `WorkerInit` (trainer.workers) first: its
        workers ignore the SIGTERM/SIGINT meant for the rank, so a stop reaches the emergency
        checkpoint instead of killing the loader. A loader with workers that is not a
        `resumable_loader` gets a WARNING (once): its workers' random state follows the
        worker, not the data position, so random augmentation does not resume exactly."""
        self._check_loader(loader)
        guard_workers(loader)
        while True:
            empty = True
            with stop_signals_blocked():  # until the new workers run their WorkerInit
                it = iter(loader)
            for batch in it:
                empty = False
                yield batch
            if empty:
                raise ValueError("the loader yielded no batch for a whole epoch")

    def _check_loader(self, loader: object) -> None:
        # loader.py imports this module (a cycle at the top)
        from trainguard.trainer.loader import PositionSampler  # noqa: PLC0415

        workers = int(getattr(loader, "num_workers", 0) or 0)
        if self._warned_loader or workers <= 0:
            return
        if isinstance(getattr(loader, "sampler", None), PositionSampler):
            return
        self._warned_loader = True
        log.warning(
            "event=loader_not_resumable num_workers=%d: random augmentation in DataLoader "
            "workers will not resume exactly (each worker's random state follows the worker, "
            "not the data position); fix: build the loader with "
            "trainguard.trainer.resumable_loader(dataset, sampler=sampler, num_workers=%d)",
            workers,
            workers,
        )

    def set_world(self, *, rank: int, world_size: int) -> None:
        """This rank's place changed: the world was re-formed in the process (a rank of
        another number, another world size). The position is kept in samples, as a load at
        another world size keeps it; at the same world size, exactly."""
        inner = self.inner
        if (inner.rank, inner.num_replicas) == (rank, world_size):
            return
        position = self.state_dict()
        self.inner = DistributedSampler(
            inner.dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=inner.shuffle,
            seed=inner.seed,
            drop_last=inner.drop_last,
        )
        self.load_state_dict(position)

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "offset": self.offset,
            "samples_done": self.samples_done,
            "num_replicas": self.inner.num_replicas,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position. Saved by the same world size and batch size: exactly that
        position. Otherwise: the epoch continues after the `samples_done` samples the saving
        job consumed (each rank of that job saved the same figure)."""
        self.epoch = int(state["epoch"])
        replicas = int(state.get("num_replicas", self.inner.num_replicas))
        batch_size = int(state.get("batch_size", self.batch_size))
        if replicas == self.inner.num_replicas and batch_size == self.batch_size:
            self.batches_done = int(state["batches_done"])
            self.offset = int(state.get("offset", 0))
            return
        self.batches_done = 0
        self.offset = int(state["samples_done"])
        if self.offset > 0 and self.batches_per_epoch <= 0:
            # What is left of the epoch makes no batch on this world: the next epoch.
            self.epoch += 1
            self.offset = 0
