"""In-process recovery on a real local cluster (docs/controller.md "In-process recovery"): a
job of examples/trainer_ddp_rejoin.py with `recovery.in_process`, spares that keep a warm
standby of its module. A DBE on a node of the job: the healthy ranks stay in their processes
and re-form the world under the next epoch with the spare's standby (no relaunch). A rank
killed with kill -9 on a healthy node (rank 0, on the first node, whose torchrun serves the
attempt's store): the same, and that node becomes a spare. Then a DBE
while the next spare's standby is down: the fast path falls back to the full restart from the
checkpoint, and the incident says why. Every loss and the final weights are the
uninterrupted run's, bitwise."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.chaos import now
from trainguard.devkit.devcluster import REPO_ROOT, ClusterConfig, DevCluster

pytestmark = pytest.mark.slow
STEPS = 160
JOB = "rejoin"


def args(out: Path) -> list[str]:
    """The job's arguments; a standby runs the module with the same ones (plus its
    membership), so it logs to the same file."""
    return ["--steps", str(STEPS), "--checkpoint-every", "5", "--timeout-s", "10",
            "--step-time-s", "0.2", "--out", str(out),
            "--digest-out", str(out.with_suffix(".digest"))]  # fmt: skip


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("inprocess"))


@pytest.fixture(scope="module")
def cluster(base: Path) -> Iterator[DevCluster]:
    config = ClusterConfig(
        spares=("node-4", "node-5"),
        safety={"drain_budget": 100, "breaker_threshold": 100},
        jobs={"checkpoint_timeout_s": 10, "stop_grace_s": 5, "stop_timeout_s": 10},
        standby={
            "enabled": True,
            "module": "trainer_ddp_rejoin",
            "cwd": str(REPO_ROOT / "examples"),
            "args": args(base / "out.jsonl"),
            # a standby killed by the test stays down for the rest of the module
            "restart_backoff_s": 600,
            "max_backoff_s": 600,
        },
    )
    # every process of the cluster (the agents pass their environment to the ranks and the
    # standbys) computes with MKL's reproducible code path from its first MKL call: a
    # standby imports torch before the job's module could ask for it (docs/trainer.md)
    with pytest.MonkeyPatch.context() as mp, DevCluster(base / "cluster", config) as c:
        mp.setenv("MKL_CBWR", "COMPATIBLE")
        c.start()
        yield c
    assert c.leftover_pids() == set()


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def warm(cluster: DevCluster, node: str) -> dict[str, Any]:
    """Wait until the spare passed its warm preflight and its standby is ready."""

    def ready() -> dict[str, Any] | None:
        view = cluster.node(node)
        preflight = view.get("last_preflight") or {}
        standby = view.get("standby") or {}
        return view if preflight.get("passed") and standby.get("ready") else None

    return cluster.wait(ready, timeout_s=120, what=f"{node}: preflighted, standby ready")


def restart_of(cluster: DevCluster, since: float) -> dict[str, Any]:
    detail = cluster.wait(
        lambda: cluster.restarted_since(since),
        timeout_s=150,
        what="the restart step",
        interval_s=0.2,
    )
    return next(a for a in detail["actions"] if a["kind"] == "restart")


def test_a_lost_node_is_recovered_in_process_then_a_missing_standby_falls_back(
    cluster: DevCluster, base: Path
) -> None:
    out = base / "out.jsonl"
    ref_out = base / "ref.jsonl"
    reference = cluster.spawn(
        "reference",
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "3", str(REPO_ROOT / "examples" / "trainer_ddp_rejoin.py"), *args(ref_out),
            "--ckpt-dir", str(base / "ref-ckpt"),
        ],
        cwd=REPO_ROOT,
    )  # fmt: skip
    warm(cluster, "node-4")
    standby_pid = int(
        (cluster.run_dir / "node-4" / "jobs" / "standby" / "standby.ready").read_text()
    )
    cluster.submit_job(
        {
            "name": JOB,
            "command": ["examples/trainer_ddp_rejoin.py", *args(out)],
            "nodes": ["node-1", "node-2", "node-3"],
            "nproc_per_node": 1,
            "ckpt_dir": str(base / "ckpt"),
            "cwd": str(REPO_ROOT),
            "recovery": {"in_process": True},
        }
    )
    cluster.wait_job(
        JOB,
        lambda j: j["state"] == "running" and (j.get("last_step") or 0) >= 10,
        timeout_s=120,
        what="the job at step 10",
    )
    before = {r["rank"]: r["pid"] for r in rows(out)}

    # 1. DBE on node-2 (rank 1): in process, with node-4's standby
    t1 = now()
    cluster.inject("node-2", "dbe", gpu=1)
    restart = restart_of(cluster, t1)
    assert restart["result"].startswith("recovered in process: epoch 2"), restart["result"]
    # lost work: at most the step in flight (the state came from a survivor, not the disk)
    assert re.search(r"; lost steps [01]$", restart["result"]), restart["result"]
    view = cluster.job(JOB)
    assert view["nodes"] == ["node-1", "node-4", "node-3"], view
    assert view["attempt"] == 2, view

    # no relaunch: two ranks are the processes that trained before (which ranks ran on
    # node-2 was torchrun's rendezvous's choice), the third is node-4's standby
    def epoch_2_pids() -> set[int] | None:
        pids = {r["pid"] for r in rows(out) if r["epoch"] == 2}
        return pids if len(pids) == 3 else None

    pids = cluster.wait(epoch_2_pids, timeout_s=30, what="every rank at a step of epoch 2")
    assert len(pids & set(before.values())) == 2 and standby_pid in pids, (pids, before)

    # 2. kill -9 of the rank on node-1, rank 0, whose torchrun serves the attempt's store
    # (static rendezvous: the other torchruns do not need it once started): node-1 is
    # healthy, so it joins the spares and node-5's standby takes its slot; the survivors
    # rejoin in their processes under epoch 3
    warm(cluster, "node-5")
    standby_5 = int((cluster.run_dir / "node-5" / "jobs" / "standby" / "standby.ready").read_text())
    (victim,) = [r for r in cluster.rank_procs(JOB) if r.node == "node-1"]
    t2 = now()
    os.kill(victim.pid, signal.SIGKILL)
    restart = restart_of(cluster, t2)
    assert restart["result"].startswith("recovered in process: epoch 3"), restart["result"]
    detail = cluster.incident(restart["incident_id"])
    assert detail["incident"]["rule"] == "job_process_failed"
    assert any("replaced node-1 -> node-5" in e["message"] for e in detail["timeline"])
    view = cluster.job(JOB)
    assert (view["nodes"], view["attempt"]) == (["node-5", "node-4", "node-3"], 3), view
    node_1 = cluster.node("node-1")
    assert (node_1["role"], node_1["state"], node_1.get("job")) == ("spare", "active", None)

    def epoch_3_pids() -> set[int] | None:
        pids = {r["pid"] for r in rows(out) if r["epoch"] == 3}
        return pids if len(pids) == 3 else None

    survivors = pids - {victim.pid}
    assert cluster.wait(epoch_3_pids, timeout_s=30, what="epoch 3") == survivors | {standby_5}

    # 3. node-1, a spare now, keeps a standby; with it down, the next DBE falls back to the
    # full restart (and node-1, the only spare, takes the lost node's place)
    # node-2, repaired after its DBE, comes back as a spare too: once it has, an operator
    # keeps it out of the spares, so node-1 is the only one
    cluster.wait(
        lambda: (v := cluster.node("node-2"))["state"] == "active" and v["role"] == "spare",
        timeout_s=120,
        what="node-2 repaired, back among the spares",
    )
    cluster.api("PUT", "/v1/nodes/node-2/role", json={"role": "active"})
    warm(cluster, "node-1")
    ready_file = cluster.run_dir / "node-1" / "jobs" / "standby" / "standby.ready"
    os.kill(int(ready_file.read_text()), signal.SIGKILL)
    cluster.wait(
        lambda: not (cluster.node("node-1").get("standby") or {}).get("ready"),
        timeout_s=30,
        what="node-1 to report its standby gone",
    )
    t3 = now()
    cluster.inject("node-4", "dbe", gpu=0)
    restart = restart_of(cluster, t3)
    why = "in-process recovery fell back to a full restart (spare node-1"
    assert restart["result"].startswith(why), restart["result"]
    assert "attempt 4 trains past checkpoint" in restart["result"], restart["result"]
    timeline = cluster.incident(restart["incident_id"])["timeline"]
    assert any(why in e["message"] for e in timeline if e["kind"] == "action_progress")

    final = cluster.wait_job(
        JOB,
        lambda j: j["state"] in ("completed", "failed"),
        timeout_s=180,
        what="the job to finish",
    )
    assert final["state"] == "completed", final
    assert final["nodes"] == ["node-5", "node-1", "node-3"], final
    cluster.wait(lambda: reference.poll() is not None, timeout_s=120, what="the reference run")
    assert reference.returncode == 0
    # every rank of the healed job ends with the uninterrupted run's weights, bitwise (the
    # standbys' came from the survivors), and every loss is the uninterrupted run's, bitwise:
    # before the first recovery, after each in-process one and after the full restart (a
    # DDP built past step 0 first rebuilds its buckets: trainguard.trainer.settle_ddp_buckets)
    digests = {r["digest"] for r in rows(out.with_suffix(".digest"))}
    assert digests == {r["digest"] for r in rows(ref_out.with_suffix(".digest"))}, digests
    ref = {(r["rank"], r["step"]): r["loss"] for r in rows(ref_out)}
    got = rows(out)
    assert {r["step"] for r in got} == {r["step"] for r in rows(ref_out)}
    assert {r["epoch"] for r in got} == {1, 2, 3, 4}
    differ = [r for r in got if ref[(r["rank"], r["step"])] != r["loss"]]
    assert not differ, differ[:5]
