"""Shared helpers for the whole-loop chaos tests: the job, the reference run, and the checks
every scenario ends with (trained to the end, losses equal the reference, one incident with
one restart, a complete timeline in order)."""

from __future__ import annotations

import sys
import time
from typing import Any

from trainguard.devkit.devcluster import (
    REPO_ROOT,
    DevCluster,
    compare_losses,
    read_step_lines,
)

STEPS = 40
TRAIN_ARGS = ["--steps", str(STEPS), "--checkpoint-every", "5", "--step-time-s", "0.2"]
TRAIN_ARGS += ["--seed", "0"]


def job_spec(cluster: DevCluster, name: str, nodes: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "command": ["examples/train.py", *TRAIN_ARGS],
        "nodes": nodes,
        "nproc_per_node": 1,
        "ckpt_dir": str(cluster.run_dir / "ckpt" / name),
        "cwd": str(REPO_ROOT),
        "max_restarts": 3,
        **extra,
    }


def start_reference(cluster: DevCluster, *, world: int = 3) -> Any:
    """The same job uninterrupted at the same world size (torchrun --standalone)."""
    return cluster.spawn(
        "reference",
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(world), str(REPO_ROOT / "examples" / "train.py"),
            *TRAIN_ARGS, "--ckpt-dir", str(cluster.run_dir / "ref-ckpt"),
        ],
        cwd=REPO_ROOT,
    )  # fmt: skip


def reference_lines(cluster: DevCluster, proc: Any) -> list[dict[str, Any]]:
    cluster.wait(lambda: proc.poll() is not None, timeout_s=120, what="the reference run")
    lines = read_step_lines(cluster.run_dir / "reference.log")
    assert [x["step"] for x in lines] == list(range(1, STEPS + 1)), "reference run incomplete"
    return lines


def run_until_step(cluster: DevCluster, spec: dict[str, Any], step: int) -> dict[str, Any]:
    cluster.submit_job(spec)
    return cluster.wait_job(
        spec["name"],
        lambda j: j["state"] == "running" and (j.get("last_step") or 0) >= step,
        timeout_s=90,
        what=f"job {spec['name']} at step {step}",
    )


def new_incidents(cluster: DevCluster, since: float) -> list[dict[str, Any]]:
    return [i for i in cluster.incidents() if i["opened_at"] >= since]


def check_recovery(
    cluster: DevCluster,
    job: str,
    reference: list[dict[str, Any]],
    *,
    since: float,
    fault_step: int,
    rules: set[str],
    steps: list[str],
    poisoned_from: int | None = None,
) -> dict[str, Any]:
    """Wait for the job to finish, then check: it trained past the fault to the last step,
    every logged loss equals the reference's (but those the first attempt logged after step
    `poisoned_from`: a NaN fault there poisons the model on purpose, so they must be NaN),
    exactly one incident (of one of `rules`) with one restart, and its timeline holds opened,
    each of `steps` succeeding, then mitigated, in order with non-decreasing timestamps.
    Returns the incident detail."""
    view = cluster.wait_job(
        job,
        lambda j: j["state"] in ("completed", "failed"),
        timeout_s=150,
        what=f"job {job} to finish",
    )
    assert view["state"] == "completed", view
    assert view["last_step"] == STEPS > fault_step, view
    assert view["restarts"] == 1, view
    attempts: dict[int, list[dict[str, Any]]] = {}
    for attempt, line in cluster.step_lines(job):
        attempts.setdefault(attempt, []).append(line)
    assert len(attempts) == 2, sorted(attempts)
    if poisoned_from is not None:
        first = min(attempts)
        poisoned = [x for x in attempts[first] if x["step"] > poisoned_from]
        assert poisoned and all(x["loss"] == "NaN" for x in poisoned), poisoned
        attempts[first] = [x for x in attempts[first] if x["step"] <= poisoned_from]
    assert compare_losses(list(attempts.values()), reference) == []
    logged = {x["step"] for lines in attempts.values() for x in lines}
    assert logged == set(range(1, STEPS + 1))
    # the incident: one for the fault, mitigated (poll: the tick may trail the job's end)
    incidents = cluster.wait(
        lambda: (
            (found := new_incidents(cluster, since))
            and all(i["state"] in ("mitigated", "resolved") for i in found)
            and found
        ),
        timeout_s=30,
        what="the incident to be mitigated",
    )
    assert len(incidents) == 1, [(i["rule"], i["target"]) for i in incidents]
    assert incidents[0]["rule"] in rules
    detail = cluster.incident(incidents[0]["id"])
    restarts = [a for a in detail["actions"] if a["kind"] in ("restart", "rollback")]
    assert [a["state"] for a in restarts] == ["succeeded"], restarts
    timeline = detail["timeline"]
    stamps = [e["ts"] for e in timeline]
    assert stamps == sorted(stamps)
    wanted = ["opened", *[f"succeeded:{s}" for s in steps], "mitigated"]
    seen = []
    for e in timeline:
        if e["kind"] == "action_succeeded":
            kind = next((s for s in steps if f"step {s} #" in e["message"]), None)
            if kind is not None:
                seen.append(f"succeeded:{kind}")
        elif e["kind"] in ("opened", "mitigated"):
            seen.append(e["kind"])
    assert seen == wanted, [(e["kind"], e["message"][:80]) for e in timeline]
    return detail


def now() -> float:
    return time.time()
