"""Expected waste of a checkpoint interval, fixed against optimal, under the soak's fault rate.

The model is controller.ckptinterval's (docs/controller.md "Checkpoint interval"): with a
checkpoint costing the loop C s, a restart R s and a failure every M s, checkpoints every T s
of training waste C/T (overhead) + T/(2M) (work redone) + R/M (restart) of the wall time.
This script prints those three parts for the soak's fixed interval (`--fixed-every` steps of
`--step-time-s`, bench/soak.py's defaults) and for the optimal one (Daly's, and Young's),
with the soak's fault rate (a fault every `--mtbf-s`, 300 s). C is measured here: the time
`Trainguard.save()` blocks the loop, on the soak job's model (examples/train.py's MLP and
AdamW), median of `--saves` saves after a warm-up; `--state-mb` adds a larger state (a stack
of Linear layers) for a job whose checkpoint costs more. R is the soak's measured MTTR
(BENCHMARKS.md "Soak": median 13.6 s), or `--restart-s`. Also checks the worked example
(12 h MTBF, 5 min checkpoint: Young's 1.41 h, Daly's 1.36 h).

    .venv/bin/python bench/ckpt_waste.py [--saves 9] [--state-mb 0] [--restart-s 13.6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from trainguard.controller.ckptinterval import (
    daly_interval_s,
    expected_waste,
    young_interval_s,
)
from trainguard.trainer import Trainguard


def measure_block_s(*, saves: int, state_mb: int) -> float:
    """Median time `save()` blocks the loop (the snapshot to host memory), seconds."""
    torch.set_num_threads(1)
    layers: list[nn.Module] = [nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8)]
    if state_mb:
        width = 1024  # 4 MB of float32 per layer, x3 with AdamW's moments
        layers += [nn.Linear(8, width)] + [
            nn.Linear(width, width) for _ in range(max(1, state_mb // 12))
        ]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        tg = Trainguard(
            model=model,
            optimizer=opt,
            ckpt_dir=Path(d),
            handle_sigterm=False,
            job="ckpt-waste-bench",
            keep_last=1,
        )
        for step in range(1, saves + 3):
            loss = model(torch.randn(16, 32)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            tg.step(step, loss=loss.item())
            tg.checkpoints.wait()
            t0 = time.perf_counter()
            tg.save(step)
            times.append(time.perf_counter() - t0)
        tg.close()
    return statistics.median(times[2:])  # the first two: buffers still being prepared


def waste_parts(*, interval_s: float, c: float, r: float, m: float) -> tuple[float, ...]:
    overhead, redone, restart = c / interval_s, interval_s / 2 / m, r / m
    total = expected_waste(interval_s=interval_s, checkpoint_s=c, restart_s=r, mtbf_s=m)
    return overhead, redone, restart, total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--saves", type=int, default=9)
    p.add_argument("--state-mb", type=int, default=0)
    p.add_argument("--mtbf-s", type=float, default=300.0)  # the soak: a fault every 5 minutes
    p.add_argument("--restart-s", type=float, default=13.6)  # the soak's median MTTR
    p.add_argument("--step-time-s", type=float, default=0.2)  # bench/soak.py's step
    p.add_argument("--fixed-every", type=int, default=20)  # bench/soak.py's checkpoint_every
    p.add_argument("--checkpoint-s", type=float, default=None, help="skip the measurement")
    args = p.parse_args()

    young = young_interval_s(checkpoint_s=300.0, mtbf_s=12 * 3600.0)
    daly = daly_interval_s(checkpoint_s=300.0, mtbf_s=12 * 3600.0)
    ok = abs(young / 3600 - 1.414) < 0.005
    print(
        f"worked example: MTBF 12 h, checkpoint 5 min -> Young {young:.0f} s ({young / 3600:.2f}"
        f" h), Daly {daly:.0f} s ({daly / 3600:.2f} h): {'ok' if ok else 'MISMATCH'}"
    )

    c = args.checkpoint_s
    if c is None:
        c = measure_block_s(saves=args.saves, state_mb=args.state_mb)
    m, r, step_s = args.mtbf_s, args.restart_s, args.step_time_s
    print(
        f"inputs: checkpoint C = {c * 1000:.2f} ms (blocked, median of {args.saves} saves"
        f"{f', +{args.state_mb} MB state' if args.state_mb else ''}), restart R = {r:.1f} s,"
        f" MTBF M = {m:.0f} s, step {step_s} s"
    )
    rows = [
        (f"fixed: every {args.fixed_every} steps", args.fixed_every * step_s),
        ("optimal (Daly)", daly_interval_s(checkpoint_s=c, mtbf_s=m)),
        ("optimal (Young)", young_interval_s(checkpoint_s=c, mtbf_s=m)),
    ]
    print(f"{'interval':28} {'T (s)':>8} {'steps':>7} {'overhead':>9} {'redone':>8}"
          f" {'restart':>8} {'total':>8}")  # fmt: skip
    for name, t in rows:
        parts = waste_parts(interval_s=t, c=c, r=r, m=m)
        print(
            f"{name:28} {t:8.2f} {max(1, round(t / step_s)):7d} "
            + " ".join(f"{x:8.2%}" for x in parts)
        )


if __name__ == "__main__":
    main()
