"""Soak: one long job on a local cluster, a fault at a fixed interval, the job's ETTR at the
end (not run in CI).

    .venv/bin/python bench/soak.py [--duration-s 1800] [--interval-s 300] [--in-process]

`--in-process`: the job is examples/trainer_ddp_rejoin.py with `recovery: {in_process: true}`
and every spare keeps a warm standby of it, so recoveries take the fast path (a killed rank's
healthy node joins the spares and keeps a standby in turn); each line says the path taken.

Faults rotate over the classes that leave the cluster able to take the next one: a rank
killed (`kill -9`, restarted on the same nodes) and, while a hot spare is free, a DBE on a
node of the job (drained, replaced by the spare). Prints one line per fault (detection,
MTTR, lost steps) and the controller's ETTR for the job (productive time / wall time since
the job first ran).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.devkit.devcluster import REPO_ROOT, ClusterConfig, DevCluster, restart_result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--interval-s", type=float, default=300.0)
    p.add_argument("--spares", type=int, default=2)
    p.add_argument("--step-time-s", type=float, default=0.2)
    p.add_argument("--in-process", action="store_true")
    args = p.parse_args(argv)
    steps = int(args.duration_s / args.step_time_s) * 4  # never finishes within the soak
    # the job's and its standbys' arguments alike (they checkpoint at the same steps)
    rejoin_args = ["--steps", str(steps), "--checkpoint-every", "20", "--step-time-s",
                   str(args.step_time_s), "--timeout-s", "10"]  # fmt: skip
    spares = tuple(f"spare-{i + 1}" for i in range(args.spares))
    config = ClusterConfig(
        spares=spares,
        safety={"drain_budget": 100, "breaker_threshold": 100},
        jobs={"checkpoint_timeout_s": 10, "stop_grace_s": 10, "stop_timeout_s": 10},
        standby=(
            {
                "enabled": True,
                "module": "trainer_ddp_rejoin",
                "cwd": str(REPO_ROOT / "examples"),
                "args": rejoin_args,
            }
            if args.in_process
            else {}
        ),
    )
    with (
        tempfile.TemporaryDirectory(prefix="tgsoak") as tmp,
        DevCluster(Path(tmp) / "cluster", config) as c,
    ):
        c.start()
        job = "soak"
        c.submit_job(
            {
                "name": job,
                "command": (
                    ["examples/trainer_ddp_rejoin.py", *rejoin_args] if args.in_process else
                    ["examples/train.py", "--steps", str(steps), "--checkpoint-every", "20",
                     "--step-time-s", str(args.step_time_s)]
                ),
                **({"recovery": {"in_process": True}} if args.in_process else {}),
                "nodes": ["node-1", "node-2", "node-3"],
                "ckpt_dir": str(c.run_dir / "ckpt"),
                "cwd": str(REPO_ROOT),
                "max_restarts": 1000,
            }
        )  # fmt: skip
        c.wait_job(job, lambda j: j["state"] == "running", timeout_s=120, what="the job to run")
        t_end = time.monotonic() + args.duration_s
        n = 0
        free = list(spares)
        while time.monotonic() + args.interval_s <= t_end:
            time.sleep(args.interval_s)  # the soak's own pacing, not a wait for a condition
            n += 1
            nodes = c.job(job)["nodes"]
            t_fault = time.time()
            # in process, killed ranks' nodes and repaired ones come back as spares
            workers = sorted(c.rank_procs(job), key=lambda r: r.node == nodes[0])
            if (n % 2 == 0 and (free or args.in_process)) or not workers:
                kind = "dbe"
                c.inject(nodes[1], "dbe", gpu=0)
                if free:
                    free.pop()
            else:
                kind = "kill_rank"
                # a torchrun worker off the job's first node if there is one (comparable
                # with the runs before in-process jobs used static rendezvous: under c10d,
                # that node's torchrun serves the store every torchrun polls); standbys that
                # joined the job are no torchrun workers
                os.kill(workers[0].pid, signal.SIGKILL)
            detail = c.wait(lambda t=t_fault: c.restarted_since(t), timeout_s=180, what="recovery")
            restarted_at, lost = restart_result(detail)
            restart = next(a for a in detail["actions"] if a["kind"] == "restart")
            result = restart["result"] or ""
            path = (
                "in_process" if result.startswith("recovered in process")
                else "fallback" if "fell back" in result else "full"
            )  # fmt: skip
            print(
                json.dumps(
                    {
                        "fault": n,
                        "kind": kind,
                        "rule": detail["incident"]["rule"],
                        "detect_s": round(detail["incident"]["opened_at"] - t_fault, 2),
                        "mttr_s": round(restarted_at - t_fault, 2),
                        "lost_steps": lost,
                        "path": path,
                        # why the fast path fell back (the restart step's result says it)
                        **({"result": result[:300]} if path == "fallback" else {}),
                    }
                ),
                flush=True,
            )
        c.wait(lambda: time.monotonic() >= t_end, timeout_s=args.interval_s + 5, what="the end")
        view = c.job(job)
        print(
            json.dumps(
                {
                    "faults": n,
                    "duration_s": args.duration_s,
                    "ettr": view.get("ettr"),
                    "restarts": view.get("restarts"),
                    "last_step": view.get("last_step"),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
