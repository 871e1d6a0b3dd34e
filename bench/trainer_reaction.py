"""Trainer reaction time: how soon every rank acts on an event that reached one rank only.

The trainer promises (docs/trainer.md "Agreement") that a stop request, a checkpoint request,
a SIGTERM and a NaN loss are acted on by every rank at the same step, within max(2 steps, 1 s)
of their arrival. This runs 3 gloo ranks on CPU under `torchrun --standalone` (DDP, a sleep
standing in for each step's compute) and, on one rank at a known step() call, injects:

- `stop` / `checkpoint`: a Control datagram to that rank's own control socket,
- `sigterm`: SIGTERM to that rank's process,
- `nan`: a NaN loss passed to that rank's next step().

The event arrives after call N, so call N+1 is the first step() that can see it. Every rank
logs each call (step, time entering and leaving step(), the returned action). Per event:

- reaction in steps: K, where call N+K is the one at which the ranks act (1 = at once);
- reaction in seconds: from the arrival (the injection; for a NaN, the entry into the
  step() call that received it) to the last rank's return from the acting step() call, so it
  includes that call's own work (the requested or emergency checkpoint's blocking part);
- whether all ranks acted at the same call and step.

Stop and SIGTERM end the job, so each of their trials is one torchrun; the checkpoint and NaN
trials of one step time share one torchrun, spaced beyond the bound. Injection calls and the
injecting rank vary between trials, so events land at different points of the agreement
schedule.

    .venv/bin/python bench/trainer_reaction.py [--step-ms 50] [--trials 5]
    .venv/bin/python bench/trainer_reaction.py --step-ms 10,50,200 --trials 3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from trainguard.protocol import Control, encode_json
from trainguard.trainer import Trainguard

WORLD = 3
KINDS = ("stop", "checkpoint", "sigterm", "nan")


def worker(*, out: Path, step_s: float, plan_spec: str, max_calls: int) -> None:
    """One rank: train with DDP, inject the planned events, log every step() call."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    plan: dict[int, str] = {}
    for entry in plan_spec.split(","):
        what, where = entry.split("@")
        at_call, on_rank = where.split(":")
        if int(on_rank) == rank:
            plan[int(at_call)] = what
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tg = Trainguard(
        model=model,
        optimizer=opt,
        ckpt_dir=out / "ck",
        checkpoint_every=0,
        nan_policy="rollback",
        sigterm_hard_exit=False,
        job="reaction",
    )
    # No periodic checkpoints: each NaN trial follows a requested checkpoint to roll back to.
    step = tg.resume(first_step=1)
    log = open(out / f"rank{rank}.jsonl", "w")
    nan_next = False
    for call in range(1, max_calls + 1):
        time.sleep(step_s)  # the rank's compute
        x = torch.randn(8, 4)
        loss = F.mse_loss(model(x), torch.zeros(8, 2))
        opt.zero_grad()
        loss.backward()  # DDP's gradient all_reduce: the ranks leave the step together
        opt.step()
        reported = math.nan if nan_next else loss.item()
        nan_next = False
        t_enter = time.monotonic()
        action = tg.step(step, loss=reported)
        t_return = time.monotonic()
        rec: dict[str, Any] = {
            "call": call,
            "step": step,
            "t_enter": t_enter,
            "t_return": t_return,
            "stop": action.stop,
            "reason": action.reason,
            "rollback": action.rollback,
            "checkpoint_started": action.checkpoint_started,
            "request_id": action.request_id,
        }
        kind = plan.get(call)
        if kind is not None and not action.stop:
            rec["inject"] = kind
            rec["t_inject"] = time.monotonic()
            if kind in ("checkpoint", "stop"):
                assert tg.channel.control_socket is not None
                with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                    s.sendto(
                        encode_json(
                            Control(
                                action="stop" if kind == "stop" else "checkpoint",
                                request_id=f"{kind}-{call}",
                                job="reaction",
                            )
                        ),
                        tg.channel.control_socket,
                    )
            elif kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif kind == "nan":
                nan_next = True
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if action.stop:
            break
        if action.rollback:
            assert action.next_step is not None
            step = action.next_step
        else:
            step += 1
    tg.close()
    log.close()
    dist.destroy_process_group()


def acted(records: list[dict[str, Any]], after_call: int, kind: str) -> dict[str, Any] | None:
    """The first call after `after_call` at which this rank acted on an event of `kind`."""
    for rec in records:
        if rec["call"] <= after_call:
            continue
        if (
            (kind == "nan" and rec["rollback"])
            or (kind == "checkpoint" and rec["checkpoint_started"] and rec["request_id"])
            or (kind in ("stop", "sigterm") and rec["stop"] and rec["reason"] == kind)
        ):
            return rec
    return None


def launch(*, tmp: Path, step_s: float, plan: str, max_calls: int) -> list[list[dict[str, Any]]]:
    out = tmp / f"run-{time.monotonic_ns()}"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(WORLD), __file__, "--worker", "--out", str(out),
         "--step-s", str(step_s), "--plan", plan, "--max-calls", str(max_calls)],
        env={**os.environ, "OMP_NUM_THREADS": "1", "TRAINGUARD_CHAOS": "",
             "TRAINGUARD_AGENT_SOCKET": str(out / "absent.sock")},
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-5000:]}")
    return [
        [json.loads(ln) for ln in (out / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(WORLD)
    ]


def measure(per_rank: list[list[dict[str, Any]]], *, call: int, rank: int) -> dict[str, Any]:
    """One event injected after `call` on `rank`: its reaction, from every rank's log."""
    injected = next(r for r in per_rank[rank] if r["call"] == call)
    kind = injected["inject"]
    if kind == "nan":
        t_arrival = next(r for r in per_rank[rank] if r["call"] == call + 1)["t_enter"]
    else:
        t_arrival = injected["t_inject"]
    got = [acted(records, call, kind) for records in per_rank]
    if any(g is None for g in got):
        return {"kind": kind, "acted": False}
    hits = [g for g in got if g is not None]
    return {
        "kind": kind,
        "acted": True,
        "same_step": len({(g["call"], g["step"]) for g in hits}) == 1,
        "steps": max(g["call"] for g in hits) - call,
        "seconds": max(g["t_return"] for g in hits) - t_arrival,
        "acting_call_s": max(g["t_return"] - g["t_enter"] for g in hits),
    }


def bench_step_time(*, tmp: Path, step_ms: float, trials: int) -> list[dict[str, Any]]:
    step_s = step_ms / 1000
    # The agreement interval is capped at max(1, floor(0.8 x 0.5 s / step)) steps and an event
    # waits at most two intervals: space events well beyond that.
    bound_calls = 2 * max(1, math.floor(0.4 / step_s))
    spacing = bound_calls + 8
    first = max(20, bound_calls + 5)  # past the start, where the interval settles
    results: list[dict[str, Any]] = []
    # Checkpoint and NaN trials, alternating, in one job.
    events: list[tuple[str, int, int]] = []
    call = first
    for i in range(trials):
        for kind in ("checkpoint", "nan"):
            events.append((kind, call + (i % 3), (len(events) % (WORLD - 1)) + 1))
            call += spacing
    plan = ",".join(f"{k}@{c}:{r}" for k, c, r in events)
    per_rank = launch(tmp=tmp, step_s=step_s, plan=plan, max_calls=call + spacing)
    results += [measure(per_rank, call=c, rank=r) for _, c, r in events]
    # Stop and SIGTERM end the job: one job per trial.
    for kind in ("stop", "sigterm"):
        for i in range(trials):
            c, r = first + i, i % WORLD
            per_rank = launch(tmp=tmp, step_s=step_s, plan=f"{kind}@{c}:{r}", max_calls=c + spacing)
            results.append(measure(per_rank, call=c, rank=r))
    for res in results:
        res["step_ms"] = step_ms
    return results


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| step | event | trials | steps median / max | seconds median / max "
        "| acting call median | all ranks same step | within max(2 steps, 1 s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for step_ms in sorted({r["step_ms"] for r in results}):
        for kind in KINDS:
            rs = [r for r in results if r["step_ms"] == step_ms and r["kind"] == kind]
            if not rs:
                continue
            ok = [r for r in rs if r["acted"]]
            if not ok:
                lines.append(f"| {step_ms:g} ms | {kind} | {len(rs)} | not acted on | | | | |")
                continue
            steps = [r["steps"] for r in ok]
            secs = [r["seconds"] for r in ok]
            within = sum(1 for r in ok if r["steps"] <= 2 or r["seconds"] <= 1.0)
            lines.append(
                f"| {step_ms:g} ms | {kind} | {len(rs)} "
                f"| {statistics.median(steps):g} / {max(steps)} "
                f"| {statistics.median(secs):.2f} / {max(secs):.2f} s "
                f"| {statistics.median(r['acting_call_s'] for r in ok) * 1000:.0f} ms "
                f"| {sum(r['same_step'] for r in ok)}/{len(rs)} "
                f"| {within}/{len(rs)} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--step-ms", default="50", help="comma-separated step times, ms")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--json", type=Path, help="also write every trial's figures here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--step-s", type=float, help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--max-calls", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(out=args.out, step_s=args.step_s, plan_spec=args.plan, max_calls=args.max_calls)
        return
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tgreact-") as tmp:
        for step_ms in (float(s) for s in args.step_ms.split(",")):
            results += bench_step_time(tmp=Path(tmp), step_ms=step_ms, trials=args.trials)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"\n{WORLD} ranks, {args.trials} trials per event; {time.monotonic() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
