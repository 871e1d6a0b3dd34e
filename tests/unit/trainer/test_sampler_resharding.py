"""ResumableSampler across world sizes: the position is kept in samples, so a job resumed on
another number of ranks (or another batch size) sees exactly the samples of the epoch it had
not seen, each once, and plain DistributedSampler epochs after that."""

from __future__ import annotations

from collections import Counter

import pytest
from torch.utils.data import DistributedSampler

from trainguard.trainer import ResumableSampler

DATASET = list(range(480))


def samplers(world: int, *, batch_size: int, **kw: object) -> list[ResumableSampler]:
    return [
        ResumableSampler(
            DistributedSampler(DATASET, num_replicas=world, rank=r, seed=5, **kw),  # type: ignore[arg-type]
            batch_size=batch_size,
        )
        for r in range(world)
    ]


def consume(group: list[ResumableSampler], steps: int) -> list[int]:
    """`steps` data-parallel steps: every rank takes one batch per step."""
    seen: list[int] = []
    for s in group:
        seen += list(s)[: steps * s.batch_size]
        s.mark_step(steps)
    return seen


@pytest.mark.parametrize(
    ("old_world", "new_world", "new_batch"),
    [(3, 2, 2), (3, 4, 2), (3, 1, 2), (2, 3, 4), (3, 3, 3)],
    ids=["3-to-2", "3-to-4", "3-to-1", "2-to-3-bigger-batch", "same-world-other-batch"],
)
def test_rest_of_the_epoch_is_exactly_the_unseen_samples_each_once(
    old_world: int, new_world: int, new_batch: int
) -> None:
    old = samplers(old_world, batch_size=2)
    steps = 24 // (2 * old_world)  # 24 samples seen: the 456 left divide among the new ranks
    seen = consume(old, steps)
    state = old[0].state_dict()
    assert all(s.state_dict() == state for s in old)
    assert state["samples_done"] == 24

    new = samplers(new_world, batch_size=new_batch)
    for s in new:
        s.load_state_dict(state)
    rest = [i for s in new for i in s]
    assert Counter(seen + rest) == Counter(DATASET)  # nothing skipped, nothing twice
    assert sum(len(s) for s in new) == len(rest) == len(DATASET) - len(seen)
    # The epoch ends for every new rank together; the next one is a plain DistributedSampler's.
    per_epoch = new[0].batches_per_epoch
    assert all(s.batches_per_epoch == per_epoch for s in new)
    for s in new:
        s.mark_step(per_epoch)
        assert (s.epoch, s.batches_done, s.offset) == (1, 0, 0)
        plain = DistributedSampler(DATASET, num_replicas=new_world, rank=s.inner.rank, seed=5)  # type: ignore[arg-type]
        plain.set_epoch(1)
        assert list(s) == list(plain)


def test_same_world_and_batch_restores_the_exact_position() -> None:
    old = samplers(3, batch_size=2)
    consume(old, 7)
    new = samplers(3, batch_size=2)
    for o, n in zip(old, new, strict=True):
        n.load_state_dict(o.state_dict())
        assert list(n) == list(o)


def test_a_position_moved_across_two_world_changes_still_covers_the_epoch_once() -> None:
    first = samplers(3, batch_size=2)
    seen = consume(first, 4)
    second = samplers(4, batch_size=2)
    for s in second:
        s.load_state_dict(first[0].state_dict())
    seen += consume(second, 5)
    third = samplers(2, batch_size=2)
    for s in third:
        s.load_state_dict(second[0].state_dict())
    rest = [i for s in third for i in s]
    assert Counter(seen + rest) == Counter(DATASET)


def test_uneven_rest_is_padded_or_dropped_as_distributed_sampler_does() -> None:
    old = samplers(3, batch_size=2)
    seen = consume(old, 1)  # 6 seen, 474 left: not a multiple of 4 ranks x 2
    padded = samplers(4, batch_size=1)
    dropped = [
        ResumableSampler(
            DistributedSampler(DATASET, num_replicas=4, rank=r, seed=5, drop_last=True),  # type: ignore[arg-type]
            batch_size=1,
        )
        for r in range(4)
    ]
    for s in padded + dropped:
        s.load_state_dict(old[0].state_dict())
    rest_padded = [i for s in padded for i in s]
    rest_dropped = [i for s in dropped for i in s]
    unseen = set(DATASET) - set(seen)
    assert set(rest_padded) == unseen and len(rest_padded) == 476  # 2 repeated
    assert set(rest_dropped) <= unseen and len(rest_dropped) == 472 == len(set(rest_dropped))
