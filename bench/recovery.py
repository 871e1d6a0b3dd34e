"""Recovery benchmark: each fault class N times on a local cluster of real processes
(controller, 3 active + 1 spare sim agents, examples/train.py under torchrun).

    .venv/bin/python bench/recovery.py [--runs 3] [--faults dbe,xid79,kill_rank,...]
    .venv/bin/python bench/recovery.py --backend slurm [--faults dbe,node_death]   (root)
    .venv/bin/python bench/recovery.py --job rejoin [--in-process] [--faults dbe,kill_rank]

`--job rejoin` runs examples/trainer_ddp_rejoin.py (a loop that can rejoin in process) instead
of examples/train.py; `--in-process` also gives it `recovery: {in_process: true}` and the
spare a warm standby of it (agents' `standby:`), so the restart step takes the fast path
(docs/controller.md "In-process recovery"); without it the same job takes the full restart.
Every run waits until the spare passed its warm preflight (and, in process, until its
standby is ready) before the fault: a spare is warm in steady state.

Per fault class: median and max of detection (fault -> incident opened), MTTR (fault ->
the restart step confirmed a step past the checkpoint) and lost steps (the controller's
figure: last step seen before the fault - restored checkpoint step). Each run uses a fresh
cluster, so runs do not share spares or drained nodes. `straggler` slows rank 1's compute
to twice the others' from the fault step on (`TRAINGUARD_CHAOS=slow=1.0@stepK:rank1`) and
runs the shipped rules, so its detection includes the rule's one-minute `for:`.

`--backend slurm` runs the same job as examples/slurm/train.sbatch on a real local Slurm
cluster (devkit/slurm.py: slurmd n1..n4, n4 the spare in the reservation; the controller's
Slurm backend) and also reports where the restart spends its time: requeue (requeuehold ->
Slurm no longer runs the job), allocation (release -> running) and launch (running -> a step
past the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.devkit.devcluster import REPO_ROOT, ClusterConfig, DevCluster, restart_result
from trainguard.devkit.slurm import SlurmSite, missing_reason

FAULTS = ("dbe", "xid79", "kill_rank", "node_death", "straggler")
SLURM_FAULTS = ("dbe", "node_death")
_PHASES = ("requeue", "allocation", "launch")
TRAIN = ["--steps", "400", "--checkpoint-every", "10", "--step-time-s", "0.2", "--seed", "0"]
# the rejoin job's; a standby runs the module with the same arguments (a rank checkpointing at
# other steps than its peers would meet them in mismatched collectives)
REJOIN = ["--steps", "400", "--checkpoint-every", "10", "--step-time-s", "0.2", "--timeout-s", "10"]


def inject(cluster: DevCluster, fault: str, job: str) -> None:
    if fault == "dbe":
        cluster.inject("node-2", "dbe", gpu=1)
    elif fault == "xid79":
        cluster.inject("node-2", "xid", gpu=0, code=79)
    elif fault == "kill_rank":
        # a rank off node-1, the runs measured before in-process jobs used static
        # rendezvous kept comparable (under c10d, node-1's torchrun serves the store every
        # torchrun polls: docs/controller.md "In-process recovery")
        rank = next(r.rank for r in cluster.rank_procs(job) if r.node != "node-1")
        cluster.signal_rank(job, rank, signal.SIGKILL)
    elif fault == "node_death":
        cluster.kill_node("node-2")
    elif fault == "straggler":
        pass  # the job's chaos slowdown began at the fault step
    else:
        raise ValueError(fault)


def spare_warm(cluster: DevCluster, *, standby: bool) -> dict[str, Any] | None:
    view = cluster.node("node-4")
    passed = (view.get("last_preflight") or {}).get("passed")
    ready = (view.get("standby") or {}).get("ready") or not standby
    return view if passed and ready else None


def one_run(
    fault: str, *, fault_step: int, root: Path, job_kind: str = "train", in_process: bool = False
) -> dict[str, Any]:
    standby = (
        {
            "enabled": True,
            "module": "trainer_ddp_rejoin",
            "cwd": str(REPO_ROOT / "examples"),
            "args": REJOIN,
        }
        if in_process
        else {}
    )
    config = ClusterConfig(
        safety={"drain_budget": 10},
        jobs={"checkpoint_timeout_s": 10, "stop_grace_s": 10, "stop_timeout_s": 10},
        standby=standby,
    )
    with DevCluster(root / f"{fault}-{time.monotonic_ns()}", config) as c:
        c.start()
        job = "bench"
        command = (
            ["examples/trainer_ddp_rejoin.py", *REJOIN]
            if job_kind == "rejoin"
            else ["examples/train.py", *TRAIN]
        )
        c.submit_job(
            {
                "name": job,
                "command": command,
                "nodes": ["node-1", "node-2", "node-3"],
                "ckpt_dir": str(c.run_dir / "ckpt"),
                "cwd": str(REPO_ROOT),
                "env": (
                    {"TRAINGUARD_CHAOS": f"slow=1.0@step{fault_step}:rank1"}
                    if fault == "straggler"
                    else {}
                ),
                **({"recovery": {"in_process": True}} if in_process else {}),
            }
        )
        c.wait_job(
            job,
            lambda j: j["state"] == "running" and (j.get("last_step") or 0) >= fault_step,
            timeout_s=120,
            what="the job to train",
        )
        c.wait(
            lambda: spare_warm(c, standby=in_process),
            timeout_s=120,
            what="the spare's warm preflight (and standby)",
        )
        t_fault = time.time()
        inject(c, fault, job)

        detail = c.wait(
            lambda: c.restarted_since(t_fault),
            timeout_s=150,
            what=f"{fault}: recovery",
            interval_s=0.2,
        )
        inc = detail["incident"]
        restarted_at, lost = restart_result(detail)
        incidents = [i for i in c.incidents() if i["opened_at"] >= t_fault - 1]
        restart = next(a for a in detail["actions"] if a["kind"] == "restart")
        result = restart["result"] or ""
        phases = dict(re.findall(r"(\w+) ([\d.]+) s\b", result))
        path = (
            "in_process"
            if result.startswith("recovered in process")
            else "fallback"
            if "fell back" in result
            else "full"
        )
        return {
            "fault": fault,
            "rule": inc["rule"],
            "incidents": len(incidents),
            "detect_s": inc["opened_at"] - t_fault,
            "mttr_s": restarted_at - t_fault,
            "lost_steps": lost,
            "path": path,
            **{f"{k}_s": float(v) for k, v in phases.items() if k not in ("mttr", "detect")},
        }


def one_slurm_run(fault: str, *, fault_step: int, root: Path) -> dict[str, Any]:
    jobs = {"checkpoint_timeout_s": 10}
    with SlurmSite(root / f"slurm-{fault}-{time.monotonic_ns()}", jobs=jobs) as site:
        site.start()
        c = site.cluster
        job_id, _ = site.submit("bench", TRAIN)
        c.wait_job(
            f"slurm-{job_id}",
            lambda j: j["state"] == "running" and (j.get("last_step") or 0) >= fault_step,
            timeout_s=120,
            what="the Slurm job to train",
        )
        t_fault = time.time()
        if fault == "dbe":
            c.inject("n2", "dbe", gpu=1)
        else:
            site.slurm.kill_node("n2")
            c.kill_agent("n2", signal.SIGKILL)
        detail = c.wait(
            lambda: c.restarted_since(t_fault),
            timeout_s=150,
            what=f"{fault}: recovery under Slurm",
            interval_s=0.2,
        )
        inc = detail["incident"]
        restarted_at, lost = restart_result(detail)
        restart = next(a for a in detail["actions"] if a["kind"] == "restart")
        phases = dict(re.findall(r"(\w+) ([\d.]+) s\b", restart["result"]))
        incidents = [i for i in c.incidents() if i["opened_at"] >= t_fault - 1]
        return {
            "fault": fault,
            "rule": inc["rule"],
            "incidents": len(incidents),
            "detect_s": inc["opened_at"] - t_fault,
            "mttr_s": restarted_at - t_fault,
            "lost_steps": lost,
            **{f"{k}_s": float(phases[k]) for k in _PHASES if k in phases},
        }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--backend", choices=("torchrun", "slurm"), default="torchrun")
    p.add_argument(
        "--faults", help=f"default: {','.join(FAULTS)} ({','.join(SLURM_FAULTS)} for slurm)"
    )
    p.add_argument("--fault-step", type=int, default=15)
    p.add_argument("--json", help="also write every run's figures here")
    p.add_argument("--job", choices=("train", "rejoin"), default="train",
                   help="examples/train.py, or examples/trainer_ddp_rejoin.py")  # fmt: skip
    p.add_argument("--in-process", action="store_true",
                   help="the rejoin job with recovery.in_process and a warm standby")  # fmt: skip
    args = p.parse_args(argv)
    if args.in_process:
        args.job = "rejoin"
    if args.job == "rejoin" and args.backend == "slurm":
        p.error("--job rejoin / --in-process: the torchrun backend only")
    known = SLURM_FAULTS if args.backend == "slurm" else FAULTS
    faults = [f for f in (args.faults or ",".join(known)).split(",") if f]
    unknown = set(faults) - set(known)
    if unknown:
        p.error(f"unknown fault(s) {sorted(unknown)}; known: {', '.join(known)}")
    if args.backend == "slurm" and (why := missing_reason()) is not None:
        p.error(why)

    def run_one(fault: str, *, fault_step: int, root: Path) -> dict[str, Any]:
        if args.backend == "slurm":
            return one_slurm_run(fault, fault_step=fault_step, root=root)
        return one_run(
            fault, fault_step=fault_step, root=root, job_kind=args.job, in_process=args.in_process
        )

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tgbench") as tmp:
        for fault in faults:
            for i in range(args.runs):
                r = run_one(fault, fault_step=args.fault_step, root=Path(tmp))
                runs.append(r)
                print(json.dumps({"run": i + 1, **r}), flush=True)
    print("\n| fault | rule | runs | detect median / max (s) | MTTR median / max (s) |"
          " lost steps median / max | incidents per fault |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for fault in faults:
        rs = [r for r in runs if r["fault"] == fault]
        det = [r["detect_s"] for r in rs]
        mttr = [r["mttr_s"] for r in rs]
        lost = [r["lost_steps"] for r in rs if r["lost_steps"] is not None]
        rules = ", ".join(sorted({r["rule"] for r in rs}))
        lost_text = f"{statistics.median(lost):g} / {max(lost)}" if lost else "n/a"
        print(
            f"| {fault} | {rules} | {len(rs)} | {statistics.median(det):.1f} / {max(det):.1f} |"
            f" {statistics.median(mttr):.1f} / {max(mttr):.1f} | {lost_text} |"
            f" {max(r['incidents'] for r in rs)} |"
        )
    if args.backend == "slurm":
        print("\n| fault | requeue median / max (s) | allocation median / max (s) |"
              " launch median / max (s) |")  # fmt: skip
        print("|---|---|---|---|")
        for fault in faults:
            rs = [r for r in runs if r["fault"] == fault]
            cells = []
            for k in _PHASES:
                vals = [r[f"{k}_s"] for r in rs if f"{k}_s" in r]
                cells.append(f"{statistics.median(vals):.1f} / {max(vals):.1f}" if vals else "n/a")
            print(f"| {fault} | " + " | ".join(cells) + " |")
    if args.backend == "torchrun":
        # where the time goes: the restart step's phases (docs/controller.md, "Actions")
        keys = ("detect", "checkpoint", "drain", "restart")
        print("\n| fault | path (runs) | " + " | ".join(f"{k} median (s)" for k in keys) + " |")
        print("|---|---|" + "---|" * len(keys))
        for fault in faults:
            rs = [r for r in runs if r["fault"] == fault]
            paths = ", ".join(
                f"{p} ({sum(r['path'] == p for r in rs)})" for p in sorted({r["path"] for r in rs})
            )
            cells = []
            for k in keys:
                vals = [r[f"{k}_s"] for r in rs if f"{k}_s" in r]
                cells.append(f"{statistics.median(vals):.1f}" if vals else "n/a")
            print(f"| {fault} | {paths} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
