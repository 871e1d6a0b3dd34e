"""A job's entry module for the warm standby test: joins the world its membership names
(one rank), writes what it saw to --out, leaves."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from trainguard.membership import Membership
from trainguard.trainer.rejoin import join_world, leave_world


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--membership", required=True)
    args = p.parse_args()
    m = Membership.from_json(args.membership)
    join_world(m)
    seen = {
        "pid": os.getpid(),
        "rank": torch.distributed.get_rank(),
        "world_size": torch.distributed.get_world_size(),
        "epoch": m.epoch,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_initialized": torch.cuda.is_initialized(),
    }
    leave_world()
    with open(args.out, "w") as f:
        json.dump(seen, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
