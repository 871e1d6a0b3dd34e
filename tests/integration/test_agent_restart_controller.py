"""With the real controller (a local devcluster: controller + one sim agent): the node's agent
is restarted with SIGTERM and then with kill -9 while the job trains. No incident opens, the
job never restarts, trains to its last step with the losses of an uninterrupted run
(bitwise) and completes."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from trainguard.devkit.devcluster import (
    REPO_ROOT,
    ClusterConfig,
    DevCluster,
    compare_losses,
    read_step_lines,
)

pytestmark = pytest.mark.slow

STEPS = 60


def train_args(step_time_s: float) -> list[str]:
    # the step time only pads each step: runs with different step times log the same losses
    return [
        "--steps", str(STEPS), "--checkpoint-every", "10", "--step-time-s", str(step_time_s),
        "--seed", "0",
    ]  # fmt: skip


def test_agent_restarts_open_no_incident_and_the_job_completes_with_reference_losses(
    tmp_path: Path,
) -> None:
    config = ClusterConfig(active=("node-1",), spares=(), report_interval_s=0.5)
    with DevCluster(tmp_path / "cluster", config) as cluster:
        cluster.start()
        reference = cluster.spawn(
            "reference",
            [
                sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", str(REPO_ROOT / "examples" / "train.py"),
                *train_args(0.0), "--ckpt-dir", str(cluster.run_dir / "ref-ckpt"),
            ],
            cwd=REPO_ROOT,
        )  # fmt: skip
        cluster.wait(lambda: reference.poll() is not None, timeout_s=180, what="the reference")
        ref_lines = read_step_lines(cluster.run_dir / "reference.log")
        assert [x["step"] for x in ref_lines] == list(range(1, STEPS + 1))

        cluster.submit_job(
            {
                "name": "demo",
                "command": ["examples/train.py", *train_args(0.3)],
                "nodes": ["node-1"],
                "nproc_per_node": 2,
                "ckpt_dir": str(cluster.run_dir / "ckpt"),
                "cwd": str(REPO_ROOT),
            }
        )
        view = cluster.wait_job(
            "demo",
            lambda j: j["state"] == "running" and (j.get("last_step") or 0) >= 3,
            timeout_s=120,
            what="the job training",
        )
        attempt = view["attempt"]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            step = cluster.job("demo").get("last_step") or 0
            cluster.kill_agent("node-1", sig)
            cluster.start_agent("node-1")
            cluster.wait_job(
                "demo",
                lambda j, s=step: (j.get("last_step") or 0) > s + 2,  # type: ignore[misc]
                timeout_s=60,
                what=f"the job training on after the agent's {sig.name} restart",
            )
            log = cluster.agents["node-1"].proc.log()
            assert "event=job_adopted job=demo" in log
        done = cluster.wait_job(
            "demo",
            lambda j: j["state"] in ("completed", "failed", "stopped"),
            timeout_s=180,
            what="the job to complete",
        )
        assert done["state"] == "completed", done
        assert (done["attempt"], done["restarts"]) == (attempt, 0), done
        assert cluster.incidents() == [], cluster.incidents()
        lines = [line for _, line in cluster.step_lines("demo")]
        assert [x["step"] for x in lines] == list(range(1, STEPS + 1))
        assert compare_losses([lines], ref_lines) == []
