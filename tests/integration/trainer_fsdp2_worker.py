"""One rank of a small FSDP2 (or tensor-parallel) job on a CPU device mesh (gloo) for the
FSDP2 checkpoint tests: AdamW, LambdaLR, gradient clipping, `ResumableSampler`, periodic
checkpoints, written the way README and docs/trainer.md show.

    --phase run:    resume (or start), train to --steps with a checkpoint every --every
                    steps; every rank appends `{"step", "loss"}` per step to
                    DIR/losses-<tag>-rank<R>.jsonl (flushed: a kill -9 keeps what was done)
                    and rank 0 writes DIR/<tag>.json with the first step and the samples
                    each rank saw
    --phase switch: resume, dump the state loaded (full tensors) and train --steps more
                    steps, save, dump the state saved: for the world-size changes

--parallel tp shards the same model by tensor parallelism instead (every rank on the same
batches). --seed gives the initial weights; --step-sleep-s slows each step down so a test can kill
the ranks mid-run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainguard.trainer import ResumableSampler, Trainguard

SAMPLES = 480
BATCH = 2


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(5, generator=g), torch.randint(0, 3, (), generator=g), i


def build(world: int, seed: int, parallel: str) -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(seed)
    # FSDP2: odd sizes, so the shards are uneven on 2 and on 3 ranks (FSDP2 pads them).
    # Tensor parallel needs the sharded dimensions to divide by the ranks.
    h1, h2 = (16, 12) if parallel == "tp" else (17, 11)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, h1), torch.nn.ReLU(), torch.nn.Linear(h1, h2), torch.nn.ReLU(),
        torch.nn.Linear(h2, 3),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    if parallel == "tp":
        parallelize_module(
            model, mesh,
            {"0": ColwiseParallel(), "2": RowwiseParallel(),
             "4": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())},
        )  # fmt: skip
    else:
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["run", "switch"], required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=0)
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="initial weights (all ranks)")
    p.add_argument("--parallel", choices=["fsdp2", "tp"], default="fsdp2")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO)  # the checkpoint events, for the test to read
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    # A test resumes with other initial weights: only the checkpoint makes the runs equal.
    model, opt, sched = build(world, args.seed, args.parallel)
    ds = Indexed()
    # Tensor parallel: every rank computes on the same batch (one data-parallel replica).
    replicas, replica = (1, 0) if args.parallel == "tp" else (world, rank)
    sampler = ResumableSampler(
        DistributedSampler(ds, num_replicas=replicas, rank=replica, shuffle=True, seed=5),
        batch_size=BATCH,
    )
    loader = DataLoader(ds, batch_size=BATCH, sampler=sampler, drop_last=True)
    tg = Trainguard(
        model=model, optimizer=opt, scheduler=sched, sampler=sampler, ckpt_dir=args.ckpt_dir,
        checkpoint_every=args.every, keep_last=0, handle_sigterm=False, job="fsdp2",
    )  # fmt: skip
    start = tg.resume(first_step=1)
    batches = sampler.batches(loader)
    seen: list[int] = []
    losses = open(args.out / f"losses-{args.tag}-rank{rank}.jsonl", "a")

    def train(step: int) -> None:
        x, y, idx = next(batches)
        seen.extend(int(i) for i in idx)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        losses.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
        losses.flush()
        assert not tg.step(step, loss=loss).stop
        if args.step_sleep_s:
            time.sleep(args.step_sleep_s)

    info: dict[str, Any] = {"start": start, "world_size": world}
    if args.phase == "run":
        for step in range(start, args.steps + 1):
            train(step)
    else:
        dump_state(args.out / f"{args.tag}-loaded-rank{rank}.pt", model, opt, sched)
        info["samples_done_at_start"] = sampler.samples_done
        end = start + args.steps
        for step in range(start, end):
            train(step)
        assert tg.save(end - 1, wait=True)
        info["samples_done"] = sampler.samples_done
        dump_state(args.out / f"{args.tag}-saved-rank{rank}.pt", model, opt, sched)
    tg.close()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, seen)
    if rank == 0:
        info["seen"] = everyone
        (args.out / f"{args.tag}.json").write_text(json.dumps(info))
    dist.destroy_process_group()
    # Everything is written and the process group is gone. Leave without the interpreter's
    # teardown: torch's gloo/FSDP threads sometimes abort it ("terminate called without an
    # active exception", SIGABRT) after the work is done, and the test reads exit codes.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def dump_state(path: Path, model: Any, opt: Any, sched: Any) -> None:
    """The whole (unsharded) state, comparable across world sizes."""
    full = StateDictOptions(full_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=full)
    torch.save({"model": msd, "optim": osd, "sched": sched.state_dict()}, path)


if __name__ == "__main__":
    main()
