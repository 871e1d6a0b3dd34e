"""Checkpoint cost: how long the loop is blocked by an async save vs. a synchronous torch.save,
and the background writer's throughput vs. raw disk throughput (dd with fsync), same run.

The state is a few hundred MB of parameters plus Adam's two moments (~3x in total). The
async figure is the time `Trainguard.save()` takes to return (snapshot into host buffers).
The first save comes after `--steps-before-save` training steps through `Trainguard.step()`;
the first `step()` has the host buffers allocated and pre-faulted in the background, so the
first save only copies if they are ready by then (with 1 step it comes right after that step
and takes over from the preparation: the worst case). `--no-prepare` switches the background
preparation off, so the first save allocates the buffers itself, as it did before;
`--prepare-priority normal` runs it at the loop's priority instead of nice 19. The training
loop keeps both cores busy (a nice-19 preparation gets little CPU then); `--host-idle-s`
adds a sleep to every step, standing in for the time the host thread of a GPU-bound loop
waits for the device (idle CPU the preparation can use). First and later saves are reported
separately. The write throughput is checkpoint bytes on disk / the writer's wall time (write
+ fsync + sha256 + manifest + rename).

The disk and the CPUs may be shared with other work, so one dd and one save say little:
saves and dd runs alternate (dd, training steps, save, dd, save, ..., dd), each dd writes
as many bytes as the checkpoint holds, each save is compared with the mean of the dd runs
either side of it, and the medians are reported.

    .venv/bin/python bench/checkpoint.py [--dir /path/on/target/disk] [--layers 5] [--saves 7]
        [--steps-before-save 5] [--no-prepare | --prepare-priority normal] [--host-idle-s 0]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from trainguard.trainer import Trainguard
from trainguard.trainer import state as state_mod
from trainguard.trainer.manifest import read_manifest


def dd_throughput(directory: Path, size_bytes: int) -> float:
    """Bytes/s of `dd` writing `size_bytes` of zeros in 1 MiB blocks, then fsync."""
    target = directory / "dd.bin"
    cmd = [
        "dd",
        "if=/dev/zero",
        f"of={target}",
        "bs=1M",
        f"count={size_bytes}",
        "iflag=count_bytes",
        "conv=fsync",
    ]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    dt = time.perf_counter() - t0
    target.unlink()
    return size_bytes / dt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--layers", type=int, default=5, help="4096x4096 linear layers (67 MB each)")
    p.add_argument("--saves", type=int, default=7)
    p.add_argument(
        "--steps-before-save",
        type=int,
        default=5,
        help="training steps between setup and the first save (>= 1)",
    )
    p.add_argument(
        "--no-prepare",
        action="store_true",
        help="no background buffer preparation: the first save allocates (the old behaviour)",
    )
    p.add_argument("--prepare-priority", choices=["low", "normal"], default="low")
    p.add_argument(
        "--host-idle-s",
        type=float,
        default=0.0,
        help="sleep per training step (a GPU-bound loop's host thread waiting for the device)",
    )
    args = p.parse_args()
    if args.steps_before_save < 1:
        p.error("--steps-before-save must be >= 1")
    load_at_start = os.getloadavg()
    torch.set_num_threads(2)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tgck-"))
    base.mkdir(parents=True, exist_ok=True)
    work = base / f"bench-{os.getpid()}"
    work.mkdir()
    os.environ.setdefault("TRAINGUARD_AGENT_SOCKET", str(work / "absent.sock"))
    try:
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(args.layers)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)

        def train_step() -> None:
            opt.zero_grad()
            model(torch.randn(4, 4096)).sum().backward()
            opt.step()

        train_step()  # populates Adam's exp_avg / exp_avg_sq for the synchronous save
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        state = {"model": model.state_dict(), "optim": opt.state_dict()}

        t0 = time.perf_counter()
        with open(work / "sync.pt", "wb") as f:
            torch.save(state, f)
            t_nofsync = time.perf_counter() - t0
            f.flush()
            os.fsync(f.fileno())
        t_sync = time.perf_counter() - t0
        state_bytes = (work / "sync.pt").stat().st_size
        (work / "sync.pt").unlink()

        tg = Trainguard(
            model=model,
            optimizer=opt,
            ckpt_dir=work / "ckpt",
            checkpoint_every=0,
            keep_last=1,
            handle_sigterm=False,
        )
        if args.no_prepare:
            tg.checkpoints.pool.prepare = lambda obj: False  # type: ignore[method-assign]
        if args.prepare_priority == "normal":
            state_mod._lower_thread_priority = lambda: None
        # The first dd runs before the steps: no idle gap between the last step and save 1.
        dd_bps = [dd_throughput(work, state_bytes)]
        step_s: list[float] = []
        step_call_s: list[float] = []
        for i in range(1, args.steps_before_save + 1):
            t0 = time.perf_counter()
            train_step()
            time.sleep(args.host_idle_s)
            t1 = time.perf_counter()
            tg.step(i)
            step_call_s.append(time.perf_counter() - t1)
            step_s.append(time.perf_counter() - t0)
        ready_at_first_save = tg.checkpoints.pool.ready()
        blocked: list[float] = []
        first_save_allocated = 0
        write_s: list[float] = []
        write_bps: list[float] = []
        first = args.steps_before_save
        for i in range(first, first + args.saves):
            t0 = time.perf_counter()
            assert tg.save(i)
            blocked.append(time.perf_counter() - t0)
            if i == first:
                first_save_allocated = tg.checkpoints.pool.allocated_bytes
            assert tg.checkpoints.writer.wait(600)
            (res,) = tg.checkpoints.writer.take_results()
            assert res.ok, res.reason
            m = read_manifest(Path(res.path))
            write_bytes = sum(int(f["size"]) for f in m.files.values())
            write_s.append(res.duration_s)
            write_bps.append(write_bytes / res.duration_s)
            dd_bps.append(dd_throughput(work, write_bytes))
        tg.close()
        ratios = [w / statistics.mean(dd_bps[i : i + 2]) for i, w in enumerate(write_bps)]
        warm_blocked = statistics.median(blocked[1:]) if len(blocked) > 1 else blocked[0]
        mib = 2**20
        print(json.dumps({
            "load_average_at_start": load_at_start,
            "background_prepare": "off" if args.no_prepare else args.prepare_priority,
            "host_idle_s_per_step": args.host_idle_s,
            "steps_before_first_save": args.steps_before_save,
            "train_step_s_each": [round(s, 3) for s in step_s],
            "trainguard_step_call_s_each": [round(s, 4) for s in step_call_s],
            "prepare_in_background_s": tg.checkpoints.pool.prepare_s,
            "prepared_mb": tg.checkpoints.pool.prepared_bytes / mib,
            "buffers_ready_at_first_save": ready_at_first_save,
            "first_save_allocated_mb": first_save_allocated / mib,
            "param_mb": param_bytes / mib,
            "state_mb": state_bytes / mib,
            "sync_torch_save_s": t_sync,
            "sync_torch_save_without_fsync_s": t_nofsync,
            "async_blocked_first_s": blocked[0],
            "async_blocked_warm_median_s": warm_blocked,
            "async_blocked_s_each": [round(b, 3) for b in blocked],
            "ratio_blocked_over_sync_warm": warm_blocked / t_sync,
            "ratio_blocked_over_sync_first": blocked[0] / t_sync,
            "async_write_s_each": [round(s, 3) for s in write_s],
            "checkpoint_write_mb_per_s_each": [round(b / mib) for b in write_bps],
            "dd_fsync_mb_per_s_each": [round(b / mib) for b in dd_bps],
            "ratio_write_over_dd_each": [round(r, 3) for r in ratios],
            "checkpoint_write_mb_per_s_median": statistics.median(write_bps) / mib,
            "dd_fsync_mb_per_s_median": statistics.median(dd_bps) / mib,
            "ratio_write_over_dd_median": statistics.median(ratios),
            "load_average_at_end": os.getloadavg(),
        }, indent=2))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)  # our own temp dir


if __name__ == "__main__":
    main()
