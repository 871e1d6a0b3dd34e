"""ResumableSampler: same order as DistributedSampler, resumable mid-epoch, epochs roll over."""

from __future__ import annotations

import pytest
from torch.utils.data import DistributedSampler

from trainguard.trainer.sampler import ResumableSampler


def make(rank: int = 0) -> ResumableSampler:
    inner = DistributedSampler(range(50), num_replicas=2, rank=rank, shuffle=True, seed=7)
    return ResumableSampler(inner, batch_size=4)


def reference(epoch: int, rank: int = 0) -> list[int]:
    s = DistributedSampler(range(50), num_replicas=2, rank=rank, shuffle=True, seed=7)
    s.set_epoch(epoch)
    return list(s)


def test_fresh_sampler_yields_the_distributed_sampler_order() -> None:
    assert list(make(rank=1)) == reference(0, rank=1)


def test_position_advances_per_step_and_survives_a_state_round_trip() -> None:
    s = make()
    for _ in range(3):
        s.mark_step()
    resumed = make()
    resumed.load_state_dict(s.state_dict())
    assert list(resumed) == reference(0)[12:]


def test_epochs_roll_over_after_the_last_full_batch() -> None:
    s = make()
    assert s.batches_per_epoch == 6  # 25 samples per rank, drop_last
    s.mark_step(6)
    assert (s.state_dict()["epoch"], s.state_dict()["batches_done"]) == (1, 0)
    assert list(s) == reference(1)


def test_batches_iterates_across_epochs_from_the_saved_position() -> None:
    s = make()
    s.mark_step(5)
    loader = [list(s)[i : i + 4] for i in range(0, len(s) - len(s) % 4, 4)]
    assert loader == [reference(0)[20:24]]
    with pytest.raises(ValueError, match="batch_size"):
        ResumableSampler(s.inner, batch_size=0)
