"""Two real controller processes on one real PostgreSQL store (ha.enabled): one leads, the
other answers writes 503 with X-Trainguard-Leader naming it and serves reads; kill -9 of the
leader and the standby takes over and acts; SIGSTOP of the leader past its lease while a
webhook delivery is in flight, then SIGCONT: the standby took over and finished the step, the
woken leader's write of it is refused by the store (the step completes once), it steps down
and answers as a standby naming the new leader. Every wait is on a condition."""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes.http_receiver import Receiver
from tests.helpers import free_port, wait_for
from tests.integration.controller_proc import (
    AGENT,
    OP,
    ControllerProcess,
    dbe_rules,
    post_gpu_report,
    write_config,
)
from tests.integration.postgres_proc import PgServer
from trainguard.leader import LEADER_HEADER
from trainguard.model import GpuSample
from trainguard.protocol import Report, encode_json

pytestmark = pytest.mark.slow

LEASE_S = 2.0
TAKEOVER_S = 60.0  # a bound for the waits, not a measured figure


@pytest.fixture
def pg_database(pg_server: PgServer) -> Iterator[str]:
    name = pg_server.new_database()
    yield name
    pg_server.drop_database(name)


def _start(
    tmp_path: Path, name: str, *, url: str, actions: tuple[str, ...], webhook: str | None
) -> ControllerProcess:
    directory = tmp_path / name
    directory.mkdir()
    port = free_port()
    advertise = f"http://127.0.0.1:{port}"
    extra = (
        f"ha: {{enabled: true, advertise_url: '{advertise}', lease_s: {LEASE_S},"
        " renew_interval_s: 0.4}\n"
    )
    if webhook is not None:
        extra += f"notify: {{webhooks: [{{name: hook, url: '{webhook}', timeout_s: 60}}]}}\n"
    cfg = write_config(
        directory,
        rules=dbe_rules(actions),
        tick_interval_s=0.2,
        stale_after_s=30,
        store={"url": url},
        extra_yaml=extra,
    )
    cfg.write_text(cfg.read_text().replace("port: 0,", f"port: {port},"))
    proc = ControllerProcess(cfg, log_path=tmp_path / f"{name}.log")
    proc.wait_listening()
    assert proc.url == advertise
    return proc


def _leads(proc: ControllerProcess, epoch: int) -> bool:
    return f"event=leader epoch={epoch} " in proc.log()


def _metric(url: str, name: str) -> float | None:
    r = httpx.get(f"{url}/metrics", timeout=10)
    m = re.search(rf"^{name} (\S+)$", r.text, re.MULTILINE)
    return float(m.group(1)) if m else None


def _report(node: str, *, dbe: int, seq: int) -> bytes:
    gpu = GpuSample(
        index=0,
        uuid="GPU-0",
        pci_bus_id="0000:18:00.0",
        name="H100",
        ecc_uncorrected_volatile_total=dbe,
    )
    return encode_json(Report(node=node, instance="i1", seq=seq, sent_at=0.0, gpus=(gpu,)))


def _node_state(url: str, node: str) -> str | None:
    r = httpx.get(f"{url}/v1/nodes/{node}", headers=OP, timeout=10)
    return r.json()["state"] if r.status_code == 200 else None


def test_one_leads_the_standby_refuses_writes_naming_it_and_takes_over_a_killed_leader(
    tmp_path: Path, controllers: list, pg_server: PgServer, pg_database: str
) -> None:
    url = pg_server.url(pg_database)
    a = _start(tmp_path, "a", url=url, actions=("drain",), webhook=None)
    controllers.append(a)
    wait_for(lambda: _leads(a, 1), timeout_s=TAKEOVER_S, what="a to lead")
    b = _start(tmp_path, "b", url=url, actions=("drain",), webhook=None)
    controllers.append(b)
    wait_for(lambda: "event=leader_seen" in b.log(), timeout_s=TAKEOVER_S, what="b to see a")

    # the standby: every write is 503 naming the leader; reads are served
    r = httpx.post(f"{b.url}/v1/reports", content=_report("n1", dbe=0, seq=1), headers=AGENT)
    assert r.status_code == 503, r.text
    assert r.headers[LEADER_HEADER] == a.url
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["detail"]["leader"] == a.url
    r = httpx.post(f"{b.url}/v1/nodes/n1/drain", json={}, headers=OP)
    assert r.status_code == 503 and r.headers[LEADER_HEADER] == a.url
    assert _metric(a.url, "trainguard_controller_leader") == 1
    assert _metric(b.url, "trainguard_controller_leader") == 0

    post_gpu_report(a.url, node="n1", dbe=0, seq=1)
    post_gpu_report(a.url, node="n2", dbe=0, seq=1)
    # the standby's reads follow the store (the leader flushes each tick)
    wait_for(
        lambda: _node_state(b.url, "n1") == "active" and _node_state(b.url, "n2") == "active",
        timeout_s=TAKEOVER_S,
        what="the standby to list the nodes the leader registered",
    )
    assert httpx.get(f"{b.url}/v1/incidents", headers=OP).status_code == 200

    a.kill()  # kill -9: the lease is not given up; b waits for it to run out
    wait_for(lambda: _leads(b, 2), timeout_s=TAKEOVER_S, what="b to take over with epoch 2")
    assert _metric(b.url, "trainguard_controller_lease_epoch") == 2

    # the new leader acts: a DBE on n2 drains it
    post_gpu_report(b.url, node="n2", dbe=1, seq=2)
    wait_for(
        lambda: _node_state(b.url, "n2") == "drained",
        timeout_s=TAKEOVER_S,
        what="the new leader to drain n2",
    )
    assert _node_state(b.url, "n1") == "active"


def test_a_leader_stopped_past_its_lease_is_refused_by_the_store_and_steps_down(
    tmp_path: Path, controllers: list, pg_server: PgServer, pg_database: str
) -> None:
    url = pg_server.url(pg_database)
    with Receiver() as hook:
        hook.hold = threading.Event()  # a's delivery stays in flight
        a = _start(tmp_path, "a", url=url, actions=("notify",), webhook=hook.url)
        controllers.append(a)
        wait_for(lambda: _leads(a, 1), timeout_s=TAKEOVER_S, what="a to lead")
        b = _start(tmp_path, "b", url=url, actions=("notify",), webhook=hook.url)
        controllers.append(b)
        wait_for(lambda: "event=leader_seen" in b.log(), timeout_s=TAKEOVER_S, what="b sees a")

        post_gpu_report(a.url, node="n1", dbe=0, seq=1)
        post_gpu_report(a.url, node="n1", dbe=1, seq=2)
        wait_for(hook.arrived.is_set, timeout_s=TAKEOVER_S, what="a's webhook call")
        os.kill(a.popen.pid, signal.SIGSTOP)  # in the middle of the notify step
        try:
            wait_for(lambda: _leads(b, 2), timeout_s=TAKEOVER_S, what="b to take over")
            # b resumes the step (webhooks dedupe by idempotency key): let deliveries finish
            wait_for(lambda: len(hook.requests) >= 2, timeout_s=TAKEOVER_S, what="b's call")
            hook.hold.set()
            incidents = wait_for(
                lambda: httpx.get(f"{b.url}/v1/incidents", headers=OP).json(),
                timeout_s=TAKEOVER_S,
                what="the incident on b",
            )
            assert len(incidents) == 1
            incident_id = incidents[0]["id"]

            def finished() -> list[dict]:
                detail = httpx.get(f"{b.url}/v1/incidents/{incident_id}", headers=OP).json()
                return [e for e in detail["timeline"] if e["kind"] == "action_succeeded"]

            wait_for(finished, timeout_s=TAKEOVER_S, what="b to finish the notify step")
        finally:
            os.kill(a.popen.pid, signal.SIGCONT)

        # a wakes up: its answer from the webhook arrives, its write of the step is refused
        wait_for(
            lambda: "event=leader_stepped_down" in a.log(),
            timeout_s=TAKEOVER_S,
            what="a to step down",
        )
        r = httpx.post(f"{a.url}/v1/reports", content=_report("n1", dbe=1, seq=3), headers=AGENT)
        assert r.status_code == 503, r.text
        assert r.headers[LEADER_HEADER] == b.url
        assert _metric(a.url, "trainguard_controller_leader") == 0
        wait_for(
            lambda: "LeaseLost" in a.log(),
            timeout_s=TAKEOVER_S,
            what="a's refused write in its log",
        )
        # once in the store: one success of the step, one incident, and b still leads
        detail = httpx.get(f"{b.url}/v1/incidents/{incident_id}", headers=OP).json()
        succeeded = [e for e in detail["timeline"] if e["kind"] == "action_succeeded"]
        assert len(succeeded) == 1, detail["timeline"]
        keys = {req.json().get("idempotency_key") for req in hook.requests}
        assert len(keys) == 1, keys
        assert len(httpx.get(f"{b.url}/v1/incidents", headers=OP).json()) == 1
        assert _metric(b.url, "trainguard_controller_leader") == 1
