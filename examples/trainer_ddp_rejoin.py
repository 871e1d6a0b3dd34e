"""A DDP job whose healthy ranks survive a lost peer in their processes (in-process rejoin).

Each process is one rank, or a warm standby that waits for the membership of a rank it will
replace. After a rank is lost, whoever watches the job names every process's next
`Membership` (docs/trainer.md, "In-process rejoin"). Three ways to start it:

- Under the agents (torchrun sets RANK/WORLD_SIZE, the agent TRAINGUARD_AGENT_SOCKET,
  TRAINGUARD_JOB, TRAINGUARD_ATTEMPT, TRAINGUARD_CKPT_DIR): trains with the peer-loss guard
  and bounded collectives; on a lost peer it waits for its `rejoin` Control on its control
  socket (the controller decides, the agent relays).

      torchrun --nproc-per-node 2 examples/trainer_ddp_rejoin.py --steps 1000

- As a warm standby of the agent's pool (trainer/standby_child.py runs this module with
  `--membership JSON` once assigned; pass `--standby` in the pool's args): joins the world
  the membership names and takes the state from a healthy peer.
- Under a test's or a bench's harness (tests/integration/rejoin_world.py), which runs a
  TCPStore and publishes memberships in it under each process's pid:

      python examples/trainer_ddp_rejoin.py --store 127.0.0.1:29500 --job demo \\
          --membership '{"rank": 0, "world_size": 2, ...}' --ckpt-dir ckpt --out out/r0.jsonl
      python examples/trainer_ddp_rejoin.py --store 127.0.0.1:29500 --job demo --standby ...

  `--rejoin-via control` makes such a rank wait on its control socket instead.

With --digest-out, each rank appends its model's digest at the end. With
--out, every completed step appends {"step", "loss" (float.hex), "pid", "rank",
"epoch", "time"}. --pause-at K (a test's fault): after step K this rank stops training and
sleeps, so that a kill -9 finds it at a known point. --full-restart: no rejoin, a lost peer
ends the process (exit 3), as a job without the fast path; relaunched, it resumes from the
checkpoint.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

# MKL's conditional numerical reproducibility: the same BLAS code path in every process,
# whatever its memory alignment (read at MKL's first call, so before any)
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.membership import Membership
from trainguard.trainer import ResumableSampler, Trainguard
from trainguard.trainer.rejoin import PeerLost, join_world, settle_ddp_buckets, wait_membership
from trainguard.trainer.standby_child import MEMBERSHIP_ENV

SAMPLES = 512
BATCH = 4
EXIT_PEER_LOST = 3


def state_digest(module: torch.nn.Module) -> str:
    """sha256 of the model's tensors, in order: equal digests, the bitwise same weights."""
    h = hashlib.sha256()
    for t in module.state_dict().values():
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def batch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--store", help="host:port of a harness's TCPStore (tests, bench)")
    p.add_argument("--job", help="the job's name (default: TRAINGUARD_JOB, as the agent sets)")
    p.add_argument("--membership", help="this process's first membership (JSON)")
    p.add_argument("--standby", action="store_true", help="a replacement: state from a peer")
    p.add_argument("--rejoin-via", choices=("store", "control"), help="default: store with "
                   "--store, else the control socket")  # fmt: skip
    p.add_argument("--ckpt-dir", type=Path, default=os.environ.get("TRAINGUARD_CKPT_DIR"))
    p.add_argument("--out", type=Path)
    p.add_argument("--digest-out", type=Path, help="at the end, append the rank's state digest")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--timeout-s", type=float, default=30.0, help="collectives (torchrun)")
    p.add_argument("--step-time-s", type=float, default=0.0, help="extra time per step")
    p.add_argument("--pause-at", type=int, default=-1)
    p.add_argument("--full-restart", action="store_true")
    p.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for membership")
    args = p.parse_args()
    if args.ckpt_dir is None:
        p.error("--ckpt-dir (or TRAINGUARD_CKPT_DIR) is required")
    if args.store is not None and args.job is None:
        p.error("--store needs --job (the memberships are published under it)")
    if args.store is None and args.standby and args.membership is None:
        p.error("--standby without --store needs --membership (the standby pool passes it)")
    args.rejoin_via = args.rejoin_via or ("store" if args.store else "control")
    return args


def main() -> int:
    args = parse()
    logging.basicConfig(level=logging.INFO, format="%(created).3f %(message)s")
    torch.set_num_threads(1)

    def from_store() -> Membership:
        host, _, port = args.store.rpartition(":")
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
    # A replacement: a harness's standby, or one the agent's pool assigned (it sets the env).
    replacement = args.standby or MEMBERSHIP_ENV in os.environ
    epoch: int | None = None
    timeout_s = args.timeout_s
    if args.membership or args.store:
        m = Membership.from_json(args.membership) if args.membership else from_store()
        join_world(m)
        epoch, timeout_s = m.epoch, m.timeout_s
    else:  # torchrun's env:// rendezvous; the epoch is the agent's TRAINGUARD_ATTEMPT
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    sampler = ResumableSampler(
        DistributedSampler(ds, num_replicas=dist.get_world_size(), rank=dist.get_rank(),
                           shuffle=True, seed=3),
        batch_size=BATCH,
    )  # fmt: skip
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=True)
    # The bare module goes to Trainguard: the DDP wrapper belongs to one process group and
    # is built again after every rejoin. It renumbers the sampler when its rank changes.
    tg = Trainguard(
        model=module, optimizer=opt, scheduler=sched, sampler=sampler, ckpt_dir=args.ckpt_dir,
        checkpoint_every=args.checkpoint_every, job=args.job, epoch=epoch,
        handle_sigterm=False, collective_timeout_s=timeout_s,
    )  # fmt: skip

    def next_membership() -> Membership:
        if args.rejoin_via == "store":
            return from_store()
        return tg.wait_membership(timeout_s=args.wait_s)

    step = tg.join_from_peer() if replacement else tg.resume()
    model = DistributedDataParallel(module)
    # a DDP built past step 0 first rebuilds its buckets as the uninterrupted run's did
    # (3+ ranks stay bitwise: trainguard.trainer.settle_ddp_buckets)
    settle = step > 0
    batches = sampler.batches(loader)
    out = open(args.out, "a") if args.out else None
    while step < args.steps:
        lost: PeerLost | None = None
        try:
            with tg.peer_loss_guard():
                x, y = next(batches)
                if args.step_time_s > 0:
                    time.sleep(args.step_time_s)  # a bigger model's compute
                if settle:
                    settle_ddp_buckets(model, functools.partial(batch_loss, model, x, y))
                    settle = False
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
            settle = step > 0
            batches = sampler.batches(loader)  # the data position may have moved
            continue
        if out is not None:
            row = {"step": step, "loss": float(loss.detach()).hex(), "pid": os.getpid(),
                   "rank": tg.rank, "epoch": tg.epoch, "time": time.time()}  # fmt: skip
            out.write(json.dumps(row) + "\n")
            out.flush()
        if action.stop:
            break
        if step == args.pause_at:
            time.sleep(3600)  # the fault: killed here
        step += 1
    if out is not None:
        out.close()
    if args.digest_out is not None:
        with open(args.digest_out, "a") as f:
            row = {"rank": tg.rank, "step": step, "digest": state_digest(module)}
            f.write(json.dumps(row) + "\n")
    tg.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
