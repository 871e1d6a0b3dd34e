"""A PyTorch Lightning job watched by trainguard's callback: 2 CPU ranks, DDP on gloo.

A small MLP on synthetic classification data (generated from the seed), a shuffled
`DistributedSampler` wrapped in `ResumableSampler` (the data position is in the checkpoint),
AdamW and a step LR schedule; deterministic. Run under torchrun:

    torchrun --standalone --nproc-per-node 2 examples/train_lightning.py --steps 40 \
        --ckpt-dir /tmp/pl --checkpoint-every 10

A relaunch resumes from the newest checkpoint whose checksums verify. Rank 0 prints one JSON
line per step, e.g. {"step": 12, "loss": 1.93, "ckpt_step": 10}; the checkpoint of step k
holds the state after step k.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.trainer import ResumableSampler, exit_finished
from trainguard.trainer.integrations.lightning import TrainguardCallback


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="last step to run (steps start at 1)")
    ckpt_default = os.environ.get("TRAINGUARD_CKPT_DIR")
    p.add_argument("--ckpt-dir", required=ckpt_default is None, default=ckpt_default)
    p.add_argument("--checkpoint-every", type=int, default=10, help="0 = only on request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--step-time-s", type=float, default=0.0, help="pad each step to this time")
    return p.parse_args(argv)


class Classifier(pl.LightningModule):
    def __init__(self, *, seed: int, step_time_s: float) -> None:
        super().__init__()
        torch.manual_seed(seed)  # identical initial weights on every rank
        self.net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
        self.step_time_s = step_time_s

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        if self.step_time_s:  # stands in for the device time of a real model
            time.sleep(self.step_time_s)
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PrintLosses(pl.Callback):
    """Rank 0: one JSON line per step, after trainguard's callback has acted on it."""

    def __init__(self, guard: TrainguardCallback) -> None:
        self.guard = guard

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if not trainer.is_global_zero:
            return
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        line: dict[str, Any] = {
            "step": trainer.global_step,
            "loss": float(loss.detach()),
            "ckpt_step": self.guard.ckpt_step,
        }
        action = self.guard.last_action
        if action is not None and action.stop:
            line["action"] = "stop"
            line["reason"] = action.reason
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))

    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(1024, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    data = TensorDataset(x, y)
    inner = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    sampler = ResumableSampler(inner, batch_size=args.batch_size)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    guard = TrainguardCallback(
        ckpt_dir=args.ckpt_dir, checkpoint_every=args.checkpoint_every, sampler=sampler
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
        strategy="ddp" if world > 1 else "auto",
        max_steps=args.steps,
        max_epochs=-1,
        use_distributed_sampler=False,  # the ResumableSampler splits the data
        deterministic=True,
        callbacks=[guard, PrintLosses(guard)],
        enable_checkpointing=False,  # trainguard's callback checkpoints
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Classifier(seed=args.seed, step_time_s=args.step_time_s)
    trainer.fit(model, loader, ckpt_path=guard.resume_path())
    if torch.distributed.is_initialized():
        # trained, saved, callback closed: end without the interpreter's teardown, where a
        # gloo thread still releasing the framework's last collective aborts the process
        # (SIGABRT) and torchrun reports the job failed (trainguard.trainer.exit_finished)
        exit_finished(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
