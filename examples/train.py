"""A small real training job using the trainguard trainer library.

An MLP with dropout on synthetic classification data (generated from the seed), a shuffled
DistributedSampler wrapped to be resumable, AdamW and a cosine LR schedule. Runs alone or
under torchrun (gloo on CPU):

    python examples/train.py --steps 40 --ckpt-dir /tmp/ck --checkpoint-every 10 --seed 0
    torchrun --standalone --nproc-per-node 3 examples/train.py --steps 40 --ckpt-dir /tmp/ck
    torchrun --standalone --nproc-per-node 2 examples/train.py --fsdp2 --ckpt-dir /tmp/ck

Rank 0 prints one JSON line per step on stdout, e.g.
    {"step": 12, "loss": 2.3125, "ckpt_step": 10, "lr": 0.00099, "epoch": 0}
Floats are printed exactly (repr); a non-finite loss is the string "NaN"/"Infinity"/
"-Infinity", as on the trainguard wire. Steps are numbered from 1; the checkpoint of step k
holds the state after step k, so a resumed run continues at k+1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

from trainguard.trainer import ResumableSampler, S3Config, Trainguard, resumable_loader


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="last step to run (steps start at 1)")
    # Under trainguard's job backend the agent exports TRAINGUARD_CKPT_DIR (the job's ckpt_dir).
    ckpt_default = os.environ.get("TRAINGUARD_CKPT_DIR")
    p.add_argument("--ckpt-dir", required=ckpt_default is None, default=ckpt_default)
    p.add_argument("--checkpoint-every", type=int, default=10, help="0 = only on request")
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument(
        "--full-every",
        type=int,
        default=0,
        help="incremental checkpoints: a full checkpoint every N commits, deltas between"
        " (0 = every checkpoint full; no effect under torchrun: DCP writes full ones)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--samples", type=int, default=2048, help="synthetic dataset size")
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--schedule-steps", type=int, default=1000, help="cosine LR period (not tied to --steps)"
    )
    p.add_argument(
        "--step-time-s",
        type=float,
        default=0.0,
        help="pad each step's compute (forward + backward) to this time",
    )
    p.add_argument("--nan-policy", choices=("continue", "stop", "rollback"), default="continue")
    p.add_argument("--skip-batches", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument(
        "--fsdp2",
        action="store_true",
        help="shard the model with FSDP2 (fully_shard on a CPU mesh): DTensor state, resharded"
        " checkpoints, gradients reduced by FSDP instead of the flat all-reduce",
    )
    p.add_argument("--sigterm-grace-s", type=float, default=30.0)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument(
        "--augment-noise",
        type=float,
        default=0.0,
        help="random noise of this scale added to each sample when it is loaded (augmentation)",
    )
    p.add_argument(
        "--log-samples",
        metavar="FILE",
        help="append one JSON line per completed step and rank to FILE: attempt, rank, world,"
        " step, epoch and the dataset indices of the rank's batch (data-position checks)",
    )
    p.add_argument("--s3-bucket")
    p.add_argument("--s3-prefix", help="default: trainguard/<job>")
    p.add_argument("--s3-endpoint-url")
    return p.parse_args(argv)


def make_data(*, seed: int, samples: int, features: int, classes: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    w = torch.randn(features, classes, generator=g)
    y = (x @ w + 0.5 * torch.randn(samples, classes, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class Augmented(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random augmentation at load time, in the DataLoader's workers when there are some."""

    def __init__(self, data: TensorDataset, *, noise: float) -> None:
        self.data = data
        self.noise = noise

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data[index]
        if self.noise:
            x = x + self.noise * torch.randn(x.shape)
        return x, y


class Indexed(Dataset[tuple[torch.Tensor, ...]]):
    """A dataset's samples with their index appended (for --log-samples)."""

    def __init__(self, data: Dataset[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        x, y = self.data[index]
        return x, y, torch.tensor(index)


def average_gradients(model: nn.Module, world: int) -> None:
    """All-reduce the gradients as one flat buffer in parameter order, every step the same.

    Not DistributedDataParallel: DDP reduces its first iteration with buckets in reverse
    parameter order and rebuilds them afterwards, so a process resumed at step k sums step
    k+1's gradients in another order than the uninterrupted run did, and the losses drift
    apart in the last bits. A fixed layout keeps resume bitwise exact."""
    params = [p for p in model.parameters() if p.grad is not None]
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        assert p.grad is not None
        n = p.grad.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def fmt(v: float) -> float | str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    return v


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    # Under torchrun (which sets WORLD_SIZE) always with a process group, even for one rank:
    # a checkpoint then resumes at another world size (a job shrunk to one rank, or grown).
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model: nn.Module = nn.Sequential(
        nn.Linear(args.features, args.hidden),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(args.hidden, args.classes),
    )
    if args.fsdp2:
        if not distributed:
            raise SystemExit("--fsdp2 runs under torchrun (a process group)")
        mesh = init_device_mesh("cpu", (world,))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)  # the parameters are DTensors: each rank holds a shard
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + 1000 + rank)  # dropout differs per rank, reproducibly
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.schedule_steps)

    data = make_data(
        seed=args.seed, samples=args.samples, features=args.features, classes=args.classes
    )
    inner = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    sampler = ResumableSampler(inner, batch_size=args.batch_size)
    # Batch size and order from the sampler; its own generator for the loader (drawing from the
    # global one would make the global RNG depend on when iterators were created); workers
    # that ignore the stop signals meant for this rank and load each sample with the random
    # state of its position, so a resume with workers and augmentation is exact too.
    dataset: Dataset[Any] = Augmented(data, noise=args.augment_noise)
    if args.log_samples:
        dataset = Indexed(dataset)
    loader = resumable_loader(
        dataset,
        sampler=sampler,
        seed=args.seed,
        num_workers=args.num_workers,
    )

    s3 = None
    if args.s3_bucket:
        s3 = S3Config(
            bucket=args.s3_bucket, prefix=args.s3_prefix, endpoint_url=args.s3_endpoint_url
        )
    tg = Trainguard(
        model=model,
        optimizer=opt,
        scheduler=sched,
        sampler=sampler,
        ckpt_dir=args.ckpt_dir,
        checkpoint_every=args.checkpoint_every,
        keep_last=args.keep_last,
        full_every=args.full_every,
        s3=s3,
        nan_policy=args.nan_policy,
        skip_batches=args.skip_batches,
        sync_every=args.sync_every,
        sigterm_grace_s=args.sigterm_grace_s,
    )
    step = tg.resume(first_step=1)
    # A controller rollback (after a NaN) restarts the job with the skip window here: the data
    # position moves that many batches past the restored checkpoint's, as the in-process
    # rollback's skip_batches does. Only when a checkpoint was restored.
    resume_skip = int(os.environ.get("TRAINGUARD_RESUME_SKIP_BATCHES", "0") or "0")
    if resume_skip > 0 and step > 1:
        sampler.mark_step(resume_skip)
    batches = sampler.batches(loader)
    while step <= args.steps:
        # This rank's own work (the straggler signal); the gradient all-reduce stays outside
        # (with --fsdp2 forward and backward hold FSDP's all-gathers and reduce-scatters: the
        # block then includes their waits).
        with tg.compute():
            t0 = time.perf_counter()
            epoch = sampler.epoch
            x, y, *indices = next(batches)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            # --step-time-s stands in for the device time of a real model's forward/backward
            pad_s = args.step_time_s - (time.perf_counter() - t0)
            if pad_s > 0:
                time.sleep(pad_s)
        if distributed and not args.fsdp2:  # FSDP2 reduce-scatters in backward
            average_gradients(model, world)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
        opt.step()
        sched.step()
        action = tg.step(step, loss=loss, grad_norm=grad_norm, samples=args.batch_size)
        if args.log_samples:
            record = {
                "attempt": int(os.environ.get("TRAINGUARD_ATTEMPT", "0")),
                "rank": rank,
                "world": world,
                "step": step,
                "epoch": epoch,
                "indices": indices[0].tolist(),
            }
            # one short append per line: ranks of every node share the file
            with open(args.log_samples, "a") as f:
                f.write(json.dumps(record) + "\n")
        if rank == 0:
            line = {
                "step": step,
                "loss": fmt(loss.item()),
                "ckpt_step": tg.ckpt_step,
                "lr": sched.get_last_lr()[0],
                "epoch": sampler.epoch,
            }
            if action.stop or action.rollback:
                line["action"] = "stop" if action.stop else "rollback"
                line["reason"] = action.reason
            # one write: print() writes the text and the newline separately, and a log line
            # from another thread (stderr goes to the same job log) could land in between
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
        if action.stop:
            break
        if action.rollback:
            assert action.next_step is not None
            step = action.next_step
            batches = sampler.batches(loader)
            continue
        step += 1
    tg.close()
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
