"""One node floods the controller with job names: each report names 1,024 jobs never seen
before, against a real controller process. The node's budget of unknown job names bounds
what the controller keeps: its memory stays flat, GET /v1/jobs stays small and fast, another
node's reports keep succeeding and it is never declared silent; the flood's names expire."""

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
from trainguard.model import GpuSample
from trainguard.protocol import JobProcess, RankState, Report, encode_json

pytestmark = pytest.mark.slow

TOKENS = {"node-1": "tok-node-1", "node-2": "tok-node-2"}
PER_NODE = 16
EXPIRE_S = 4.0
RULES = """
rules:
  - name: node_silent
    scope: node
    condition: report_age_s > 5 and role == "active" and state == "active"
    for: 0s
    severity: critical
    actions: [notify]
    summary: node agent silent
"""


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@dataclass
class Rig:
    proc: ControllerProcess
    url: str
    seq: int = 0

    def report(self, node: str, *, jobs: list[str]) -> httpx.Response:
        self.seq += 1
        report = Report(
            node=node,
            instance="i1",
            seq=self.seq,
            sent_at=time.time(),
            gpus=(GpuSample(index=0, uuid=f"GPU-{node}", pci_bus_id="0000:18:00.0", name="H100"),),
            ranks=tuple(RankState(job=j, rank=0, step=self.seq) for j in jobs),
            jobs=tuple(
                JobProcess(job=j, attempt=1, state="running", pid=100 + i)
                for i, j in enumerate(jobs[:256])
            ),
            labels={"address": "127.0.0.1"},
        )
        return httpx.post(
            f"{self.url}/v1/reports",
            content=encode_json(report),
            headers={"Authorization": f"Bearer {TOKENS[node]}"},
            timeout=30,
        )

    def get(self, path: str) -> Any:
        r = httpx.get(f"{self.url}{path}", headers=OP, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture
def rig(tmp_path: Path, controllers: list[ControllerProcess]) -> Iterator[Rig]:
    cfg = write_config(tmp_path, rules=RULES, tick_interval_s=0.2, agent_tokens=TOKENS)
    text = cfg.read_text().replace(
        "api: {",
        f"api: {{max_unknown_jobs_per_node: {PER_NODE}, unknown_job_expire_s: {EXPIRE_S}, ",
        1,
    )
    cfg.write_text(text)
    proc = ControllerProcess(cfg, log_path=tmp_path / "controller.log")
    controllers.append(proc)
    proc.wait_listening(timeout_s=60)
    yield Rig(proc, proc.url)
    assert proc.popen.poll() is None, proc.log()


def test_a_node_flooding_job_names_cannot_grow_the_controller(rig: Rig) -> None:
    assert rig.report("node-2", jobs=["steady"]).status_code == 200
    assert rig.report("node-1", jobs=[f"warmup-{i}" for i in range(1024)]).status_code == 200
    rss_before = _rss_bytes(rig.proc.popen.pid)
    slowest_s = 0.0
    for i in range(60):
        r = rig.report("node-1", jobs=[f"flood-{i}-{k}" for k in range(1024)])
        assert r.status_code == 200, r.text
        started = time.monotonic()
        r = rig.report("node-2", jobs=["steady"])
        slowest_s = max(slowest_s, time.monotonic() - started)
        assert r.status_code == 200, r.text
    grown_mb = (_rss_bytes(rig.proc.popen.pid) - rss_before) / 2**20
    # 61,440 names refused: the controller keeps the node's 16, not the flood
    assert grown_mb < 64, f"RSS grew {grown_mb:.0f} MB under the flood"
    assert slowest_s < 2.0, f"node-2's slowest report took {slowest_s:.2f} s"
    started = time.monotonic()
    jobs = rig.get("/v1/jobs")
    assert time.monotonic() - started < 2.0
    assert len(jobs) <= PER_NODE + 1 and "steady" in {j["name"] for j in jobs}
    metrics = httpx.get(f"{rig.url}/metrics", timeout=10).text
    m = re.search(
        r'^trainguard_controller_job_names_refused_total\{reason="node_budget"\} (\S+)$',
        metrics,
        re.M,
    )
    assert m and float(m.group(1)) >= 60 * 1024 - PER_NODE, metrics
    audited = [a for a in rig.get("/v1/audit") if a["action"] == "job_names_refused"]
    assert 1 <= len(audited) <= 2 and audited[0]["target"] == "node-1"

    # the flood stops; node-2 goes on: the flood's names expire, node-2 is never silent
    def only_steady() -> bool:
        assert rig.report("node-2", jobs=["steady"]).status_code == 200
        return [j["name"] for j in rig.get("/v1/jobs")] == ["steady"]

    wait_for(
        only_steady, timeout_s=EXPIRE_S + 20, what="the flood's names to expire", interval_s=0.5
    )
    silent = [i for i in rig.get("/v1/incidents") if i["rule"] == "node_silent"]
    assert not [i for i in silent if i["node"] == "node-2"], silent
