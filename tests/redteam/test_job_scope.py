"""A node acting on another node's job, against a real controller process (served in-process
and by ingest workers): node-2, with its own correctly bound token, reports job exits, a NaN
far past the checkpoint and an absurd checkpoint step for `victim`, a job that runs on node-1
only. Each item is refused, counted by reason and audited; the job neither crashes, nor
restarts, nor rolls back, nor takes the forged checkpoint step."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.controller_proc import OP, ControllerProcess, write_config
from trainguard.protocol import Event, JobProcess, RankState, Report, encode_json

pytestmark = pytest.mark.slow

TOKENS = {"node-1": "tok-node-1", "node-2": "tok-node-2"}
RULES = """
rules:
  - name: job_process_failed
    scope: job
    condition: state == "crashed"
    severity: critical
    actions: [notify, restart]
    summary: training process exited unexpectedly
  - name: nan_loss
    scope: rank
    condition: nan_total > 0
    severity: critical
    actions: [notify, rollback]
    summary: NaN loss
"""


@dataclass
class Cluster:
    controller: ControllerProcess
    url: str
    seq: int = 0
    event_id: int = 0

    def report(
        self,
        node: str,
        *,
        ranks: tuple[RankState, ...] = (),
        jobs: tuple[JobProcess, ...] = (),
        events: tuple[Event, ...] = (),
    ) -> httpx.Response:
        """POST a report for `node` with its own token."""
        self.seq += 1
        report = Report(
            node=node,
            instance=f"{node}-i",
            seq=self.seq,
            sent_at=time.time(),
            ranks=ranks,
            jobs=jobs,
            events=events,
            labels={"address": "127.0.0.1"},
        )
        r = httpx.post(
            f"{self.url}/v1/reports",
            content=encode_json(report),
            headers={"Authorization": f"Bearer {TOKENS[node]}"},
            timeout=10,
        )
        assert r.status_code == 200, r.text
        return r

    def event(self, kind: str, **kw: Any) -> Event:
        self.event_id += 1
        return Event(id=self.event_id, kind=kind, ts=time.time(), **kw)

    def get(self, path: str) -> Any:
        r = httpx.get(f"{self.url}{path}", headers=OP, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def refused(self, reason: str) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        m = re.search(
            rf'^trainguard_controller_report_items_refused_total\{{reason="{reason}"\}} (\S+)$',
            text,
            re.M,
        )
        return float(m.group(1)) if m else 0.0


@pytest.fixture(params=[0, 2], ids=["in-process", "ingest-workers"])
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, controllers: list[ControllerProcess]
) -> Iterator[Cluster]:
    cfg = write_config(tmp_path, rules=RULES, tick_interval_s=0.2, agent_tokens=TOKENS)
    proc = ControllerProcess(
        cfg, log_path=tmp_path / "controller.log", args=["--ingest-workers", str(request.param)]
    )
    controllers.append(proc)
    proc.wait_listening(timeout_s=60)
    c = Cluster(proc, proc.url)
    c.report("node-1")
    c.report("node-2")
    yield c
    assert proc.popen.poll() is None, proc.log()


def _train(c: Cluster, *, step: int) -> None:
    """node-1, the victim's own node, reports its rank training at `step`."""
    c.report(
        "node-1",
        jobs=(JobProcess(job="victim", attempt=1, state="running", pid=4242),),
        ranks=(RankState(job="victim", rank=0, step=step, pid=4242, loss=1.0, ckpt_step=100),),
    )


def test_a_node_outside_the_job_cannot_crash_roll_back_or_poison_it(cluster: Cluster) -> None:
    job = {"name": "victim", "command": ["train.py"], "nodes": ["node-1"], "max_restarts": 2}
    r = httpx.post(f"{cluster.url}/v1/jobs", json=job, headers=OP, timeout=10)
    assert r.status_code == 201, r.text
    step = 100
    wait_for(
        lambda: _train(cluster, step=step) or cluster.get("/v1/jobs/victim")["state"] == "running",
        timeout_s=30,
        what="victim running on node-1",
    )
    for _ in range(10):  # a few seconds of real progress: the job's step rate is known
        step += 5
        _train(cluster, step=step)
        time.sleep(0.2)

    # node-2 (its own token) speaks about victim: three crashes of the current attempt,
    # a NaN 12,800 steps past the checkpoint, and a checkpoint step of 10^15
    for _ in range(3):
        cluster.report(
            "node-2",
            events=(cluster.event("job_exit", job="victim", code=1, data={"attempt": 1}),),
        )
        _train(cluster, step=step)
        time.sleep(0.5)
    cluster.report(
        "node-2",
        events=(cluster.event("nan_loss", job="victim", rank=0, data={"step": 100 + 12_800}),),
    )
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        cluster.report(
            "node-2", ranks=(RankState(job="victim", rank=0, step=10**15, ckpt_step=10**15),)
        )
        step += 1
        _train(cluster, step=step)
        time.sleep(0.2)
    # node-1 itself claims a NaN far past where its job can be: refused as implausible
    cluster.report(
        "node-1",
        events=(cluster.event("nan_loss", job="victim", rank=0, data={"step": step + 12_800}),),
    )
    time.sleep(1.0)  # a few ticks

    victim = cluster.get("/v1/jobs/victim")
    assert (victim["state"], victim["attempt"], victim["restarts"]) == ("running", 1, 0)
    assert victim["ckpt_step"] == 100 and victim["last_step"] < 10**6
    assert cluster.get("/v1/incidents") == []
    assert cluster.refused("node_not_in_job") >= 3 + 1 + 1
    assert cluster.refused("step_implausible") == 1
    audit = [a for a in cluster.get("/v1/audit") if a["action"] == "report_item_refused"]
    by = {(a["actor"], a["detail"]["reason"]) for a in audit}
    assert by == {("agent-node-2", "node_not_in_job"), ("agent-node-1", "step_implausible")}
    assert all(a["target"] == "victim" for a in audit)
    assert "event=report_item_refused" in cluster.controller.log()
