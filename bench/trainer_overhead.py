"""Trainer library overhead per step: the same ~50 ms loop with and without Trainguard.

Single process: the loop's compute is a fixed matmul workload calibrated to ~50 ms; with the
library, every step sends a heartbeat to a live agent socket (read by a separate process),
polls the control socket and runs the agreement (no checkpoints). Blocks of steps alternate
between the two variants so drift on a shared machine hits both alike.

    .venv/bin/python bench/trainer_overhead.py [--steps 200] [--step-ms 50]

With --ranks 3 it also runs the loop under torchrun (gloo, CPU) and reports the cost of the
`tg.step()` call itself on rank 0 (median, mean and p90 after the first call), which includes
the agreement between ranks (ranks are aligned by a barrier first, as a data-parallel step's
gradient all_reduce would). `--skip-single` runs only that part.

`--integration hf` measures instead the HF Trainer callback's own events per step
(on_step_begin, a forward pass under its hooks, on_step_end, on_log) in one process, against
the same calibrated work, with real TrainerState/TrainerControl (no Trainer: its own cost is
not ours).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from trainguard.trainer import Trainguard

DRAIN = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
print("ready", flush=True)
n = 0
while True:
    s.recv(65536)
"""


def calibrate(step_ms: float) -> tuple[torch.Tensor, int]:
    a = torch.randn(256, 256)
    reps = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ a
        dt = time.perf_counter() - t0
        if dt > 0.01:
            break
        reps *= 2
    return a, max(1, int(reps * (step_ms / 1000) / dt))


def work(a: torch.Tensor, reps: int) -> None:
    for _ in range(reps):
        a @ a


def single(steps: int, step_ms: float, block: int) -> dict[str, float]:
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="tgb-"))
    sock = str(tmp / "hb.sock")
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, sock], stdout=subprocess.PIPE)
    assert drain.stdout is not None and drain.stdout.readline().strip() == b"ready"
    os.environ["TRAINGUARD_AGENT_SOCKET"] = sock
    os.environ["TRAINGUARD_CONTROL_DIR"] = str(tmp)
    model = torch.nn.Linear(8, 8)
    tg = Trainguard(model=model, ckpt_dir=tmp / "ck", checkpoint_every=0, handle_sigterm=False)
    a, reps = calibrate(step_ms)
    without: list[float] = []
    with_tg: list[float] = []
    call_us: list[float] = []
    step = 0
    loss = torch.tensor(2.5)
    while len(with_tg) < steps:
        for _ in range(block):
            t0 = time.perf_counter()
            work(a, reps)
            without.append(time.perf_counter() - t0)
        for _ in range(block):
            step += 1
            t0 = time.perf_counter()
            work(a, reps)
            t1 = time.perf_counter()
            tg.step(step, loss=loss, samples=32, tokens=32 * 512)
            t2 = time.perf_counter()
            with_tg.append(t2 - t0)
            call_us.append((t2 - t1) * 1e6)
    sent = tg.channel.sent
    tg.close()
    drain.kill()
    med_without = statistics.median(without)
    med_with = statistics.median(with_tg)
    call_us.sort()
    return {
        "steps_each": len(with_tg),
        "median_step_without_ms": med_without * 1e3,
        "median_step_with_ms": med_with * 1e3,
        "ratio_with_over_without": med_with / med_without,
        "tg_step_call_median_us": statistics.median(call_us),
        "tg_step_call_p99_us": call_us[int(len(call_us) * 0.99) - 1],
        "tg_step_call_share_of_median_step_pct": statistics.median(call_us) / 1e4 / med_without,
        "heartbeats_sent": sent,
    }


def hf_single(steps: int, step_ms: float) -> dict[str, float]:
    """The HF callback's events of one step: their cost, and its share of a `step_ms` step."""
    # deferred: transformers is heavy, and only this measurement needs it
    from transformers import TrainerControl, TrainerState  # noqa: PLC0415

    from trainguard.trainer.integrations.hf import TrainguardCallback  # noqa: PLC0415

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="tgbh-"))
    sock = str(tmp / "hb.sock")
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, sock], stdout=subprocess.PIPE)
    assert drain.stdout is not None and drain.stdout.readline().strip() == b"ready"
    os.environ["TRAINGUARD_AGENT_SOCKET"] = sock
    os.environ["TRAINGUARD_CONTROL_DIR"] = str(tmp)
    model = torch.nn.Linear(8, 8)
    x = torch.zeros(1, 8)
    args: Any = SimpleNamespace(
        output_dir=str(tmp / "out"),
        save_steps=0,
        save_strategy="no",
        per_device_train_batch_size=32,
        gradient_accumulation_steps=1,
    )
    state = TrainerState()
    cb = TrainguardCallback(handle_sigterm=False)
    cb.on_train_begin(args, state, TrainerControl(), model=model)
    a, reps = calibrate(step_ms)
    call_us: list[float] = []
    work_s: list[float] = []
    logs = {"loss": 2.5, "grad_norm": 1.0}
    for _ in range(steps):
        control = TrainerControl(should_log=True)
        t0 = time.perf_counter()
        work(a, reps)
        t1 = time.perf_counter()
        cb.on_step_begin(args, state, control)
        model(x)
        state.global_step += 1
        cb.on_step_end(args, state, control)
        cb.on_log(args, state, control, logs=logs)
        t2 = time.perf_counter()
        work_s.append(t1 - t0)
        call_us.append((t2 - t1) * 1e6)
    sent = cb.channel.sent
    cb.on_train_end(args, state, TrainerControl())
    drain.kill()
    call_us = sorted(call_us[1:])
    return {
        "steps": steps,
        "median_step_work_ms": statistics.median(work_s) * 1e3,
        "callback_per_step_median_us": statistics.median(call_us),
        "callback_per_step_p99_us": call_us[int(len(call_us) * 0.99) - 1],
        "callback_share_of_median_step_pct": statistics.median(call_us)
        / 1e4
        / statistics.median(work_s),
        "heartbeats_sent": sent,
    }


def dist_worker(steps: int, step_ms: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    tmp = Path(os.environ["BENCH_TMP"])
    tg = Trainguard(
        model=torch.nn.Linear(8, 8), ckpt_dir=tmp / "ck", checkpoint_every=0, handle_sigterm=False
    )
    call_us: list[float] = []
    for step in range(1, steps + 1):
        time.sleep(step_ms / 1000)
        # A real data-parallel step ends in-sync (gradient all_reduce); the barrier stands in
        # for it so the figure is the library's own cost, not the ranks' sleep jitter.
        dist.barrier()
        t0 = time.perf_counter()
        tg.step(step, loss=1.0)
        call_us.append((time.perf_counter() - t0) * 1e6)
    tg.close()
    if dist.get_rank() == 0:
        # The first call also imports the checkpoint machinery for the snapshot buffers
        # (seconds on a loaded machine, once): the per-step figures leave it out.
        call_us = sorted(call_us[1:])
        print(
            json.dumps(
                {
                    "ranks": dist.get_world_size(),
                    "tg_step_call_median_us": statistics.median(call_us),
                    "tg_step_call_mean_us": statistics.fmean(call_us),
                    "tg_step_call_p90_us": call_us[int(len(call_us) * 0.9) - 1],
                    "tg_step_call_mean_share_of_step_pct": statistics.fmean(call_us) / 10 / step_ms,
                }
            )
        )
    dist.destroy_process_group()


def distributed(ranks: int, steps: int, step_ms: float) -> dict[str, float]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="tgbd-")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
         "--nproc-per-node", str(ranks), "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", __file__, "--dist-worker",
         "--steps", str(steps), "--step-ms", str(step_ms)],
        env={**os.environ, "BENCH_TMP": tmp, "OMP_NUM_THREADS": "1",
             "TRAINGUARD_AGENT_SOCKET": os.path.join(tmp, "absent.sock")},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(f"torchrun failed ({out.returncode}):\n{out.stderr[-5000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1]
    return dict(json.loads(line))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--ranks", type=int, default=3, help="0 to skip the torchrun measurement")
    p.add_argument("--skip-single", action="store_true", help="only the torchrun measurement")
    p.add_argument("--dist-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--integration",
        choices=("hf",),
        help="measure a framework integration's callback instead (single process)",
    )
    args = p.parse_args()
    if args.integration == "hf":
        print(json.dumps({"hf_callback": hf_single(args.steps, args.step_ms)}, indent=2))
        return
    if args.dist_worker:
        dist_worker(args.steps, args.step_ms)
        return
    result: dict[str, object] = {}
    if not args.skip_single:
        result["single_process"] = single(args.steps, args.step_ms, args.block)
    if args.ranks > 1:
        result["torchrun"] = distributed(args.ranks, args.steps, args.step_ms)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
