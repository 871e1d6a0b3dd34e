"""Resume time at another world size: a checkpoint written by 3 ranks, resumed on 2, 3 and 4.

Each phase runs under torchrun (gloo, CPU, one thread per rank): DDP over a stack of
`--layers` Linear(`--width`, `--width`) layers with AdamW (parameters + two moments), a
ResumableSampler. The write phase trains two steps and commits one checkpoint; every resume
phase builds the job fresh and times `Trainguard.resume()` on each rank (rank 0 verifies the
checksums, then every rank loads: DCP reads and reshards the tensors, per-rank state follows).
The figure is the slowest rank's, the median of `--repeats` launches per world size.

    .venv/bin/python bench/trainer_reshard.py [--width 1024] [--layers 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.trainer import ResumableSampler, Trainguard


def worker(phase: str, ckpt_dir: Path, width: int, layers: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    model = DistributedDataParallel(
        torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ds = TensorDataset(torch.randn(96, width))
    sampler = ResumableSampler(
        DistributedSampler(ds, num_replicas=world, rank=rank, seed=0), batch_size=4
    )
    loader = DataLoader(ds, batch_size=4, sampler=sampler, drop_last=True)
    tg = Trainguard(
        model=model, optimizer=opt, sampler=sampler, ckpt_dir=ckpt_dir, handle_sigterm=False
    )
    if phase == "write":
        batches = sampler.batches(loader)
        for step in (1, 2):
            (x,) = next(batches)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            tg.step(step, loss=0.0)
        assert tg.save(2, wait=True)
    else:
        dist.barrier()
        t0 = time.perf_counter()
        start = tg.resume()
        took = time.perf_counter() - t0
        assert start == 3
        times = [0.0] * world
        dist.all_gather_object(times, took)
        if rank == 0:
            print(json.dumps({"world_size": world, "resume_s": times}))
    tg.close()
    dist.destroy_process_group()


def launch(nproc: int, phase: str, ckpt_dir: Path, width: int, layers: int) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
         "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", __file__, "--worker", phase,
         "--ckpt-dir", str(ckpt_dir), "--width", str(width), "--layers", str(layers)],
        env={**os.environ, "OMP_NUM_THREADS": "1",
             "TRAINGUARD_AGENT_SOCKET": str(ckpt_dir.parent / "absent.sock")},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"torchrun {phase} on {nproc} ranks failed:\n{out.stderr[-5000:]}")
    return out.stdout


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", choices=["write", "resume"], help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.ckpt_dir, args.width, args.layers)
        return
    tmp = Path(tempfile.mkdtemp(prefix="tgreshard-"))
    try:
        ckpt = tmp / "ck"
        launch(3, "write", ckpt, args.width, args.layers)
        state_bytes = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        result: dict[str, object] = {
            "checkpoint_bytes": state_bytes,
            "written_by_ranks": 3,
        }
        for world in (2, 3, 4):  # 3: the same world size, for comparison
            slowest = []
            for _ in range(args.repeats):
                line = [
                    ln
                    for ln in launch(world, "resume", ckpt, args.width, args.layers).splitlines()
                    if ln.startswith("{")
                ][-1]
                slowest.append(max(json.loads(line)["resume_s"]))
            result[f"resume_on_{world}_ranks_s"] = {
                "median": statistics.median(slowest),
                "runs": slowest,
            }
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
