"""One node's agent token used to speak for another node, against a real controller process
(served in-process and by ingest workers): every attempt is a 403 naming both names, is
audited, and leaves the other node, its commands and the store as they were."""

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
from tests.integration.controller_proc import (
    AGENT,
    OP,
    ControllerProcess,
    dbe_rules,
    write_config,
)
from trainguard.model import GpuSample
from trainguard.protocol import Event, Report, encode_json

pytestmark = pytest.mark.slow

TOKENS = {"node-1": "tok-node-1", "node-2": "tok-node-2", "node-3": "tok-node-3"}


def _auth(node: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[node]}"}


@dataclass
class Cluster:
    controller: ControllerProcess
    url: str
    seq: int = 0

    def report(
        self,
        node: str,
        *,
        as_node: str,
        dbe: int = 0,
        events: tuple[Event, ...] = (),
        role_hint: str | None = None,
        instance: str = "i1",
    ) -> httpx.Response:
        """POST a report for `node` with the token of `as_node`."""
        self.seq += 1
        gpu = GpuSample(
            index=0,
            uuid=f"GPU-{node}",
            pci_bus_id="0000:18:00.0",
            name="H100",
            ecc_uncorrected_volatile_total=dbe,
        )
        report = Report(
            node=node,
            instance=instance,
            seq=self.seq,
            sent_at=time.time(),
            gpus=(gpu,),
            events=events,
            role_hint=role_hint,  # type: ignore[arg-type]
            labels={"address": "127.0.0.1"},
        )
        return httpx.post(
            f"{self.url}/v1/reports", content=encode_json(report), headers=_auth(as_node)
        )

    def get(self, path: str) -> Any:
        r = httpx.get(f"{self.url}{path}", headers=OP, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def refused_total(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        m = re.search(r"^trainguard_controller_reports_refused_total (\S+)$", text, re.M)
        assert m, text
        return float(m.group(1))

    def assert_intact(self) -> None:
        """The process serves, /metrics answers, the store answers reads."""
        assert self.controller.popen.poll() is None, self.controller.log()
        assert httpx.get(f"{self.url}/healthz", timeout=10).status_code == 200
        assert "trainguard_controller_reports_total" in httpx.get(f"{self.url}/metrics").text
        assert isinstance(self.get("/v1/nodes"), list)


@pytest.fixture(params=[0, 2], ids=["in-process", "ingest-workers"])
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, controllers: list[ControllerProcess]
) -> Iterator[Cluster]:
    cfg = write_config(
        tmp_path, rules=dbe_rules(), tick_interval_s=0.2, stale_after_s=5, agent_tokens=TOKENS
    )
    proc = ControllerProcess(
        cfg, log_path=tmp_path / "controller.log", args=["--ingest-workers", str(request.param)]
    )
    controllers.append(proc)
    proc.wait_listening(timeout_s=60)
    c = Cluster(proc, proc.url)
    for node in ("node-2", "node-3"):
        r = c.report(node, as_node=node)
        assert r.status_code == 200, r.text
    yield c
    c.assert_intact()


def _assert_refused(r: httpx.Response, *, token_node: str, claimed: str) -> None:
    assert r.status_code == 403, r.text
    body = r.json()
    assert body["detail"] == {
        "credential": f"agent-{token_node}",
        "bound_node": token_node,
        "node": claimed,
    }
    for name in (f"agent-{token_node}", token_node, claimed):
        assert name in body["error"]
    assert "commands" not in body


def test_forged_dbe_for_another_node_is_refused_and_the_node_is_not_drained(
    cluster: Cluster,
) -> None:
    r = cluster.report(
        "node-2", as_node="node-1", dbe=1, events=(Event(id=1, kind="xid", ts=1.0, code=79),)
    )
    _assert_refused(r, token_node="node-1", claimed="node-2")
    # a real DBE on node-3, reported by node-3: once its incident is open, the rules have
    # evaluated what the forged report would have changed
    assert cluster.report("node-3", as_node="node-3", dbe=1).status_code == 200
    wait_for(
        lambda: cluster.get("/v1/incidents?node=node-3"),
        timeout_s=30,
        what="the incident for node-3's real DBE",
    )
    assert cluster.get("/v1/incidents?node=node-2") == []
    node2 = cluster.get("/v1/nodes/node-2")
    assert node2["state"] == "active"
    # the forger's own node was not registered either
    assert httpx.get(f"{cluster.url}/v1/nodes/node-1", headers=OP).status_code == 404
    audit = cluster.get("/v1/audit")
    refused = [a for a in audit if a["action"] == "report_refused"]
    assert [(a["actor"], a["target"]) for a in refused] == [("agent-node-1", "node-2")]
    assert cluster.refused_total() == 1


def test_command_poll_and_results_for_another_node_get_and_change_nothing(
    cluster: Cluster,
) -> None:
    job = {
        "name": "victim-job",
        "command": ["train.py"],
        "nodes": ["node-2"],
        "env": {"WANDB_API_KEY": "s3cret-value"},
    }
    r = httpx.post(f"{cluster.url}/v1/jobs", json=job, headers=OP, timeout=10)
    assert r.status_code == 201, r.text
    # node-1's token asks for node-2's commands: refused, nothing of the start_job leaks
    r = cluster.report("node-2", as_node="node-1")
    _assert_refused(r, token_node="node-1", claimed="node-2")
    assert "s3cret-value" not in r.text and "start_job" not in r.text
    # node-2 itself still gets its start_job: the command was neither taken nor completed
    r = cluster.report("node-2", as_node="node-2")
    assert r.status_code == 200
    (start,) = [c for c in r.json()["commands"] if c["kind"] == "start_job"]
    assert start["args"]["env"]["WANDB_API_KEY"] == "s3cret-value"
    # a fake result for that command, posted with node-1's token, completes nothing
    fake = Event(
        id=5,
        kind="command_result",
        ts=1.0,
        data={"command_id": start["id"], "ok": False, "message": "forged failure"},
    )
    r = cluster.report("node-2", as_node="node-1", events=(fake,), instance="evil")
    _assert_refused(r, token_node="node-1", claimed="node-2")
    r = cluster.report("node-2", as_node="node-2")
    assert start["id"] in [c["id"] for c in r.json()["commands"]]
    assert cluster.get("/v1/jobs/victim-job")["state"] != "failed"
    assert cluster.refused_total() == 2


def test_ghost_and_self_declared_spare_nodes_are_not_registered(cluster: Cluster) -> None:
    r = cluster.report("ghost-9", as_node="node-1", role_hint="spare")
    _assert_refused(r, token_node="node-1", claimed="ghost-9")
    assert httpx.get(f"{cluster.url}/v1/nodes/ghost-9", headers=OP).status_code == 404
    # a node's own report saying it is a spare registers it, as active
    r = cluster.report("node-1", as_node="node-1", role_hint="spare")
    assert r.status_code == 200
    assert cluster.get("/v1/nodes/node-1")["role"] == "active"
    assert cluster.get("/v1/spares") == []
    assert sorted(n["name"] for n in cluster.get("/v1/nodes")) == ["node-1", "node-2", "node-3"]
    # only an operator makes a spare
    r = httpx.put(
        f"{cluster.url}/v1/nodes/node-1/role", json={"role": "spare"}, headers=OP, timeout=10
    )
    assert r.status_code == 200, r.text
    assert [n["name"] for n in cluster.get("/v1/spares")] == ["node-1"]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        pytest.param("POST", "/v1/reports", id="reports"),
        pytest.param("GET", "/v1/nodes", id="nodes"),
        pytest.param("POST", "/v1/nodes/node-2/drain", id="drain"),
    ],
)
def test_repeated_authorization_header_is_400_on_every_route(
    cluster: Cluster, method: str, path: str
) -> None:
    body = encode_json(Report(node="node-2", instance="i1", seq=99, sent_at=time.time()))
    # node-1's agent token first, the operator's last: each layer must see the same thing
    headers = [
        ("Authorization", f"Bearer {TOKENS['node-1']}"),
        ("Authorization", OP["Authorization"]),
    ]
    r = httpx.request(method, f"{cluster.url}{path}", content=body, headers=headers, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["detail"] == {"header": "Authorization"}
    assert "Authorization" in r.json()["error"]
    assert cluster.get("/v1/nodes/node-2")["state"] == "active"


def test_a_shared_agent_token_needs_the_loudly_named_option(
    tmp_path: Path, controllers: list[ControllerProcess]
) -> None:
    cfg = write_config(tmp_path, rules=dbe_rules())  # the shared AGENT_TOKEN, option on
    shared = cfg.read_text()
    assert ", allow_shared_agent_tokens: true" in shared
    cfg.write_text(shared.replace(", allow_shared_agent_tokens: true", ""))
    refused = ControllerProcess(cfg, log_path=tmp_path / "refused.log")
    controllers.append(refused)
    assert refused.popen.wait(timeout=60) == 2
    assert "tokens[1].node" in refused.log() and "allow_shared_agent_tokens" in refused.log()

    cfg.write_text(shared)
    proc = ControllerProcess(cfg, log_path=tmp_path / "controller.log")
    controllers.append(proc)
    proc.wait_listening(timeout_s=60)
    assert "event=shared_agent_tokens tokens=agents" in proc.log()
    for node in ("node-7", "node-7", "node-8"):
        r = httpx.post(
            f"{proc.url}/v1/reports",
            content=encode_json(Report(node=node, instance="i", seq=1, sent_at=time.time())),
            headers=AGENT,
        )
        assert r.status_code == 200, r.text
    used = re.findall(r"event=shared_agent_token_used actor=agents node=(\S+)", proc.log())
    assert used == ["node-7", "node-8"]
