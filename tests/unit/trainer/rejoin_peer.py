"""Rank 1 of a two-rank world whose rank 0 (the test) runs the store: joins the world its
membership (argv[1]) names, all-reduces its rank + 1, prints the sum, leaves."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from trainguard.membership import Membership
from trainguard.trainer.rejoin import join_world, leave_world


def main(raw: str) -> int:
    m = Membership.from_json(raw)
    join_world(m)
    t = torch.tensor([m.rank + 1.0])
    dist.all_reduce(t)
    print(f"sum={t.item():g} rank={dist.get_rank()} world_size={dist.get_world_size()}")
    leave_world()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
