"""A small HF Transformers `Trainer` job protected by trainguard's `TrainguardCallback`.

A tiny Llama model built from a config (nothing downloaded) learns synthetic token ids (a
dataset generated from the seed; no tokenizer), AdamW at a constant learning rate, on CPU.
Runs alone or under torchrun (gloo):

    torchrun --standalone --nproc-per-node 2 examples/train_hf.py --steps 40 --output-dir /tmp/hf

It resumes from the newest checkpoint whose files verify (`newest_verified_checkpoint`),
skipping a corrupt one. Rank 0 prints one JSON line per step on stdout, e.g.
    {"step": 12, "loss": 4.1406, "ckpt_step": 10}
the loss being the Trainer's (the mean over ranks), printed exactly (repr).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
    set_seed,
)

from trainguard.trainer import exit_finished
from trainguard.trainer.integrations.hf import TrainguardCallback, newest_verified_checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40, help="last step to run (steps start at 1)")
    out_default = os.environ.get("TRAINGUARD_CKPT_DIR")
    p.add_argument("--output-dir", required=out_default is None, default=out_default)
    p.add_argument("--save-steps", type=int, default=10, help="periodic checkpoint interval")
    p.add_argument("--save-total-limit", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=4, help="per rank")
    p.add_argument("--samples", type=int, default=512, help="synthetic dataset size")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--nan-policy", choices=("continue", "stop"), default="continue")
    p.add_argument("--sigterm-grace-s", type=float, default=30.0)
    p.add_argument("--step-time-s", type=float, default=0.0, help="sleep this long after each step")
    return p.parse_args(argv)


class SyntheticTokens(Dataset[dict[str, torch.Tensor]]):
    """Token ids drawn from the seed: a learnable pattern (each id follows from the previous
    one) with noise, so the loss falls."""

    def __init__(self, *, samples: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (samples, 1), generator=g)
        ids = (start + torch.arange(seq_len) * 3) % vocab
        noise = torch.rand(samples, seq_len, generator=g) < 0.1
        self.ids = torch.where(noise, torch.randint(0, vocab, ids.shape, generator=g), ids)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PrintLosses(TrainerCallback):
    """Rank 0: one JSON line per logged step on stdout; optionally sleeps after each step."""

    def __init__(self, *, guard: TrainguardCallback, step_time_s: float) -> None:
        self.guard = guard
        self.step_time_s = step_time_s

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        if self.step_time_s > 0:
            time.sleep(self.step_time_s)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kw: Any,
    ) -> None:
        if not state.is_world_process_zero or not logs or "loss" not in logs:
            return
        loss = float(logs["loss"])
        line = {
            "step": state.global_step,
            "loss": loss if math.isfinite(loss) else str(loss),
            "ckpt_step": self.guard.telemetry.ckpt_step,
        }
        # one write: a log line from another thread could land between text and newline
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    logging.getLogger("transformers").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    set_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
    )
    model = LlamaForCausalLM(config)
    data = SyntheticTokens(
        samples=args.samples, seq_len=args.seq_len, vocab=args.vocab, seed=args.seed
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=1,
        logging_nan_inf_filter=False,  # the NaN policy sees the loss as it was
        save_strategy="steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        seed=args.seed,
        data_seed=args.seed,
        dataloader_num_workers=0,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        disable_tqdm=True,
    )
    guard = TrainguardCallback(nan_policy=args.nan_policy, sigterm_grace_s=args.sigterm_grace_s)
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=data,
        callbacks=[guard, PrintLosses(guard=guard, step_time_s=args.step_time_s)],
    )
    resume = newest_verified_checkpoint(args.output_dir)
    trainer.train(resume_from_checkpoint=resume)
    if torch.distributed.is_initialized():
        # trained, saved, callback closed: end without the interpreter's teardown, where a
        # gloo thread still releasing the framework's last collective aborts the process
        # (SIGABRT) and torchrun reports the job failed (trainguard.trainer.exit_finished)
        exit_finished(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
