"""PostgreSQL lost while the controllers run, on real processes: a PostgreSQL server of this
module's own, two controllers (ha.enabled, a 3 s lease, store.page_after_s 1), sim agents
given both URLs, a webhook channel. The server is shut down at once (immediate shutdown,
as in a crash) and started again.

While it is gone: the leader steps down (neither controller leads), both say so in
/metrics, each pages the channel once; both keep answering the reads they answered before
(nodes, incidents, an incident's detail) from memory and /metrics, a read they never
answered and every write get 503 with Retry-After; a DBE that strikes meanwhile is refused
by both (the agent keeps it), so nothing acts on it. When the server is back: a controller
leads under a new epoch, the pages are resolved, the DBE is remediated once (the node
drained by one incident's one drain).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.chaos import now
from tests.e2e.ha_cluster import NAMES, HaCluster
from tests.e2e.test_e2e_crash import Hook, agent_metric, sample_value, write_rules
from tests.integration.postgres_proc import PgServer, start_postgres
from trainguard.devkit.devcluster import ClusterConfig

pytestmark = pytest.mark.slow

LEASE_S = 3.0
PAGE_RULE = "controller_store_unreachable"


@dataclass
class Outage:
    cluster: HaCluster
    server: PgServer
    hook: Hook


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outage]:
    base = Path(tmp_path_factory.mktemp("outage"))
    rules_file = base / "rules.yaml"
    write_rules(rules_file)
    server = start_postgres()  # this module's own: it is shut down and started again
    hook = Hook()
    config = ClusterConfig(
        active=("node-1", "node-2", "node-3"),
        spares=("spare-1",),
        rules=(str(rules_file),),
        safety={"drain_budget": 100, "breaker_threshold": 100},
        # the sick node stays drained, as these checks expect: the node lifecycle after a
        # drain (lifecycle.auto_repair) is test_e2e_chaos.py's and the unit tests'
        lifecycle={"auto_repair": False},
    )
    try:
        with HaCluster(
            base / "cluster",
            config,
            store_url=server.url(server.new_database()),
            lease_s=LEASE_S,
            extra={
                "notify": {"webhooks": [{"name": "hook", "url": hook.url}]},
                "store": {"page_after_s": 1},
            },
        ) as cluster:
            cluster.start()
            yield Outage(cluster, server, hook)
        assert cluster.leftover_pids() == set()
    finally:
        hook.close()
        server.stop()


def metric(c: HaCluster, name: str, sample: str) -> float | None:
    try:
        body = httpx.get(f"{c.controller_url(name)}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    return sample_value(body, sample)


def pages(hook: Hook, event: str) -> dict[str, dict[str, Any]]:
    """target -> the delivery of each store page of `event` the hook received."""
    return {
        d["incident"]["target"]: d
        for d in list(hook.deliveries)
        if d["incident"]["rule"] == PAGE_RULE and d["event"] == event
    }


def reads(c: HaCluster, name: str, incident_id: int) -> dict[str, Any]:
    """What controller `name` answers to the reads an operator makes (200s only)."""
    client = c._client_of(name)
    out: dict[str, Any] = {}
    for key, path in (
        ("incidents", "/v1/incidents?limit=100"),
        ("nodes", "/v1/nodes"),
        ("incident", f"/v1/incidents/{incident_id}"),
    ):
        r = client.get(path)
        assert r.status_code == 200, (name, path, r.status_code, r.text)
        out[key] = r.json()
    return out


def drained_by(c: HaCluster, node: str, since: float) -> list[int]:
    """Ids of the incidents opened since `since` whose drain of `node` succeeded."""
    out = []
    for inc in c.incidents():
        if inc["opened_at"] < since - 1 or inc["node"] != node:
            continue
        detail = c.incident(inc["id"])
        if any(a["kind"] == "drain" and a["state"] == "succeeded" for a in detail["actions"]):
            out.append(inc["id"])
    return out


def test_postgresql_lost_while_running_steps_down_pages_serves_reads_and_resumes(
    outage: Outage,
) -> None:
    c, server, hook = outage.cluster, outage.server, outage.hook
    leader = c.wait_leader()
    lease = c.lease(leader)
    assert lease is not None
    epoch = lease[1]

    # before: an incident to read back (a DBE on node-1, drained), asked of both controllers
    t0 = now()
    c.inject("node-1", "dbe", gpu=1)
    c.wait(lambda: drained_by(c, "node-1", t0), timeout_s=60, what="node-1's DBE remediated")
    incident_id = drained_by(c, "node-1", t0)[0]

    def lists_every_node(name: str) -> bool:
        r = c._client_of(name).get("/v1/nodes")
        return r.status_code == 200 and {n["name"] for n in r.json()} == set(c.agents)

    # a standby's node list follows the store a round behind the leader
    c.wait(
        lambda: all(lists_every_node(n) for n in NAMES),
        timeout_s=30,
        what="both controllers to list every node",
    )
    before = {name: reads(c, name, incident_id) for name in NAMES}

    server.kill()
    down_at = now()
    c.wait(
        lambda: all(metric(c, n, "trainguard_controller_store_up") == 0 for n in NAMES),
        timeout_s=30,
        what="both controllers to report the store down",
    )
    c.wait(
        lambda: all((s := c.lease(n)) is not None and not s[0] for n in NAMES),
        timeout_s=30,
        what="the leader to step down",
    )
    assert c.log_events(leader, "leader_stepped_down"), c.controller_log(leader)[-3000:]
    instances = {f"controller:{c.controller_url(n).split('://', 1)[1]}" for n in NAMES}
    c.wait(
        lambda: set(pages(hook, "trigger")) == instances,
        timeout_s=30,
        what="a page from each controller",
    )
    for page in pages(hook, "trigger").values():
        assert page["page"] is True
        assert page["incident"]["severity"] == "critical"
        assert "cannot reach its store" in page["incident"]["summary"]
        assert "pg-test-secret" not in str(page)

    # reads go on from memory; a read never answered and every write get 503
    for name in NAMES:
        got = reads(c, name, incident_id)
        assert [i["id"] for i in got["incidents"]] == [i["id"] for i in before[name]["incidents"]]
        assert [n["name"] for n in got["nodes"]] == [n["name"] for n in before[name]["nodes"]]
        assert got["incident"]["incident"] == before[name]["incident"]["incident"]
        client = c._client_of(name)
        assert client.get("/metrics").status_code == 200
        fresh = client.get("/v1/incidents?limit=7")
        assert fresh.status_code == 503, fresh.text
        assert "store" in fresh.json()["error"] and fresh.headers["Retry-After"]
        write = client.post("/v1/nodes/node-3/drain", json={"reason": "during the outage"})
        assert write.status_code == 503, write.text
        assert write.headers["Retry-After"]

    # a DBE while the store is gone: refused by both controllers, kept by the agent
    refused = agent_metric(c, "node-2", "trainguard_agent_reports_total", result="error") or 0
    c.inject("node-2", "dbe", gpu=1)
    c.wait(
        lambda: (
            (agent_metric(c, "node-2", "trainguard_agent_reports_total", result="error") or 0)
            >= refused + 3
            and (agent_metric(c, "node-2", "trainguard_agent_spool_events") or 0) >= 1
        ),
        timeout_s=60,
        what="node-2's reports carrying the DBE to be refused three times",
    )
    assert all((s := c.lease(n)) is not None and not s[0] for n in NAMES)
    for name in NAMES:  # nothing acted on it: node-2 still active, as each knows it
        r = c._client_of(name).get("/v1/nodes/node-2")
        assert r.status_code == 200 and r.json()["state"] == "active", r.text

    server.restart()
    back = c.wait(
        lambda: (n := c.leader()) is not None and (s := c.lease(n)) is not None and s[1] > epoch,
        timeout_s=60,
        what="a leader under a new epoch",
    )
    assert back
    c.wait(
        lambda: all(metric(c, n, "trainguard_controller_store_up") == 1 for n in NAMES),
        timeout_s=30,
        what="both controllers to report the store back",
    )
    c.wait(
        lambda: set(pages(hook, "resolve")) == instances,
        timeout_s=30,
        what="each controller's page resolved",
    )
    c.wait(
        lambda: c.node("node-2")["state"] == "drained",
        timeout_s=60,
        what="node-2's DBE remediated once the store is back",
    )
    assert len(drained_by(c, "node-2", down_at)) == 1
    assert c.node("node-3")["state"] == "active"  # the write refused during the outage
    for name in NAMES:
        assert "Traceback" not in c.controller_log(name), c.controller_log(name)[-3000:]
