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
not ours). `--integration lightning` does the same for the Lightning callback's events per
step (on_train_batch_start, on_before_backward, on_train_batch_end with a ResumableSampler,
as examples/train_lightning.py has it; a stand-in for Lightning's Trainer), and
`--integration own` for the own-checkpointer API (`compute()` around the work, then
`step()`; no checkpoints). Each integration's cost is reported on the wall clock and as the
process's CPU time (on a shared machine the wall figure holds the waits for a CPU).
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
    """The matmul repetitions that take `step_ms` of this process's CPU time: on a shared
    machine the wall time of the same work grows with the waits for a CPU, its CPU time does
    not (so the step is as long whatever the load; its wall time is what the load makes it)."""
    a = torch.randn(256, 256)
    reps = 1
    while True:
        t0 = time.process_time()
        for _ in range(reps):
            a @ a
        dt = time.process_time() - t0
        if dt > 0.05:
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
    tmp, drain = _drain_socket("tgbh-")
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
    tally = _Tally()
    logs = {"loss": 2.5, "grad_norm": 1.0}
    for _ in range(steps):
        control = TrainerControl(should_log=True)
        t0 = _stamp()
        work(a, reps)
        t1 = _stamp()
        cb.on_step_begin(args, state, control)
        model(x)
        state.global_step += 1
        cb.on_step_end(args, state, control)
        cb.on_log(args, state, control, logs=logs)
        tally.add(t0, t0, t1, _stamp())
    sent = cb.channel.sent
    cb.on_train_end(args, state, TrainerControl())
    drain.kill()
    return tally.figures(sent)


def _drain_socket(prefix: str) -> tuple[Path, subprocess.Popen[bytes]]:
    """A temporary directory whose agent socket a separate process reads (the env points the
    library at it): the heartbeats cost what they cost against a live agent."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    sock = str(tmp / "hb.sock")
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, sock], stdout=subprocess.PIPE)
    assert drain.stdout is not None and drain.stdout.readline().strip() == b"ready"
    os.environ["TRAINGUARD_AGENT_SOCKET"] = sock
    os.environ["TRAINGUARD_CONTROL_DIR"] = str(tmp)
    return tmp, drain


Stamp = tuple[float, float]  # (wall, this process's CPU) in s


def _stamp() -> Stamp:
    return time.perf_counter(), time.process_time()


class _Tally:
    """Per step: the integration's own time (from t0 to t1 and from t2 to t3) and the work's
    (t1 to t2), each on the wall clock and as this process's CPU time: on a shared machine the
    wall figure also holds the waits for a CPU, the CPU figure does not."""

    def __init__(self) -> None:
        self.call_us: list[float] = []
        self.call_cpu_us: list[float] = []
        self.work_s: list[float] = []
        self.work_cpu_s: list[float] = []

    def add(self, t0: Stamp, t1: Stamp, t2: Stamp, t3: Stamp) -> None:
        self.call_us.append(((t1[0] - t0[0]) + (t3[0] - t2[0])) * 1e6)
        self.call_cpu_us.append(((t1[1] - t0[1]) + (t3[1] - t2[1])) * 1e6)
        self.work_s.append(t2[0] - t1[0])
        self.work_cpu_s.append(t2[1] - t1[1])

    def figures(self, sent: int) -> dict[str, float]:
        """The first step left out (imports)."""
        calls = sorted(self.call_us[1:])
        cpu = sorted(self.call_cpu_us[1:])
        work = statistics.median(self.work_s)
        work_cpu = statistics.median(self.work_cpu_s)
        return {
            "steps": len(self.call_us),
            "median_step_work_ms": work * 1e3,
            "median_step_work_cpu_ms": work_cpu * 1e3,
            "callback_per_step_median_us": statistics.median(calls),
            "callback_per_step_p99_us": calls[int(len(calls) * 0.99) - 1],
            "callback_share_of_median_step_pct": statistics.median(calls) / 1e4 / work,
            "callback_cpu_per_step_median_us": statistics.median(cpu),
            "callback_cpu_share_of_median_step_cpu_pct": statistics.median(cpu) / 1e4 / work_cpu,
            "heartbeats_sent": sent,
        }


def own_single(steps: int, step_ms: float) -> dict[str, float]:
    """The own-checkpointer API of one step (`compute()` around the work, then `step()`):
    its cost, and its share of a `step_ms` step."""
    from trainguard.trainer.integrations.own import OwnCheckpointer  # noqa: PLC0415

    torch.set_num_threads(1)
    _, drain = _drain_socket("tgbo-")
    model = torch.nn.Linear(8, 8)
    guard = OwnCheckpointer(
        save=lambda step: None, model=model, checkpoint_every=0, handle_sigterm=False
    )
    a, reps = calibrate(step_ms)
    tally = _Tally()
    loss = torch.tensor(2.5)
    for step in range(1, steps + 1):
        t0 = _stamp()
        with guard.compute():
            t1 = _stamp()
            work(a, reps)
            t2 = _stamp()
        guard.step(step, loss=loss, samples=32)
        tally.add(t0, t1, t2, _stamp())
    sent = guard.channel.sent
    guard.close()
    drain.kill()
    return tally.figures(sent)


def lightning_single(steps: int, step_ms: float) -> dict[str, float]:
    """The Lightning callback's events of one step: their cost, and its share of a `step_ms`
    step. The trainer is a stand-in with the attributes the callback reads (Lightning's own
    loop is not ours to count)."""
    from torch.utils.data import DistributedSampler, TensorDataset  # noqa: PLC0415

    from trainguard.trainer import ResumableSampler  # noqa: PLC0415
    from trainguard.trainer.integrations.lightning import TrainguardCallback  # noqa: PLC0415

    torch.set_num_threads(1)
    tmp, drain = _drain_socket("tgbl-")
    model = torch.nn.Linear(8, 8)
    data = TensorDataset(torch.zeros(64 * (steps + 1), 8))
    sampler = ResumableSampler(
        DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0), batch_size=32
    )
    cb = TrainguardCallback(ckpt_dir=tmp / "ck", sampler=sampler, handle_sigterm=False)
    trainer: Any = SimpleNamespace(is_global_zero=True, global_step=0, should_stop=False)
    module: Any = model
    cb.setup(trainer, module, "fit")
    cb.on_train_start(trainer, module)
    batch = (torch.zeros(32, 8),)
    outputs = {"loss": torch.tensor(2.5)}
    a, reps = calibrate(step_ms)
    tally = _Tally()
    for i in range(steps):
        t0 = _stamp()
        cb.on_train_batch_start(trainer, module, batch, i)
        t1 = _stamp()
        work(a, reps)
        t2 = _stamp()
        cb.on_before_backward(trainer, module, outputs["loss"])
        trainer.global_step += 1
        cb.on_train_batch_end(trainer, module, outputs, batch, i)
        tally.add(t0, t1, t2, _stamp())
    assert cb.guard is not None
    sent = cb.guard.channel.sent
    cb.on_train_end(trainer, module)
    cb.teardown(trainer, module, "fit")
    drain.kill()
    return tally.figures(sent)


INTEGRATIONS = {"hf": ("hf_callback", hf_single), "lightning": ("lightning_callback",
    lightning_single), "own": ("own_checkpointer", own_single)}  # fmt: skip


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
        choices=tuple(INTEGRATIONS),
        help="measure a framework integration's per-step cost instead (single process)",
    )
    args = p.parse_args()
    if args.integration is not None:
        name, measure = INTEGRATIONS[args.integration]
        print(json.dumps({name: measure(args.steps, args.step_ms)}, indent=2))
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
