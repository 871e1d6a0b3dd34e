"""One rank of a data-parallel job (DDP, gloo) that injects events into itself at planned
step() calls and records, per call, what `Trainguard.step()` returned.

Run by tests/integration/test_trainer_reaction.py as RANK/WORLD_SIZE/MASTER_* processes:

    python trainer_reaction_worker.py --out DIR --ckpt-dir DIR --step-s 0.1 \
        --plan checkpoint@12:2,nan@24:1,stop@40:1

A plan entry KIND@CALL:RANK injects after the step() call number CALL (counted from 1, across
rollbacks) on rank RANK: `checkpoint` / `stop` send a Control datagram to the rank's own
control socket, `sigterm` sends the process SIGTERM, `nan` makes the next call's loss NaN.
Each rank writes one JSON line per call to DIR/rank<R>.jsonl, and the injections to
DIR/inject<R>.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from trainguard.protocol import Control, encode_json
from trainguard.trainer import Trainguard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--step-s", type=float, required=True)
    p.add_argument("--plan", required=True)
    p.add_argument("--max-calls", type=int, default=200)
    args = p.parse_args()
    plan: dict[int, str] = {}
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for entry in args.plan.split(","):
        kind, where = entry.split("@")
        call, on_rank = where.split(":")
        if int(on_rank) == rank:
            plan[int(call)] = kind

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tg = Trainguard(
        model=model,
        optimizer=opt,
        ckpt_dir=args.ckpt_dir,
        checkpoint_every=10,
        nan_policy="rollback",
        sigterm_hard_exit=False,
        job="reaction",
    )
    out = open(args.out / f"rank{rank}.jsonl", "w")
    inject = open(args.out / f"inject{rank}.jsonl", "w")
    step = tg.resume(first_step=1)
    nan_next = False
    for call in range(1, args.max_calls + 1):
        time.sleep(args.step_s)  # the rank's compute
        x = torch.randn(8, 4)
        loss = F.mse_loss(model(x), torch.zeros(8, 2))
        opt.zero_grad()
        loss.backward()  # DDP's gradient all_reduce: the ranks leave the step together
        opt.step()
        reported = math.nan if nan_next else loss.item()
        nan_next = False
        action = tg.step(step, loss=reported)
        record = {
            "call": call,
            "step": step,
            "t": time.monotonic(),
            "stop": action.stop,
            "reason": action.reason,
            "rollback": action.rollback,
            "checkpoint_started": action.checkpoint_started,
            "request_id": action.request_id,
        }
        out.write(json.dumps(record) + "\n")
        out.flush()
        if action.stop:
            break
        kind = plan.get(call)
        if kind is not None:
            inject.write(json.dumps({"call": call, "kind": kind, "t": time.monotonic()}) + "\n")
            inject.flush()
            if kind in ("checkpoint", "stop"):
                assert tg.channel.control_socket is not None
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                    s.sendto(
                        encode_json(
                            Control(action=kind, request_id=f"{kind}-{call}", job="reaction")  # type: ignore[arg-type]
                        ),
                        tg.channel.control_socket,
                    )
            elif kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif kind == "nan":
                nan_next = True
        if action.rollback:
            assert action.next_step is not None
            step = action.next_step
        else:
            step += 1
    tg.close()
    out.close()
    inject.close()
    dist.destroy_process_group()
    # Everything is written and the process group is gone. Leave without the interpreter's
    # teardown: torch's gloo threads sometimes abort it ("terminate called without an active
    # exception", SIGABRT) after the work is done, and the test reads exit codes (as
    # trainer_fsdp2_worker.py does).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
