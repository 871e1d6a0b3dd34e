"""One rank of a small data-parallel job (DDP, gloo, CPU) for the world-size change tests.

    --phase write:  train --steps steps from scratch, save a checkpoint at the last one
                    (wait for its commit), dump the state it saved (rank 0) and every
                    rank's samples
    --phase resume: build the job fresh (other initial weights), resume, dump the state
                    loaded (every rank), then train to the end of the epoch and dump the
                    samples each rank saw

Samples are dataset indices (the dataset returns its index with the features), written to
DIR/<phase>-rank<R>.json; states to DIR/<phase>-state-rank<R>.pt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from trainguard.trainer import ResumableSampler, Trainguard

SAMPLES = 480
BATCH = 2


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(i)
        return torch.randn(4, generator=g), torch.randint(0, 3, (), generator=g), i


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=["write", "resume"], required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0 if args.phase == "write" else 1000 + rank)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    ds = Indexed()
    sampler = ResumableSampler(
        DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=5),
        batch_size=BATCH,
    )
    loader = DataLoader(
        ds, batch_size=BATCH, sampler=sampler, drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    tg = Trainguard(
        model=model, optimizer=opt, scheduler=sched, sampler=sampler, ckpt_dir=args.ckpt_dir,
        handle_sigterm=False, job="elastic",
    )  # fmt: skip
    seen: list[int] = []

    def train(step: int, batches: Any) -> None:
        x, y, idx = next(batches)
        seen.extend(int(i) for i in idx)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        sched.step()
        assert not tg.step(step, loss=0.0).stop

    info: dict[str, Any] = {"rank": rank, "world_size": world}
    if args.phase == "write":
        assert tg.resume(first_step=1) == 1
        batches = sampler.batches(loader)
        for step in range(1, args.steps + 1):
            train(step, batches)
        assert tg.save(args.steps, wait=True)
        info["samples_done"] = sampler.samples_done
    else:
        start = tg.resume(first_step=1)
        info["start"] = start
        info["epoch_at_start"] = sampler.epoch
        info["len_sampler_at_start"] = len(sampler)
        info["batches_left"] = sampler.batches_per_epoch - sampler.batches_done
        batches = sampler.batches(loader)
        end = start + info["batches_left"]
        dump_state(args.out / f"resume-state-rank{rank}.pt", model, opt, sched)
        for step in range(start, end):
            train(step, batches)
        info["epoch_at_end"] = sampler.epoch
    if args.phase == "write" and rank == 0:
        dump_state(args.out / "write-state-rank0.pt", model, opt, sched)
    info["seen"] = seen
    (args.out / f"{args.phase}-rank{rank}.json").write_text(json.dumps(info))
    tg.close()
    dist.destroy_process_group()


def dump_state(path: Path, model: Any, opt: Any, sched: Any) -> None:
    msd, osd = get_state_dict(model, opt)
    torch.save({"model": msd, "optim": osd, "sched": sched.state_dict()}, path)


if __name__ == "__main__":
    main()
