"""Values outside trainguard.bounds against a real controller and a real agent.

One controller (node-bound agent tokens, api.max_nodes 3) and one sim agent reporting to it
serve every case. Each case sends what the red-team pass found breaking a daemon (integers
near 10**400 or past int64, non-finite or absurd timestamps, names that are empty, control
characters or 10k long, too many GPUs or labels, too many nodes, row ids past int64, job
specs with such values, heartbeat datagrams with them) and asserts the refusal (a 4xx naming
the field, or a heartbeat dropped and counted as out_of_bounds) and that nothing else moved:
the store holds nothing of it, both /metrics answer and pass `promtool check metrics`, and
both processes still serve.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import short_tmpdir, wait_for
from tests.integration.agent_proc import AgentProcess, cleanup, sample_value
from tests.integration.controller_proc import (
    OP,
    ControllerProcess,
    dbe_rules,
    start_controller,
    write_config,
)

TOKENS = {"node-1": "agent-node-1-token", "n1": "agent-n1-token", "n2": "agent-n2-token",
          "n3": "agent-n3-token"}  # fmt: skip
N1 = {"Authorization": f"Bearer {TOKENS['n1']}"}
HUGE = "1" + "0" * 400  # 10**400, written as JSON does
NOW = time.time()


@dataclass
class Rig:
    controller: ControllerProcess
    agent: AgentProcess
    db: Path
    known: tuple[str, ...] = ("n1", "node-1")  # the nodes registered by good reports

    def post_report(self, body: bytes | str, headers: dict[str, str] = N1) -> httpx.Response:
        raw = body.encode() if isinstance(body, str) else body
        return httpx.post(
            f"{self.controller.url}/v1/reports", content=raw, headers=headers, timeout=30
        )

    def rows(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10) as db:
            return db.execute(sql, args).fetchall()


def _promtool_clean(body: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is required in CI (Debian package 'prometheus')")
        pytest.skip("promtool not installed")
    check = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr


def report(node: str = "n1", **fields: Any) -> str:
    return json.dumps({"node": node, "instance": "i1", "seq": 1, "sent_at": NOW, **fields})


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    workdir = short_tmpdir("tgbi")
    config = write_config(workdir, rules=dbe_rules(), tick_interval_s=0.5, agent_tokens=TOKENS)
    text = config.read_text()
    config.write_text(text.replace("api: {", "api: {max_nodes: 3, ", 1))
    controller = start_controller(config, log_path=workdir / "controller.log")
    agent_dir = workdir / "agent"
    agent_dir.mkdir()
    token = agent_dir / "token"
    token.write_text(TOKENS["node-1"] + "\n")
    token.chmod(0o600)
    agent = None
    try:
        agent = AgentProcess(
            agent_dir, "--controller", controller.url, "--token-file", str(token),
            "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
        )  # fmt: skip
        rig = Rig(controller=controller, agent=agent, db=workdir / "c.db")
        assert rig.post_report(report()).status_code == 200
        wait_for(lambda: _node_names(rig) == ["n1", "node-1"], timeout_s=30, what="two nodes")
        yield rig
    finally:
        if agent is not None:
            agent.kill()
        controller.kill()
        cleanup(workdir)


def _node_names(rig: Rig) -> list[str]:
    r = httpx.get(f"{rig.controller.url}/v1/nodes", headers=OP, timeout=30)
    assert r.status_code == 200, r.text
    return sorted(n["name"] for n in r.json())


def _assert_intact(rig: Rig) -> None:
    """Nothing of the attack stored, both /metrics clean, both processes serving."""
    assert rig.controller.popen.poll() is None, rig.controller.log()
    assert rig.agent.proc.poll() is None, rig.agent.log()
    assert _node_names(rig) == sorted(rig.known)
    assert rig.rows("SELECT count(*) FROM events WHERE node = 'n1'") == [(0,)]
    assert sorted(r[0] for r in rig.rows("SELECT name FROM nodes")) == sorted(rig.known)
    m = httpx.get(f"{rig.controller.url}/metrics", timeout=30)
    assert m.status_code == 200
    _promtool_clean(m.text)
    body = rig.agent.metrics()
    assert "trainguard_agent_info" in body
    _promtool_clean(body)
    # a good report is still taken
    assert rig.post_report(report()).status_code == 200
    assert "Traceback" not in rig.controller.log()


GPU = {"index": 0, "uuid": "GPU-0", "pci_bus_id": "0000:18:00.0", "name": "H100"}
RANK = {"job": "demo", "rank": 0, "step": 1}
EVENT = {"id": 1, "kind": "xid", "ts": NOW, "code": 79}


def _with(raw: str, placeholder: str, value: str) -> str:
    """`raw` with the JSON string "`placeholder`" replaced by `value` written verbatim (JSON
    values Python's json cannot write: 10**400 as a literal, NaN, Infinity)."""
    return raw.replace(f'"{placeholder}"', value)


REPORT_CASES = [
    pytest.param(
        _with(report(ranks=[{**RANK, "step": "X"}]), "X", HUGE), "ranks[0].step", id="step-10e400"
    ),
    pytest.param(
        _with(report(ranks=[{**RANK, "ckpt_step": "X"}]), "X", HUGE),
        "ranks[0].ckpt_step",
        id="ckpt-step-10e400",
    ),
    pytest.param(report(ranks=[{**RANK, "step": 2**63}]), "ranks[0].step", id="step-2e63"),
    pytest.param(
        _with(report(gpus=[{**GPU, "ecc_uncorrected_volatile_total": "X"}]), "X", HUGE),
        "gpus[0].ecc_uncorrected_volatile_total",
        id="ecc-10e400",
    ),
    pytest.param(
        _with(report(events=[{**EVENT, "code": "X"}]), "X", HUGE),
        "events[0].code",
        id="event-code-10e400",
    ),
    pytest.param(
        report(events=[{**EVENT, "data": {"n": [2**64]}}]), "events[0].data.n", id="event-data-2e64"
    ),
    pytest.param(report(events=[{**EVENT, "ts": 1e308}]), "events[0].ts", id="event-ts-1e308"),
    pytest.param(
        report(events=[{**EVENT, "ts": -1e308}]), "events[0].ts", id="event-ts-minus-1e308"
    ),
    pytest.param(
        report(events=[{**EVENT, "ts": "Infinity"}]), "events[0].ts", id="event-ts-infinity"
    ),
    pytest.param(
        _with(report(events=[{**EVENT, "ts": "X"}]), "X", "NaN"), "events[0].ts", id="event-ts-nan"
    ),
    pytest.param(report(node=""), "node", id="node-empty"),
    pytest.param(report(node=" "), "node", id="node-space"),
    pytest.param(report(node="\u0000"), "node", id="node-nul"),
    pytest.param(report(node="n1\nevent=forged node=n9"), "node", id="node-newline"),
    pytest.param(report(node="n" * 10_000), "node", id="node-10k"),
    pytest.param(report(ranks=[{**RANK, "job": "a\nb"}]), "ranks[0].job", id="job-newline"),
    pytest.param(report(gpus=[{**GPU, "index": i} for i in range(65)]), "gpus", id="65-gpus"),
    pytest.param(report(labels={f"k{i}": "v" for i in range(65)}), "labels", id="65-labels"),
]


@pytest.mark.parametrize(("body", "field"), REPORT_CASES)
def test_a_report_outside_the_bounds_is_a_422_naming_the_field(
    rig: Rig, body: str, field: str
) -> None:
    r = rig.post_report(body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["field"] == field
    assert len(r.text) < 1000  # the offending value is never echoed whole
    _assert_intact(rig)


def test_a_new_node_beyond_max_nodes_is_refused_naming_the_limit(rig: Rig) -> None:
    n2 = {"Authorization": f"Bearer {TOKENS['n2']}"}
    assert rig.post_report(report(node="n2"), n2).status_code == 200
    rig.known = (*rig.known, "n2")  # the third of api.max_nodes: 3
    n3 = {"Authorization": f"Bearer {TOKENS['n3']}"}
    r = rig.post_report(report(node="n3"), n3)
    assert r.status_code == 403, r.text
    assert "api.max_nodes is 3" in r.json()["error"]
    # registered nodes report on
    assert rig.post_report(report(node="n2"), n2).status_code == 200
    _assert_intact(rig)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        pytest.param("GET", "/v1/incidents/9223372036854775808", 422, id="incident-2e63"),
        pytest.param("GET", "/v1/incidents/" + "9" * 400, 422, id="incident-400-digits"),
        pytest.param("GET", "/v1/incidents/0", 422, id="incident-zero"),
        pytest.param("GET", "/v1/incidents/-1", 422, id="incident-negative"),
        pytest.param("GET", "/v1/incidents/9223372036854775807", 404, id="incident-int64-max"),
        pytest.param("DELETE", "/v1/silences/9223372036854775808", 422, id="silence-2e63"),
        pytest.param("GET", "/v1/nodes/%0Aforged", 404, id="node-newline"),
        pytest.param("GET", "/v1/jobs/" + "j" * 5000, 404, id="job-5k"),
    ],
)
def test_path_ids_outside_int64_are_4xx(rig: Rig, method: str, path: str, status: int) -> None:
    r = httpx.request(method, f"{rig.controller.url}{path}", headers=OP, timeout=30)
    assert r.status_code == status, r.text
    _assert_intact(rig)


JOB = {"name": "demo-job", "command": ["python", "train.py"], "nodes": ["n1"]}


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        pytest.param({**JOB, "nproc_per_node": 2**63}, "nproc_per_node", id="nproc-2e63"),
        pytest.param({**JOB, "nproc_per_node": 5000}, "nproc_per_node", id="nproc-5000"),
        pytest.param({**JOB, "max_restarts": 10**30}, "max_restarts", id="max-restarts-10e30"),
        pytest.param({**JOB, "rdzv_port": -(2**64)}, "rdzv_port", id="rdzv-port"),
        pytest.param({**JOB, "name": "a b"}, "name", id="name-space"),
        pytest.param({**JOB, "name": "x\ny"}, "name", id="name-newline"),
        pytest.param({**JOB, "name": "j" * 200}, "name", id="name-200"),
        pytest.param({**JOB, "nodes": [""]}, "nodes[0]", id="node-empty"),
        pytest.param({**JOB, "spare_wait_s": "Infinity"}, "spare_wait_s", id="spare-wait-inf"),
    ],
)
def test_a_job_spec_outside_the_bounds_is_a_422_naming_the_field(
    rig: Rig, spec: dict[str, Any], field: str
) -> None:
    r = httpx.post(f"{rig.controller.url}/v1/jobs", json=spec, headers=OP, timeout=30)
    assert r.status_code == 422, r.text
    assert r.json()["detail"]["field"] == field
    jobs = httpx.get(f"{rig.controller.url}/v1/jobs", headers=OP, timeout=30)
    assert jobs.status_code == 200 and jobs.json() == [], jobs.text
    _assert_intact(rig)


HEARTBEATS = [
    pytest.param(
        _with(json.dumps({"job": "demo", "rank": 0, "step": "X", "t": NOW}), "X", HUGE),
        id="step-10e400",
    ),
    pytest.param(
        json.dumps({"job": "demo", "rank": 0, "step": 1, "t": NOW, "ckpt_step": 2**63}),
        id="ckpt-step-2e63",
    ),
    pytest.param(json.dumps({"job": "", "rank": 0, "step": 1, "t": NOW}), id="job-empty"),
    pytest.param(json.dumps({"job": "de\nmo", "rank": 0, "step": 1, "t": NOW}), id="job-newline"),
    pytest.param(json.dumps({"job": "j" * 1000, "rank": 0, "step": 1, "t": NOW}), id="job-1000"),
    pytest.param(
        json.dumps({"job": "demo", "rank": 0, "step": 1, "t": "Infinity"}), id="t-infinity"
    ),
    pytest.param(json.dumps({"job": "demo", "rank": 0, "step": 1, "t": 1e308}), id="t-1e308"),
    pytest.param(
        json.dumps({"job": "demo", "rank": 0, "step": 1, "t": NOW, "tokens_per_s": "Infinity"}),
        id="tokens-per-s-inf",
    ),
]


@pytest.mark.parametrize("datagram", HEARTBEATS)
def test_a_heartbeat_outside_the_bounds_is_dropped_and_counted(rig: Rig, datagram: str) -> None:
    def dropped() -> float:
        v = sample_value(
            rig.agent.metrics(),
            "trainguard_agent_heartbeats_dropped_total",
            node="node-1",
            reason="out_of_bounds",
        )
        return v or 0.0

    before = dropped()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(datagram.encode(), str(rig.agent.socket_path))
    wait_for(lambda: dropped() == before + 1, timeout_s=30, what="the datagram counted")
    body = rig.agent.metrics()
    assert sample_value(body, "trainguard_trainer_step", node="node-1", job="demo") is None
    # the controller saw no job from it
    jobs = httpx.get(f"{rig.controller.url}/v1/jobs", headers=OP, timeout=30)
    assert jobs.status_code == 200 and jobs.json() == [], jobs.text
    _assert_intact(rig)
