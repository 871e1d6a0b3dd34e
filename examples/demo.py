"""`make demo`: a local cluster survives an uncorrectable ECC error, end to end.

A controller and four agents on loopback (node-1..3 active, node-4 a hot spare, simulated
GPUs), examples/train.py under torchrun across the three active nodes, and in parallel the
same job uninterrupted (`torchrun --standalone`) as the reference. After some steps a DBE
is injected into a GPU of node-2; the demo prints the recovery as a timeline (seconds since
the fault), waits for the job to finish, compares every logged loss with the reference
bitwise, and writes `demo-report.json` and `demo-loss.png` in the working directory.

Exit code 0 only if the job recovered and every loss matched the reference; 1 otherwise;
130 when interrupted (every process of the demo is ended either way).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.devkit.devcluster import (
    REPO_ROOT,
    ClusterConfig,
    ClusterError,
    DevCluster,
    compare_losses,
    read_step_lines,
)

JOB_FILE = REPO_ROOT / "examples" / "demo-job.yaml"
# Timeline entries worth a line in the terminal (the rest stay in the report).
_SHOWN = ("opened", "correlated", "action_succeeded", "action_failed", "mitigated", "resolved")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="demo-run", help="configs, logs, store, checkpoints")
    p.add_argument("--report", default="demo-report.json")
    p.add_argument("--plot", default="demo-loss.png")
    p.add_argument("--fault-step", type=int, default=20, help="inject the DBE after this step")
    p.add_argument("--fault-node", default="node-2")
    p.add_argument("--fault-gpu", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=170.0, help="give up after this long")
    return p.parse_args(argv)


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


class Printer:
    """Prints incident timeline entries once each, as seconds since the fault."""

    def __init__(self, t_fault: float) -> None:
        self.t_fault = t_fault
        self.seen: set[tuple[int, int]] = set()

    def line(self, t: float, text: str) -> None:
        print(f"  +{t - self.t_fault:6.1f} s  {text}", flush=True)

    def restart_text(self, msg: str) -> str | None:
        """The restart progress worth a line (the torchrun backend: the launch on the nodes)."""
        return msg.split(": ", 1)[-1].split(";", maxsplit=1)[0] if " started on " in msg else None

    def incident(self, detail: dict[str, Any]) -> None:
        inc = detail["incident"]
        for i, e in enumerate(detail["timeline"]):
            if (inc["id"], i) in self.seen:
                continue
            self.seen.add((inc["id"], i))
            kind, msg = e["kind"], e["message"]
            restart = self.restart_text(msg) if kind == "action_progress" else None
            if restart is not None:
                self.line(e["ts"], "restart: " + restart)
            elif kind in _SHOWN and "notify" not in msg:
                label = {"opened": f"detected (incident {inc['id']}, {inc['rule']})"}.get(kind)
                self.line(e["ts"], label + ": " + msg if label else msg)


def _find(pattern: str, text: str) -> re.Match[str] | None:
    return re.search(pattern, text)


def summarize(detail: dict[str, Any], *, t_fault: float) -> dict[str, Any]:
    """The report's recovery fields, from the incident's timeline and step results."""
    out: dict[str, Any] = {}
    inc = detail["incident"]
    out["incident_id"] = inc["id"]
    out["rule"] = inc["rule"]
    out["detected_after_s"] = round(inc["opened_at"] - t_fault, 3)
    results = {a["kind"]: a for a in detail["actions"] if a["kind"] != "notify"}
    ck = results.get("checkpoint", {}).get("result", "")
    m = _find(r"committed at step (\d+) in ([\d.]+) s", ck) or _find(r"step (\d+)", ck)
    out["checkpoint_step"] = int(m.group(1)) if m else None
    out["checkpoint_proactive"] = "committed at step" in ck
    m = _find(r"in ([\d.]+) s", ck)
    checkpoint_s = float(m.group(1)) if m else None
    out["checkpoint_s"] = checkpoint_s
    drain = results.get("drain", {})
    out["drained_node"] = drain.get("params", {}).get("node") if drain else None
    rep = _find(r"replaced (\S+) -> (\S+?);", results.get("replace", {}).get("result", ""))
    out["spare_node"] = rep.group(2) if rep else None
    restarted = [
        e["ts"]
        for e in detail["timeline"]
        if e["kind"] == "action_progress" and " started on " in e["message"]
    ]
    out["restarted_after_s"] = round(restarted[0] - t_fault, 3) if restarted else None
    rs = results.get("restart", {})
    m = _find(r"\(step (\d+)\)", rs.get("result", ""))
    out["first_step_after_restart"] = int(m.group(1)) if m else None
    m = _find(r"lost steps (\d+)", rs.get("result", ""))
    out["lost_steps"] = int(m.group(1)) if m else None
    done = [
        e["ts"]
        for e in detail["timeline"]
        if e["kind"] == "action_succeeded" and "restart" in e["message"]
    ]
    out["mttr_s"] = round(done[0] - t_fault, 3) if done else None
    out["mitigated"] = any(e["kind"] == "mitigated" for e in detail["timeline"])
    return out


def plot(
    path: Path,
    *,
    reference: list[dict[str, Any]],
    attempts: dict[int, list[dict[str, Any]]],
    marks: dict[str, int | None],
) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    def finite(lines: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
        pts = [(x["step"], x["loss"]) for x in lines if isinstance(x["loss"], float)]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(*finite(reference), color="0.6", lw=3, label="reference (uninterrupted)")
    for attempt, lines in sorted(attempts.items()):
        ax.plot(*finite(lines), "o", ms=3, label=f"job attempt {attempt}")
    colors = {"fault": "red", "checkpoint": "green", "restart": "blue"}
    for name, step in marks.items():
        if step is not None:
            ax.axvline(step, color=colors.get(name, "black"), ls="--", lw=1)
            ax.text(step, ax.get_ylim()[1], f" {name} @{step}", color=colors.get(name), va="top")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("trainguard demo: DBE on node-2, checkpoint, hot spare, restart")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    spec: dict[str, Any] = yaml.safe_load(JOB_FILE.read_text())
    run_dir = Path(args.run_dir).resolve()
    t_start = time.monotonic()
    deadline = t_start + args.timeout_s
    report: dict[str, Any] = {"ok": False}
    print("trainguard demo: controller + 4 sim agents (node-4 is the hot spare)", flush=True)
    with DevCluster(run_dir, ClusterConfig(safety={"drain_budget": 10})) as cluster:
        cluster.start()
        spec["ckpt_dir"] = str(run_dir / "ckpt")
        spec["cwd"] = str(REPO_ROOT)
        world = len(spec["nodes"]) * spec["nproc_per_node"]
        ref_args = [*spec["command"][1:], "--ckpt-dir", str(run_dir / "ref-ckpt")]
        ref_proc = cluster.spawn(
            "reference",
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                str(world),
                str(REPO_ROOT / spec["command"][0]),
                *ref_args,
            ],
            cwd=REPO_ROOT,
        )
        cluster.submit_job(spec)
        name = spec["name"]
        print(f"job {name}: {' '.join(spec['command'])} on {', '.join(spec['nodes'])}", flush=True)
        view = cluster.wait_job(
            name,
            lambda j: (j.get("last_step") or 0) >= args.fault_step,
            timeout_s=max(1.0, deadline - time.monotonic()),
            what=f"job {name} to reach step {args.fault_step}",
        )
        fault_step = int(view["last_step"])
        t_fault = time.time()
        cluster.inject(args.fault_node, "dbe", gpu=args.fault_gpu)
        printer = Printer(t_fault)
        printer.line(t_fault, f"FAULT: DBE (XID 48) injected into {args.fault_node} GPU "
                     f"{args.fault_gpu} at step {fault_step}")  # fmt: skip
        report["fault"] = {
            "kind": "dbe",
            "node": args.fault_node,
            "gpu": args.fault_gpu,
            "step": fault_step,
            "at": t_fault,
        }

        def incident() -> dict[str, Any] | None:
            for inc in cluster.incidents():
                if inc.get("node") == args.fault_node and inc["opened_at"] >= t_fault - 1:
                    return cluster.incident(inc["id"])
            return None

        def mitigated() -> dict[str, Any] | None:
            detail = incident()
            if detail is None:
                return None
            printer.incident(detail)
            states = {a["state"] for a in detail["actions"] if a["kind"] != "notify"}
            if "failed" in states:
                raise ClusterError(f"remediation failed: {json.dumps(detail['actions'])[:2000]}")
            return detail if detail["incident"]["state"] in ("mitigated", "resolved") else None

        detail = cluster.wait(
            mitigated,
            timeout_s=max(1.0, deadline - time.monotonic()),
            what="the incident to be mitigated",
            interval_s=0.2,
        )
        report.update(summarize(detail, t_fault=t_fault))
        final = cluster.wait_job(
            name,
            lambda j: j["state"] in ("completed", "failed", "crashed"),
            timeout_s=max(1.0, deadline - time.monotonic()),
            what=f"job {name} to finish",
        )
        printer.line(time.time(), f"job {name} {final['state']} at step {final.get('last_step')}")
        cluster.wait(
            lambda: ref_proc.poll() is not None,
            timeout_s=max(1.0, deadline - time.monotonic()),
            what="the reference run to finish",
        )
        reference = read_step_lines(run_dir / "reference.log")
        attempts: dict[int, list[dict[str, Any]]] = {}
        for attempt, line in cluster.step_lines(name):
            attempts.setdefault(attempt, []).append(line)
        problems = compare_losses(list(attempts.values()), reference)
        last = max((x["step"] for x in reference), default=0)
        steps_done = {x["step"] for lines in attempts.values() for x in lines}
        complete = last > 0 and set(range(1, last + 1)) <= steps_done
        old = [x["step"] for a, lines in attempts.items() if a == 1 for x in lines]
        new = [x["step"] for a, lines in attempts.items() if a > 1 for x in lines]
        # the trainers also commit an emergency checkpoint when the restart stops them, so
        # the new attempt may resume later than the proactive checkpoint
        resumed_from = min(new) - 1 if new else None
        report.update(
            job_state=final["state"],
            job_final_step=final.get("last_step"),
            job_nodes=final.get("nodes"),
            job_restarts=final.get("restarts"),
            ettr=final.get("ettr"),
            resumed_from_step=resumed_from,
            redone_steps=max(0, max(old) - resumed_from)
            if old and resumed_from is not None
            else None,
            reference_steps=len(reference),
            compared_steps=sum(len(v) for v in attempts.values()),
            loss_mismatches=problems[:20],
            loss_matches_reference=not problems and complete and final["state"] == "completed",
            timeline=[
                {"t_s": round(e["ts"] - t_fault, 3), "kind": e["kind"], "message": e["message"]}
                for e in cluster.incident(detail["incident"]["id"])["timeline"]
            ],
        )
        plot(
            Path(args.plot),
            reference=reference,
            attempts=attempts,
            marks={
                "fault": fault_step,
                "checkpoint": report.get("checkpoint_step"),
                "restart": report.get("first_step_after_restart"),
            },
        )
    report["ok"] = bool(
        report.get("mitigated") and report.get("spare_node") and report["loss_matches_reference"]
    )
    report["demo_wall_s"] = round(time.monotonic() - t_start, 1)
    Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    print(
        f"\nrecovered: detected after {report['detected_after_s']} s, checkpoint at step "
        f"{report['checkpoint_step']} ({report['checkpoint_s']} s), {report['drained_node']} "
        f"drained, {report['spare_node']} took its place, first step after restart "
        f"{report['first_step_after_restart']}, MTTR {report['mttr_s']} s, lost steps "
        f"{report['lost_steps']}",
        flush=True,
    )
    verdict = "match" if report["loss_matches_reference"] else "DO NOT match"
    print(
        f"losses after recovery {verdict} the uninterrupted reference run "
        f"({report['compared_steps']} logged steps compared)",
        flush=True,
    )
    print(f"wrote {args.report} and {args.plot} (run dir: {run_dir})", flush=True)
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("\ninterrupted: every process of the demo has been stopped", file=sys.stderr)
        return 130
    except ClusterError as e:
        print(f"demo failed: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
