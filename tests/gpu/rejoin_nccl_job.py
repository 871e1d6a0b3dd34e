"""One rank on the GPU: an NCCL world of one, a collective, the old world left the way a rank
that lost a peer leaves it (its NCCL communicators aborted through torch's own API, then
destroyed), a new world of the next epoch joined on a new port with this rank running the
store (host_store), and a collective in it. Prints one JSON line of what happened."""

from __future__ import annotations

import json
import logging
import sys

import torch
import torch.distributed as dist

from trainguard.membership import Membership
from trainguard.trainer.rejoin import join_world, leave_world


def all_reduced(value: float) -> float:
    t = torch.full((1024,), value, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return float(t[0].item())


def main(port0: int, port1: int) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    torch.cuda.set_device(0)
    out: dict[str, object] = {}
    for epoch, port in ((0, port0), (1, port1)):
        join_world(Membership(
            rank=0, world_size=1, store_host="127.0.0.1", store_port=port, epoch=epoch,
            timeout_s=60.0, backend="nccl", host_store=True,
        ))  # fmt: skip
        out[f"backend_{epoch}"] = str(dist.get_backend())
        out[f"sum_{epoch}"] = all_reduced(1.5 + epoch)
        leave_world(abort_timeout_s=30.0)
        out[f"initialized_after_{epoch}"] = dist.is_initialized()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
