"""The collective check's worker: an all-reduce among the node's GPUs (NCCL, one process per
GPU) or, as a stand-in on CPU, among two local processes (gloo), timed like nccl-tests.

It runs as a child process of the agent (`python -m trainguard.agent.allreduce '<json>'`, one
JSON line out): torch and the process group never live in the agent, and a hung collective
ends when the preflight kills the child's process group. Bus bandwidth is nccl-tests'
`busbw = bytes / time * 2 (n - 1) / n`, comparable across world sizes; every all-reduce's
result is checked too (rank r contributes r + 1, so each element must be n (n + 1) / 2).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.clock import SYSTEM_CLOCK

# Message size: 256 MiB per GPU reaches NVLink's plateau; 8 MiB on the CPU stand-in.
CUDA_BYTES = 256 * 1024**2
CPU_BYTES = 8 * 1024**2
CPU_WORLD = 2
WARMUP = 2
# Timed all-reduces at most (as many as fill `seconds`, by one timed first).
MAX_ITERATIONS = 50


def _rank(rank: int, world: int, port: int, spec: dict[str, Any], out: str) -> None:
    import torch  # noqa: PLC0415 - heavy: only this child process loads torch
    import torch.distributed as dist  # noqa: PLC0415

    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend="nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    try:
        nbytes = int(spec.get("bytes") or (CUDA_BYTES if cuda else CPU_BYTES))
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        x = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
        expected = world * (world + 1) / 2

        def once() -> bool:
            x.fill_(rank + 1)
            dist.all_reduce(x)
            return bool(torch.all(x == expected).item())

        for _ in range(WARMUP):
            once()
        if cuda:
            torch.cuda.synchronize()
        # every rank must run the same number of all-reduces: rank 0 times one and sends the
        # count that fills `seconds` (a rank stopping on its own clock would leave a peer hung)
        clock = SYSTEM_CLOCK
        probe_start = clock.monotonic()
        once()
        if cuda:
            torch.cuda.synchronize()
        per_s = max(clock.monotonic() - probe_start, 1e-6)
        count = torch.tensor([min(MAX_ITERATIONS, max(1, int(float(spec["seconds"]) / per_s)))])
        if cuda:
            count = count.to(device)
        dist.broadcast(count, src=0)
        iterations = int(count.item())
        dist.barrier()
        start = clock.monotonic()
        wrong = 0
        # the fill and the check are in every timed iteration; both are O(bytes) on the
        # device, small beside the collective's own traffic
        for _ in range(iterations):
            if not once():
                wrong += 1
        if cuda:
            torch.cuda.synchronize()
        elapsed = clock.monotonic() - start
        if rank == 0:
            algbw = nbytes * iterations / max(elapsed, 1e-9) / 1e9
            result = {
                "backend": "nccl" if cuda else "gloo",
                "world": world,
                "bytes": nbytes,
                "iterations": iterations,
                "wrong": wrong,
                "seconds": round(elapsed, 6),
                "busbw_gbps": algbw * 2 * (world - 1) / world,
            }
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: Sequence[str]) -> int:
    """`python -m trainguard.agent.allreduce '{"device": "cuda"|"cpu", "world": n,
    "seconds": s}'`: prints rank 0's figures as one JSON line."""
    import torch.multiprocessing as mp  # noqa: PLC0415 - heavy: only in this child process

    spec = json.loads(argv[0])
    world = int(spec.get("world") or CPU_WORLD)
    with tempfile.TemporaryDirectory(prefix="trainguard-allreduce-") as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(
            _rank, args=(world, _free_port(), spec, out), nprocs=world, start_method="spawn"
        )
        print(Path(out).read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
