"""A trainer-library job on CUDA for the GPU checks (tests/gpu/test_trainer_cuda.py): an MLP
with dropout (so the CUDA RNG state matters to the losses), AdamW, a warm-up schedule,
gradient clipping and a ResumableSampler, as FSDP2 on a CUDA device mesh (NCCL) or as a
plain model on the rank's GPU. Deterministic kernels, so a resumed run is bitwise comparable.

    torchrun --standalone --nproc-per-node 1 tests/gpu/cuda_job.py --ckpt-dir D --out F

Writes `resume N` and one `step N loss.hex()` line per step to --out (rank 0). `--die-at K`
SIGKILLs the process at step K, before that step's `tg.step()`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.trainer import ResumableSampler, Trainguard


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--die-at", type=int, default=0)
    p.add_argument("--pad-s", type=float, default=0.0, help="sleep after each step")
    p.add_argument("--mode", choices=("fsdp2", "plain"), default="fsdp2")
    p.add_argument("--cpu", action="store_true", help="gloo on CPU: a dry run of this script")
    args = p.parse_args()

    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank = dist.get_rank()
    if args.cpu:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(2048, 64), torch.randint(0, 8, (2048,)))
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(256, 8),
    ).to(device)
    if args.mode == "fsdp2":
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for layer in (model[0], model[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    sampler = ResumableSampler(DistributedSampler(ds, shuffle=True, seed=0), batch_size=32)
    # its own generator: an iterator's base seed never draws from the global RNG (dropout's)
    gen = torch.Generator().manual_seed(0)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, drop_last=True, generator=gen)
    tg = Trainguard(
        model=model,
        optimizer=opt,
        scheduler=sched,
        sampler=sampler,
        ckpt_dir=args.ckpt_dir,
        checkpoint_every=args.checkpoint_every,
        keep_last=3,
    )
    step = tg.resume(first_step=1)
    out = Path(args.out).open("a", buffering=1) if rank == 0 else None
    if out is not None:
        out.write(f"resume {step}\n")
    batches = sampler.batches(loader)
    while step <= args.steps:
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with tg.compute():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step == args.die_at:
            tg.checkpoints.wait()  # the last periodic save committed: the resume point is known
            os.kill(os.getpid(), signal.SIGKILL)
        loss_v = float(loss.item())
        action = tg.step(step, loss=loss_v, samples=len(x))
        if out is not None:
            out.write(f"step {step} {loss_v.hex()}\n")
        if action.stop:
            break
        time.sleep(args.pad_s)
        step += 1
    tg.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
