"""A real warm standby: started by the pool, ready once torch and the job's module are
imported, handed a Membership, it runs the module as that rank (no GPU before)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.helpers import free_port, wait_for
from trainguard.agent.config import StandbyConfig
from trainguard.agent.standby import ProcessLauncher, StandbyPool

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def test_a_standby_gets_ready_takes_a_membership_and_runs_the_job(tmp_path: Path) -> None:
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    out = tmp_path / "seen.json"
    config = StandbyConfig(
        enabled=True, module="standby_entry", args=("--out", str(out)), cwd=str(HERE)
    )
    launcher = ProcessLauncher(work_dir=tmp_path / "standby")
    pool = StandbyPool(config=config, launcher=launcher)
    try:
        pool.tick(spare=True)
        wait_for(lambda: pool.tick(spare=True) and pool.is_ready, timeout_s=60, what="ready")
        assert pool.started_total == 1 and pool.ready_s is not None
        proc = launcher.proc
        assert proc is not None
        membership = {
            "rank": 0, "world_size": 1, "store_host": "127.0.0.1", "store_port": port,
            "epoch": 3, "timeout_s": 30.0, "backend": "gloo",
        }  # fmt: skip
        child = pool.take(json.dumps(membership))
        assert child is proc
        pid = proc.pid
        assert proc.wait(30) == 0, launcher.output_tail()
        seen = json.loads(out.read_text())
        assert seen == {
            "pid": pid, "rank": 0, "world_size": 1, "epoch": 3,
            "cuda_visible_devices": "", "cuda_initialized": False,
        }  # fmt: skip
        pool.tick(spare=True)  # the replacement starts at once
        assert pool.started_total == 2
        pool.tick(spare=False)  # no longer a spare: stopped
        assert launcher.proc is None
    finally:
        pool.close()
        del store
