"""A job that keeps its own loop and its own checkpoint code (plain DCP), watched by trainguard.

The job saves and loads with `torch.distributed.checkpoint` itself, as torchtitan- or
Megatron-style loops do; `OwnCheckpointer` sends the heartbeats, agrees on the step at which
a controller's checkpoint request, a stop or a SIGTERM is acted on, and calls `save(step)`
there on every rank. Under torchrun (gloo on CPU):

    torchrun --standalone --nproc-per-node 2 examples/train_own_ckpt.py --steps 40 \
        --ckpt-dir /tmp/own --checkpoint-every 10

Rank 0 prints one JSON line per step, e.g. {"step": 12, "loss": 1.93, "ckpt_step": 10}.
The checkpoint of step k holds the state after step k; a relaunch continues at k+1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainguard.trainer.integrations.own import OwnCheckpointer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="last step to run (steps start at 1)")
    ckpt_default = os.environ.get("TRAINGUARD_CKPT_DIR")
    p.add_argument("--ckpt-dir", required=ckpt_default is None, default=ckpt_default)
    p.add_argument("--checkpoint-every", type=int, default=10, help="0 = only on request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time-s", type=float, default=0.0, help="pad each step to this time")
    return p.parse_args(argv)


# --- the job's own checkpointer: a DCP directory per step, committed by a rename -------------


def step_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:06d}"


def save_checkpoint(
    ckpt_dir: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer
) -> None:
    """Every rank writes its part under a temporary name; rank 0 renames it when all did."""
    model_sd, opt_sd = get_state_dict(model, opt)
    tmp = ckpt_dir / f"step_{step:06d}.tmp"
    dcp.save({"model": model_sd, "optim": opt_sd}, checkpoint_id=tmp)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp.rename(step_dir(ckpt_dir, step))
    dist.barrier()


def load_latest(ckpt_dir: Path, model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Load the newest committed checkpoint; its step (0 when there is none)."""
    steps = sorted(
        int(d.name.removeprefix("step_"))
        for d in ckpt_dir.glob("step_*")
        if not d.name.endswith(".tmp")
    )
    if not steps:
        return 0
    model_sd, opt_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": opt_sd}
    dcp.load(state, checkpoint_id=step_dir(ckpt_dir, steps[-1]))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return steps[-1]


# --- the loop ------------------------------------------------------------------------------


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of (step, rank), the same in every run: nothing to resume for the data."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(16, 8, generator=g)
    return x, (x.sum(dim=1) > 0).long()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    guard = OwnCheckpointer(
        save=lambda step: save_checkpoint(ckpt_dir, step, model, opt),
        model=model,
        checkpoint_every=args.checkpoint_every,
    )
    done = load_latest(ckpt_dir, model, opt)
    if done:
        guard.resumed(done)
    for step in range(done + 1, args.steps + 1):
        with guard.compute():
            t0 = time.perf_counter()
            x, y = batch(args.seed, step, rank)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            pad_s = args.step_time_s - (time.perf_counter() - t0)
            if pad_s > 0:
                time.sleep(pad_s)
        for p in model.parameters():  # parameter order, every step the same: bitwise resume
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        action = guard.step(step, loss=loss, samples=16)
        if rank == 0:
            line = {"step": step, "loss": loss.item(), "ckpt_step": guard.ckpt_step}
            if action.stop:
                line["action"] = "stop"
                line["reason"] = action.reason
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()
        if action.stop:
            break
    guard.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
