"""Checkpoint cost: how long the loop is blocked by an async save vs. a synchronous torch.save,
and the background writer's throughput vs. raw disk throughput (dd with fsync), same run.

The state is a few hundred MB of parameters plus Adam's two moments (~3x in total). The async
figure is the time `Trainguard.save()` takes to return (snapshot into host buffers); the
first save also allocates those buffers, later ones reuse them, so both are reported. The
write throughput is checkpoint bytes on disk / the writer's wall time (write + fsync + sha256
+ manifest + rename).

    .venv/bin/python bench/checkpoint.py [--dir /path/on/target/disk] [--layers 5]
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

from agent.trainer import Trainguard
from agent.trainer.manifest import read_manifest


def dd_throughput(directory: Path, size_mb: int) -> float:
    target = directory / "dd.bin"
    cmd = ["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={size_mb}", "conv=fsync"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    dt = time.perf_counter() - t0
    target.unlink()
    return size_mb * 1024 * 1024 / dt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", help="directory on the disk to measure (default: a temp dir)")
    p.add_argument("--layers", type=int, default=5, help="4096x4096 linear layers (67 MB each)")
    p.add_argument("--saves", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(2)
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="tgck-"))
    base.mkdir(parents=True, exist_ok=True)
    work = base / f"bench-{os.getpid()}"
    work.mkdir()
    os.environ.setdefault("TRAINGUARD_AGENT_SOCKET", str(work / "absent.sock"))
    try:
        model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(args.layers)])
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        model(torch.randn(4, 4096)).sum().backward()
        opt.step()  # populates Adam's exp_avg / exp_avg_sq
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

        dd_before = dd_throughput(work, state_bytes // (1024 * 1024))

        tg = Trainguard(
            model=model,
            optimizer=opt,
            ckpt_dir=work / "ckpt",
            checkpoint_every=0,
            keep_last=1,
            handle_sigterm=False,
        )
        blocked: list[float] = []
        write_s: list[float] = []
        write_bytes = 0
        for i in range(1, args.saves + 1):
            t0 = time.perf_counter()
            assert tg.save(i)
            blocked.append(time.perf_counter() - t0)
            assert tg.writer.wait(600)
            (res,) = tg.writer.take_results()
            assert res.ok, res.reason
            write_s.append(res.duration_s)
            m = read_manifest(Path(res.path))
            write_bytes = sum(int(f["size"]) for f in m.files.values())
        tg.close()
        dd_after = dd_throughput(work, state_bytes // (1024 * 1024))
        dd_bps = statistics.mean([dd_before, dd_after])
        warm_blocked = statistics.median(blocked[1:]) if len(blocked) > 1 else blocked[0]
        write_bps = write_bytes / statistics.median(write_s)
        print(json.dumps({
            "param_mb": param_bytes / 2**20,
            "state_mb": state_bytes / 2**20,
            "sync_torch_save_s": t_sync,
            "sync_torch_save_without_fsync_s": t_nofsync,
            "async_blocked_first_s": blocked[0],
            "async_blocked_warm_median_s": warm_blocked,
            "ratio_blocked_over_sync_warm": warm_blocked / t_sync,
            "ratio_blocked_over_sync_first": blocked[0] / t_sync,
            "async_write_s_each": write_s,
            "checkpoint_write_mb_per_s": write_bps / 2**20,
            "dd_fsync_mb_per_s_before_after": [dd_before / 2**20, dd_after / 2**20],
            "ratio_write_over_dd": write_bps / dd_bps,
        }, indent=2))  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
