"""Two real controller processes with ingest workers (`api.ingest_workers: 2`) on one real
PostgreSQL store (ha.enabled): every request reaches a core through one of its workers. The
standby answers a report (from a node's own agent token) and a forwarded API write 503 naming
the leader, the leader ingests; kill -9 of the leader and the standby takes over and ingests
through its own workers. One pair of controllers for the module; every wait is on a
condition."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.helpers import alive, free_port, wait_for
from tests.integration.controller_proc import (
    OP,
    ControllerProcess,
    dbe_rules,
    start_controller,
    write_config,
)
from tests.integration.postgres_proc import PgServer
from trainguard.leader import LEADER_HEADER
from trainguard.protocol import Report, encode_json

pytestmark = pytest.mark.slow

WORKERS = 2
LEASE_S = 2.0
TAKEOVER_S = 60.0  # a bound for the waits, not a measured figure
TOKENS = {"n1": "n1-token", "n2": "n2-token"}  # one agent token bound to each node


@dataclass
class Pair:
    leader: ControllerProcess
    standby: ControllerProcess


def _start(directory: Path, *, url: str) -> ControllerProcess:
    directory.mkdir()
    port = free_port()
    advertise = f"http://127.0.0.1:{port}"
    cfg = write_config(
        directory,
        rules=dbe_rules(("drain",)),
        tick_interval_s=0.2,
        stale_after_s=30,
        store={"url": url},
        agent_tokens=TOKENS,
        extra_yaml=(
            f"ha: {{enabled: true, advertise_url: '{advertise}', lease_s: {LEASE_S},"
            " renew_interval_s: 0.4}\n"
        ),
    )
    text = cfg.read_text().replace("port: 0,", f"port: {port}, ingest_workers: {WORKERS},")
    cfg.write_text(text)
    proc = start_controller(
        cfg,
        log_path=directory / "controller.log",
        timeout_s=60,
        what="the controller and its workers to listen",
    )
    assert proc.url == advertise
    return proc


def _worker_pids(proc: ControllerProcess) -> dict[int, int]:
    """worker index -> pid of the latest worker of `proc` that said it was ready."""
    found = re.findall(r"event=ingest_worker_ready worker=(\d+) pid=(\d+)", proc.log())
    return {int(w): int(pid) for w, pid in found}


def _stop(proc: ControllerProcess) -> None:
    """kill -9 of the controller and of any of its workers still running."""
    proc.kill()
    for pid in _worker_pids(proc).values():
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _leads(proc: ControllerProcess, epoch: int) -> bool:
    return f"event=leader epoch={epoch} " in proc.log()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory, pg_server: PgServer) -> Iterator[Pair]:
    database = pg_server.new_database()
    url = pg_server.url(database)
    tmp = tmp_path_factory.mktemp("ha-workers")
    started: list[ControllerProcess] = []
    try:
        a = _start(tmp / "a", url=url)
        started.append(a)
        wait_for(lambda: _leads(a, 1), timeout_s=TAKEOVER_S, what="a to lead")
        b = _start(tmp / "b", url=url)
        started.append(b)
        wait_for(lambda: "event=leader_seen" in b.log(), timeout_s=TAKEOVER_S, what="b to see a")
        yield Pair(leader=a, standby=b)
    finally:
        for proc in started:
            _stop(proc)
        pg_server.drop_database(database)


def _post_report(url: str, *, node: str = "n1", seq: int) -> httpx.Response:
    """One report of `node`, sent with its own agent token on a new connection (each new
    connection is accepted by either worker)."""
    body = encode_json(Report(node=node, instance="i1", seq=seq, sent_at=time.time()))
    headers = {"Authorization": f"Bearer {TOKENS[node]}"}
    return httpx.post(f"{url}/v1/reports", content=body, headers=headers, timeout=10)


def _metric(url: str, name: str) -> float | None:
    r = httpx.get(f"{url}/metrics", timeout=10)
    m = re.search(rf"^{name} (\S+)$", r.text, re.MULTILINE)
    return float(m.group(1)) if m else None


def test_both_serve_through_their_workers_and_one_leads(pair: Pair) -> None:
    for proc in (pair.leader, pair.standby):
        pids = _worker_pids(proc)
        assert len(pids) == WORKERS, proc.log()
        assert all(alive(pid) for pid in pids.values())
    assert _metric(pair.leader.url, "trainguard_controller_leader") == 1
    assert _metric(pair.standby.url, "trainguard_controller_leader") == 0


def test_the_standby_answers_reports_through_its_workers_503_naming_the_leader(
    pair: Pair,
) -> None:
    for seq in range(1, 5):
        r = _post_report(pair.standby.url, seq=seq)
        assert r.status_code == 503, r.text
        assert r.headers[LEADER_HEADER] == pair.leader.url
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["detail"]["leader"] == pair.leader.url
    # nothing of them reached the store: the leader has not heard of n1
    r = httpx.get(f"{pair.leader.url}/v1/nodes/n1", headers=OP, timeout=10)
    assert r.status_code == 404, r.text


def test_the_standby_answers_a_forwarded_api_write_503_naming_the_leader(pair: Pair) -> None:
    r = httpx.post(f"{pair.standby.url}/v1/nodes/n1/drain", json={}, headers=OP, timeout=10)
    assert r.status_code == 503, r.text
    assert r.headers[LEADER_HEADER] == pair.leader.url
    assert int(r.headers["Retry-After"]) >= 1
    assert httpx.get(f"{pair.standby.url}/v1/nodes", headers=OP, timeout=10).status_code == 200


def test_the_leader_ingests_reports_through_its_workers(pair: Pair) -> None:
    for seq in range(5, 9):
        r = _post_report(pair.leader.url, seq=seq)
        assert r.status_code == 200, r.text
        assert r.json()["commands"] == []
        assert LEADER_HEADER.lower() not in r.headers
    r = httpx.get(f"{pair.leader.url}/v1/nodes/n1", headers=OP, timeout=10)
    assert r.status_code == 200 and r.json()["state"] == "active", r.text


def test_after_kill_9_of_the_leader_the_standby_takes_over_and_ingests(pair: Pair) -> None:
    pair.leader.kill()  # kill -9: the lease is not given up; the standby waits it out
    wait_for(lambda: _leads(pair.standby, 2), timeout_s=TAKEOVER_S, what="the standby to take over")
    assert _metric(pair.standby.url, "trainguard_controller_leader") == 1
    for seq in range(1, 5):
        r = _post_report(pair.standby.url, node="n2", seq=seq)
        assert r.status_code == 200, r.text
    # n2 first reported to the new leader: its own ingest registered it
    r = httpx.get(f"{pair.standby.url}/v1/nodes/n2", headers=OP, timeout=10)
    assert r.status_code == 200 and r.json()["state"] == "active", r.text
