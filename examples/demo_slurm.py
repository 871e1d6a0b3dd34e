"""`make demo-slurm`: a job under real Slurm survives an uncorrectable ECC error, end to end.

A Slurm cluster on this machine (munged, slurmctld, slurmd n1..n4; n4 a hot spare held in the
`trainguard_spares` reservation), a sim agent per node, the trainguard controller with its
Slurm backend, and examples/slurm/train.sbatch submitted with sbatch on n1..n3 as the
unprivileged `trainguard-user` (created when missing), so its ranks are watched as an ordinary
user's are; in parallel
the same training uninterrupted (`torchrun --standalone`) as the reference. After some steps
a DBE is injected into a GPU of n2: trainguard asks for a proactive checkpoint, drains n2 in
Slurm (`sinfo -R` shows its reason), takes n4 out of the reservation and requeues the job
onto n1, n3, n4. The demo prints the timeline (seconds since the fault), compares every
logged loss with the reference bitwise, and writes `demo-slurm-report.json`.

Needs root (slurmd); installs the Debian packages it needs (slurmctld slurmd slurm-client
munge) when they are missing. Exit code 0 only if the job recovered and every loss matched;
1 otherwise; 130 when interrupted. Every daemon and process it started is ended either way.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the timeline printer and signal handling of the torchrun demo (examples/demo.py, beside this)
from demo import Printer as DemoPrinter
from demo import _interrupt

from trainguard.devkit.devcluster import REPO_ROOT, ClusterError, compare_losses, read_step_lines
from trainguard.devkit.slurm import SlurmSite, attempt_lines, install_packages, missing_reason

TRAIN_ARGS = ["--steps", "60", "--checkpoint-every", "10", "--step-time-s", "0.2", "--seed", "0"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="demo-slurm-run", help="configs, logs, checkpoints")
    p.add_argument("--report", default="demo-slurm-report.json")
    p.add_argument("--fault-step", type=int, default=20, help="inject the DBE after this step")
    p.add_argument("--fault-node", default="n2")
    p.add_argument("--fault-gpu", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=300.0, help="give up after this long")
    return p.parse_args(argv)


class Printer(DemoPrinter):
    """The demo's timeline printer; a Slurm restart shows its requeue and release."""

    def restart_text(self, msg: str) -> str | None:
        return msg.split(": ", 1)[-1] if "requeued" in msg or "released on" in msg else None


def _int(pattern: str, text: str) -> int | None:
    m = re.search(pattern, text)
    return int(m.group(1)) if m else None


def summarize(detail: dict[str, Any], *, t_fault: float) -> dict[str, Any]:
    """The report's recovery fields (those of demo-report.json), from the incident."""
    inc = detail["incident"]
    results = {a["kind"]: a for a in detail["actions"] if a["kind"] != "notify"}
    ck = results.get("checkpoint", {}).get("result", "")
    rep = re.search(r"replaced (\S+) -> (\S+)", results.get("replace", {}).get("result", ""))
    rs = results.get("restart", {}).get("result", "")
    released = [
        e["ts"]
        for e in detail["timeline"]
        if e["kind"] == "action_progress" and "released on" in e["message"]
    ]
    done = [
        e["ts"]
        for e in detail["timeline"]
        if e["kind"] == "action_succeeded" and "step restart" in e["message"]
    ]
    phases = {k: float(v) for k, v in re.findall(r"(\w+) ([\d.]+) s\b", rs)}
    return {
        "incident_id": inc["id"],
        "rule": inc["rule"],
        "detected_after_s": round(inc["opened_at"] - t_fault, 3),
        "checkpoint_step": _int(r"committed at step (\d+)", ck) or _int(r"step (\d+)", ck),
        "checkpoint_proactive": "committed at step" in ck,
        "drained_node": results.get("drain", {}).get("params", {}).get("node"),
        "spare_node": rep.group(2) if rep else None,
        "restarted_after_s": round(released[0] - t_fault, 3) if released else None,
        "first_step_after_restart": _int(r"\(step (\d+)\)", rs),
        "lost_steps": _int(r"lost steps (\d+)", rs),
        "mttr_s": round(done[0] - t_fault, 3) if done else None,
        "slurm_phases_s": phases,
        "mitigated": any(e["kind"] == "mitigated" for e in detail["timeline"]),
    }


def run(args: argparse.Namespace) -> int:
    why = missing_reason()
    if why is not None and os.geteuid() == 0:
        print("installing the Debian packages: slurmctld slurmd slurm-client munge", flush=True)
        install_packages()
        why = missing_reason()
    if why is not None:
        print(f"demo-slurm cannot run here: {why}", file=sys.stderr)
        return 1
    run_dir = Path(args.run_dir).resolve()
    t_start = time.monotonic()
    deadline = t_start + args.timeout_s
    report: dict[str, Any] = {"ok": False}
    print("trainguard demo-slurm: slurmctld + slurmd n1..n4 (n4 in the spare reservation),",
          "4 sim agents, the controller with its Slurm backend", flush=True)  # fmt: skip
    with SlurmSite(run_dir, jobs={"checkpoint_timeout_s": 10}) as site:
        site.start()
        cluster, slurm = site.cluster, site.slurm
        ref_proc = cluster.spawn(
            "reference",
            [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "3", str(REPO_ROOT / "examples" / "train.py"),
                *TRAIN_ARGS, "--ckpt-dir", str(run_dir / "ref-ckpt"),
            ],
            cwd=REPO_ROOT,
        )  # fmt: skip
        job_id, out = site.submit("demo", TRAIN_ARGS)
        name = f"slurm-{job_id}"
        where = ",".join(slurm.job_nodes(job_id)) or "n1..n3 (pending)"
        print(f"sbatch examples/slurm/train.sbatch {' '.join(TRAIN_ARGS)} as {site.user}"
              f" -> Slurm job {job_id} on {where}", flush=True)  # fmt: skip
        view = cluster.wait_job(
            name,
            lambda j: (j.get("last_step") or 0) >= args.fault_step,
            timeout_s=max(1.0, deadline - time.monotonic()),
            what=f"Slurm job {job_id} to reach step {args.fault_step}",
        )
        fault_step = int(view["last_step"])
        # the ranks run as an ordinary user: their heartbeats reached the agents all the same
        print(f"watched: {name}, {site.user}'s ranks at step {fault_step} by their heartbeats",
              flush=True)  # fmt: skip
        report["submit_user"] = site.user
        t_fault = time.time()
        cluster.inject(args.fault_node, "dbe", gpu=args.fault_gpu)
        printer = Printer(t_fault)
        printer.line(t_fault, f"FAULT: DBE (XID 48) injected into {args.fault_node} GPU"
                     f" {args.fault_gpu} at step {fault_step}")  # fmt: skip
        report["fault"] = {"kind": "dbe", "node": args.fault_node, "gpu": args.fault_gpu,
                           "step": fault_step, "at": t_fault}  # fmt: skip
        report["slurm_job_id"] = job_id

        def mitigated() -> dict[str, Any] | None:
            for inc in cluster.incidents():
                if inc.get("node") != args.fault_node or inc["opened_at"] < t_fault - 1:
                    continue
                detail = cluster.incident(inc["id"])
                printer.incident(detail)
                states = {a["state"] for a in detail["actions"] if a["kind"] != "notify"}
                if "failed" in states:
                    raise ClusterError(
                        f"remediation failed: {json.dumps(detail['actions'])[:2000]}"
                    )
                if detail["incident"]["state"] in ("mitigated", "resolved"):
                    return detail
            return None

        detail = cluster.wait(
            mitigated,
            timeout_s=max(1.0, deadline - time.monotonic()),
            what="the incident to be mitigated",
            interval_s=0.2,
        )
        report.update(summarize(detail, t_fault=t_fault))
        report["slurm_drain_reason"] = slurm.drain_reasons().get(args.fault_node)
        printer.line(time.time(), f"sinfo -R: {args.fault_node} {report['slurm_drain_reason']!r}")

        def finished() -> dict[str, Any] | None:
            job = slurm.jobs().get(job_id)
            live = ("RUNNING", "PENDING", "COMPLETING")
            return job if job and job["job_state"] not in live else None

        final = cluster.wait(
            finished,
            timeout_s=max(1.0, deadline - time.monotonic()),
            what=f"Slurm job {job_id} to finish",
        )
        nodes = slurm.job_nodes(job_id)
        printer.line(time.time(), f"Slurm job {job_id} {final['job_state']} on {','.join(nodes)}"
                     f" (restarts: {final['restart_cnt']})")  # fmt: skip
        cluster.wait(
            lambda: ref_proc.poll() is not None,
            timeout_s=max(1.0, deadline - time.monotonic()),
            what="the reference run to finish",
        )
        reference = read_step_lines(cluster.run_dir / "reference.log")
        attempts = attempt_lines(out)
        problems = compare_losses(list(attempts.values()), reference)
        last = max((x["step"] for x in reference), default=0)
        steps_done = {x["step"] for lines in attempts.values() for x in lines}
        complete = last > 0 and set(range(1, last + 1)) <= steps_done
        report.update(
            slurm_job_state=final["job_state"],
            slurm_restarts=final["restart_cnt"],
            job_nodes=nodes,
            reference_steps=len(reference),
            compared_steps=sum(len(v) for v in attempts.values()),
            loss_mismatches=problems[:20],
            loss_matches_reference=not problems and complete and final["job_state"] == "COMPLETED",
            timeline=[
                {"t_s": round(e["ts"] - t_fault, 3), "kind": e["kind"], "message": e["message"]}
                for e in cluster.incident(detail["incident"]["id"])["timeline"]
            ],
        )
    report["ok"] = bool(
        report.get("mitigated") and report.get("spare_node") and report["loss_matches_reference"]
    )
    report["demo_wall_s"] = round(time.monotonic() - t_start, 1)
    Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"\nrecovered: detected after {report['detected_after_s']} s, checkpoint at step"
        f" {report['checkpoint_step']}, {report['drained_node']} drained in Slurm"
        f" ({report['slurm_drain_reason']!r}), {report['spare_node']} took its place, first"
        f" step after the requeue {report['first_step_after_restart']}, MTTR"
        f" {report['mttr_s']} s, lost steps {report['lost_steps']}",
        flush=True,
    )
    verdict = "match" if report["loss_matches_reference"] else "DO NOT match"
    print(f"losses after recovery {verdict} the uninterrupted reference run"
          f" ({report['compared_steps']} logged steps compared)", flush=True)  # fmt: skip
    print(f"wrote {args.report} (run dir: {run_dir})", flush=True)
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\ninterrupted: every daemon and process of the demo has been stopped",
              file=sys.stderr)  # fmt: skip
        return 130
    except ClusterError as e:
        print(f"demo-slurm failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
