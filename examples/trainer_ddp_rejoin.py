"""A DDP job whose healthy ranks survive a lost peer in their processes (in-process rejoin).

Each process is one rank, or a warm standby that waits for the membership of a rank it will
replace. The world is re-formed by whoever watches the job (the controller, later; here the
test or bench/inprocess_restart.py): it runs the rendezvous TCPStore, and after a rank is
lost publishes every process's next `Membership` under its pid (`publish_membership`).

    python examples/trainer_ddp_rejoin.py --store 127.0.0.1:29500 --job demo \\
        --membership '{"rank": 0, "world_size": 2, ...}' --ckpt-dir ckpt --out out/r0.jsonl
    python examples/trainer_ddp_rejoin.py --store 127.0.0.1:29500 --job demo --standby ...

Every completed step appends {"step", "loss" (float.hex), "pid", "rank", "time"} to --out.
--pause-at K (a test's fault): after step K this rank stops training and sleeps, so that a
kill -9 finds it at a known point. --full-restart: no rejoin, a lost peer ends the process
(exit 3), as a job without the fast path; relaunched, it resumes from the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.membership import Membership
from trainguard.trainer import ResumableSampler, Trainguard
from trainguard.trainer.rejoin import PeerLost, join_world, wait_membership

SAMPLES = 512
BATCH = 4
EXIT_PEER_LOST = 3


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True, help="host:port of the rendezvous TCPStore")
    p.add_argument("--job", required=True)
    p.add_argument("--membership", help="this rank's first membership (JSON); else --standby")
    p.add_argument("--standby", action="store_true", help="wait for a membership to replace")
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--pause-at", type=int, default=-1)
    p.add_argument("--full-restart", action="store_true")
    p.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for membership")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(created).3f %(message)s")
    host, _, port = args.store.rpartition(":")
    torch.set_num_threads(1)

    def next_membership() -> Membership:
        return wait_membership(
            store_host=host, store_port=int(port), job=args.job, pid=os.getpid(),
            timeout_s=args.wait_s,
        )  # fmt: skip

    # What does not depend on the world is built first: a warm standby has it ready (the
    # first optimizer alone imports torch's compiler stack, seconds) before it is assigned.
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    module = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g))
    m = Membership.from_json(args.membership) if args.membership else next_membership()
    join_world(m)
    sampler = ResumableSampler(
        DistributedSampler(ds, num_replicas=m.world_size, rank=m.rank, shuffle=True, seed=3),
        batch_size=BATCH,
    )
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=True)
    # The bare module goes to Trainguard: the DDP wrapper belongs to one process group and
    # is built again after every rejoin.
    tg = Trainguard(
        model=module, optimizer=opt, scheduler=sched, sampler=sampler, ckpt_dir=args.ckpt_dir,
        checkpoint_every=args.checkpoint_every, job=args.job, epoch=m.epoch,
        handle_sigterm=False, collective_timeout_s=m.timeout_s,
    )  # fmt: skip
    step = tg.join_from_peer() if args.standby else tg.resume()
    model = DistributedDataParallel(module)
    batches = sampler.batches(loader)
    with open(args.out, "a") as out:
        while step < args.steps:
            lost: PeerLost | None = None
            try:
                with tg.peer_loss_guard():
                    x, y = next(batches)
                    opt.zero_grad()
                    loss = F.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    sched.step()
                    action = tg.step(step, loss=loss)
            except PeerLost as e:
                lost = e
            if lost is not None:
                print(f"{time.time():.3f} peer lost at step {step}: {lost}", flush=True)
                if args.full_restart:
                    os._exit(EXIT_PEER_LOST)  # the old world's groups cannot be closed cleanly
                del model  # its reducer belongs to the old process group
                step = tg.rejoin(next_membership())
                model = DistributedDataParallel(module)
                batches = sampler.batches(loader)  # the data position may have moved
                continue
            row = {"step": step, "loss": float(loss.detach()).hex(), "pid": os.getpid(),
                   "rank": tg.rank, "time": time.time()}  # fmt: skip
            out.write(json.dumps(row) + "\n")
            out.flush()
            if action.stop:
                break
            if step == args.pause_at:
                time.sleep(3600)  # the fault: killed here
            step += 1
    tg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
