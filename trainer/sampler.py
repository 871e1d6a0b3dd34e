"""A resumable wrapper around `DistributedSampler`: the data position is part of the checkpoint.

`ResumableSampler` yields exactly the indices its inner `DistributedSampler` would (same
shuffle, seed and per-rank split), starting from a saved position {epoch, batches done in
that epoch}. The position advances only when a training step completes (`mark_step()`,
called by `Trainguard.step`), never when a DataLoader prefetches, so a checkpoint taken after
step k resumes with the batch of step k+1. Epochs roll over by themselves.

    sampler = ResumableSampler(DistributedSampler(ds, shuffle=True, seed=0), batch_size=8)
    loader = DataLoader(ds, batch_size=8, sampler=sampler, drop_last=True)
    batches = sampler.batches(loader)       # endless, restart-safe iterator over epochs
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from torch.utils.data import DistributedSampler, Sampler

__all__ = ["ResumableSampler"]

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
        self.batches_done = 0

    @property
    def batches_per_epoch(self) -> int:
        n = len(self.inner)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __len__(self) -> int:
        remaining = len(self.inner) - self.batches_done * self.batch_size
        return max(0, remaining)

    def __iter__(self) -> Iterator[int]:
        self.inner.set_epoch(self.epoch)
        indices = list(iter(self.inner))
        return iter(indices[self.batches_done * self.batch_size :])

    def mark_step(self, batches: int = 1) -> None:
        """One training step consumed `batches` batches; roll over to the next epoch at its end."""
        per_epoch = self.batches_per_epoch
        if per_epoch <= 0:
            raise ValueError("the dataset is smaller than one batch on this rank")
        self.batches_done += batches
        while self.batches_done >= per_epoch:
            self.batches_done -= per_epoch
            self.epoch += 1

    def batches(self, loader: Iterable[B]) -> Iterator[B]:
        """Endless iterator over `loader`'s batches across epochs, from the current position."""
        while True:
            empty = True
            for batch in loader:
                empty = False
                yield batch
            if empty:
                raise ValueError("the loader yielded no batch for a whole epoch")

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.batches_done = int(state["batches_done"])
