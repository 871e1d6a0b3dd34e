"""One rank of a 2-rank gloo job whose checkpoint interval is `auto`: at step() call 6 rank 1
(only) receives the controller's `set_interval` (every 4 steps), and again at call 9 (the same
request id: a retried command); at call 12 rank 0 receives it too, late. Each rank writes one
JSON line per call (step, interval in force, checkpoint started) to DIR/rank<R>.jsonl.

Run by tests/integration/test_trainer_auto_interval.py as RANK/WORLD_SIZE/MASTER_* processes:

    python trainer_auto_interval_worker.py --out DIR --ckpt-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainguard.protocol import Control, encode_json
from trainguard.trainer import Trainguard

CALLS = 30
# call -> ranks that receive the set_interval request after that call
DELIVER = {6: (1,), 9: (1,), 12: (0,)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tg = Trainguard(
        model=model,
        optimizer=opt,
        ckpt_dir=args.ckpt_dir,
        checkpoint_every="auto",  # starts at TRAINGUARD_CHECKPOINT_INTERVAL's auto:N
        sync_every=1,
        sigterm_hard_exit=False,
        job="auto-interval",
    )
    out = open(args.out / f"rank{rank}.jsonl", "w")
    for call in range(1, CALLS + 1):
        loss = model(torch.ones(1, 2)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        action = tg.step(call, loss=loss.item())
        record = {
            "call": call,
            "every": tg.checkpoint_every,
            "checkpoint_started": action.checkpoint_started,
        }
        out.write(json.dumps(record) + "\n")
        out.flush()
        if rank in DELIVER.get(call, ()):
            assert tg.channel.control_socket is not None
            control = Control(
                action="set_interval", request_id="ivl-1", job="auto-interval", every_steps=4
            )
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(encode_json(control), tg.channel.control_socket)
    tg.close()
    out.close()
    dist.destroy_process_group()
    # leave without the interpreter's teardown (gloo threads may abort it; see
    # trainer_reaction_worker.py)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
