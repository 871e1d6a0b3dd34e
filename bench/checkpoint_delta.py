"""Incremental checkpoints: bytes written and save time, full vs delta, in a pre-training and
a fine-tuning setting, on the example's model (examples/train.py: Linear, GELU, Dropout,
Linear; here wider) with AdamW on synthetic data.

Each setting trains `--every` steps between checkpoints and saves `--saves` times through
`CheckpointManager` with `full_every=--saves` (one full checkpoint, then deltas against it),
then once more with `full_every=0` over the same steps from the same start (every save full),
right after it on the same machine. Reported per setting: the
median bytes on disk and save time (the background writer's wall time: read and hash the
base, encode, write, fsync, manifest, rename) of the full saves and of the deltas, and the
delta's share of a full checkpoint. A resume from the last delta is checked to be bitwise.

- pretrain: every layer trains, lr 1e-3 (weights and both Adam moments change every step).
- finetune: the first layer frozen, lr 1e-5 (its weights do not change and have no Adam
  state; the trained layer's weights move in their low bits only).

`--codecs` also compares, on the last delta's state pair, the encodings that were weighed
(XOR + zlib, XOR + byte planes + zlib at levels 1 and 6): the ratio and the encode speed.

    .venv/bin/python bench/checkpoint_delta.py [--hidden 2048] [--every 10] [--saves 4]
        [--dir /path/on/target/disk] [--codecs]
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainguard.trainer.checkpoint import SaveResult
from trainguard.trainer.checkpoint_manager import CheckpointManager, CheckpointSettings, TrainState
from trainguard.trainer.manifest import read_manifest, step_dir_name
from trainguard.trainer.sync import LocalCoordinator


def build(args: argparse.Namespace, *, finetune: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(args.features, args.hidden),
        nn.GELU(),
        nn.Dropout(0.1),
        nn.Linear(args.hidden, args.classes),
    )
    if finetune:
        for p in model[0].parameters():
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5 if finetune else 1e-3, weight_decay=0.01)
    return model, opt


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    features = model[0].in_features
    classes = model[3].out_features
    for _ in range(steps):
        x = torch.randn(64, features, generator=g)
        y = torch.randint(0, classes, (64,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def run(args: argparse.Namespace, root: Path, *, finetune: bool, full_every: int) -> list[dict]:
    model, opt = build(args, finetune=finetune)
    train(model, opt, 1, seed=999)  # Adam's moments exist from the first step on
    ckpt = root / f"ck-{'ft' if finetune else 'pt'}-{full_every}"
    results: list[SaveResult] = []
    m = CheckpointManager(
        state=TrainState(model=model, optimizer=opt),
        settings=CheckpointSettings(ckpt_dir=ckpt, keep_last=0, full_every=full_every),
        coordinator=LocalCoordinator(),
        job="bench",
        on_result=results.append,
    )
    out: list[dict] = []
    last_state: Any = None
    for i in range(1, args.saves + 1):
        train(model, opt, args.every, seed=i)
        step = i * args.every
        assert m.save(step) and m.wait()
        m.collect()
        r = results[-1]
        assert r.ok, r.reason
        manifest = read_manifest(ckpt / step_dir_name(step))
        out.append(
            {
                "step": step,
                "format": manifest.format,
                "bytes": sum(int(f["size"]) for f in manifest.files.values()),
                "save_s": r.duration_s,
                "block_s": r.block_s,
            }
        )
        last_state = copy.deepcopy((model.state_dict(), opt.state_dict()))
    m.close()
    if full_every > 1:  # the last delta resumes bitwise
        other, other_opt = build(args, finetune=finetune)
        train(other, other_opt, 1, seed=999)
        loader = CheckpointManager(
            state=TrainState(model=other, optimizer=other_opt),
            settings=CheckpointSettings(ckpt_dir=ckpt, keep_last=0),
            coordinator=LocalCoordinator(),
            job="bench",
        )
        found = loader.restore_latest()
        assert found is not None and found[1].format == "delta"
        for k, v in other.state_dict().items():
            assert torch.equal(v.view(torch.uint8), last_state[0][k].view(torch.uint8)), k
        loader.close()
    shutil.rmtree(ckpt)
    return out


def codecs(args: argparse.Namespace, *, finetune: bool) -> dict[str, Any]:
    """The weighed encodings on one state pair: the trained layer's weight and Adam moment,
    `--every` steps apart."""
    model, opt = build(args, finetune=finetune)
    train(model, opt, 1, seed=999)
    w = model[3].weight
    before = [w.detach().clone(), opt.state[w]["exp_avg"].clone()]
    train(model, opt, args.every, seed=1)
    after = [w.detach(), opt.state[w]["exp_avg"]]
    a = np.concatenate([t.reshape(-1).view(torch.uint8).numpy() for t in before])
    b = np.concatenate([t.reshape(-1).view(torch.uint8).numpy() for t in after])
    x = np.bitwise_xor(a, b)
    planes = [np.ascontiguousarray(x.reshape(-1, 4)[:, i]) for i in range(4)]
    out: dict[str, Any] = {}
    cases = {
        "zlib1 (no XOR)": lambda: len(zlib.compress(b.data, 1)),
        "XOR + zlib1": lambda: len(zlib.compress(x.data, 1)),
        "XOR + planes + zlib1": lambda: sum(len(zlib.compress(p.data, 1)) for p in planes),
        "XOR + planes + zlib6": lambda: sum(len(zlib.compress(p.data, 6)) for p in planes),
    }
    for name, fn in cases.items():
        t0 = time.perf_counter()
        size = fn()
        dt = time.perf_counter() - t0
        out[name] = {"ratio": round(size / b.size, 3), "MB_per_s": round(b.size / dt / 1e6, 1)}
    return out


def summary(full: list[dict], delta: list[dict]) -> dict[str, Any]:
    deltas = [r for r in delta if r["format"] == "delta"]
    fb = statistics.median(r["bytes"] for r in full)
    fs = statistics.median(r["save_s"] for r in full)
    db = statistics.median(r["bytes"] for r in deltas)
    ds = statistics.median(r["save_s"] for r in deltas)
    return {
        "full_bytes": fb,
        "full_save_s": round(fs, 3),
        "delta_bytes": db,
        "delta_save_s": round(ds, 3),
        "delta_over_full_bytes": round(db / fb, 3),
        "delta_over_full_save_s": round(ds / fs, 2),
        "full_block_s": round(statistics.median(r["block_s"] for r in full), 4),
        "delta_block_s": round(statistics.median(r["block_s"] for r in deltas), 4),
        "deltas": len(deltas),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--classes", type=int, default=1024)
    p.add_argument("--every", type=int, default=10, help="training steps between checkpoints")
    p.add_argument("--saves", type=int, default=4, help="one full, then saves-1 deltas")
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--codecs", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="tg-delta-", dir=args.dir))
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        for name, finetune in (("pretrain", False), ("finetune", True)):
            delta = run(args, root, finetune=finetune, full_every=args.saves)
            full = run(args, root, finetune=finetune, full_every=0)
            report[name] = summary(full, delta)
            if args.codecs:
                report[name]["codecs"] = codecs(args, finetune=finetune)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
