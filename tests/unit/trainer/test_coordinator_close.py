"""The distributed coordinator releases its two private gloo groups at close, while the
interpreter is whole, and refuses to be used afterwards (None would mean the job's group)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d

from trainguard.trainer.sync import DistCoordinator


@pytest.fixture
def one_rank_world(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_close_destroys_the_private_groups_and_leaves_the_job_group(one_rank_world: None) -> None:
    coord = DistCoordinator()
    mine = [coord.sync_group, coord.ckpt_group]
    assert all(g in distributed_c10d._world.pg_map for g in mine)
    assert coord.broadcast_int(7) == 7

    coord.close()

    assert not any(g in distributed_c10d._world.pg_map for g in mine)
    assert dist.is_initialized()  # the job's default group is the job's to destroy
    with pytest.raises(RuntimeError, match="coordinator is closed"):
        coord.broadcast_int(7)
    coord.close()  # twice: nothing left to release


def test_close_after_the_job_destroyed_every_group_is_quiet(one_rank_world: None) -> None:
    coord = DistCoordinator()
    dist.destroy_process_group()
    coord.close()
    with pytest.raises(RuntimeError, match="coordinator is closed"):
        _ = coord.ckpt_group
