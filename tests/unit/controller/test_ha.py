"""Two HaControllers (controller/ha.py) on one store and a FakeClock, driven round by round:
one leads and acts, the other serves reads and refuses writes naming the leader; when the
leader stops renewing, the standby takes over through the restart path (a new Controller
under the next epoch) and finishes what the old one left; the old one, woken, is refused by
the store, does nothing (its notifier records nothing), and steps down. The API answers a
standby's writes 503 with X-Trainguard-Leader. SQLite here (the fake clock drives the lease's
times); the same rounds on PostgreSQL run in tests/integration/test_controller_ha.py."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.builders import Reporter
from tests.fakes.controller_service import FakeService
from trainguard.clock import FakeClock
from trainguard.controller.actions.base import TransientError
from trainguard.controller.actions.notify import RecordingNotifier
from trainguard.controller.api.app import create_app
from trainguard.controller.auth import TokenStore
from trainguard.controller.composition import ActionBackends
from trainguard.controller.config import ControllerConfig
from trainguard.controller.errors import NotLeader
from trainguard.controller.ha import HaController
from trainguard.controller.store import Store
from trainguard.controller.store.dialect import SQLITE
from trainguard.controller.store.errors import LeaseLost
from trainguard.leader import LEADER_HEADER
from trainguard.protocol import encode_json
from trainguard.strict import ConfigError, build

LEASE_S = 9.0


@pytest.fixture
def ha_config(core_config: Callable[..., ControllerConfig]) -> ControllerConfig:
    # ha.enabled needs PostgreSQL in a real deployment; the rounds here only read ha.*
    return core_config(ha={"lease_s": LEASE_S, "advertise_url": "http://unused:1"})


@pytest.fixture
def make_ha(
    ha_config: ControllerConfig, core_clock: FakeClock, tmp_path: Path
) -> Iterator[Callable[..., tuple[HaController, RecordingNotifier]]]:
    made: list[HaController] = []
    Store(ha_config.store.path, now=core_clock.now).close()  # the file, migrated

    def make(name: str, *, errors: int = 0) -> tuple[HaController, RecordingNotifier]:
        notifier = RecordingNotifier(
            "rec",
            min_severity="warning",
            errors=[TransientError("webhook down") for _ in range(errors)],
        )
        conn = sqlite3.connect(
            ha_config.store.path, isolation_level=None, check_same_thread=False, timeout=30
        )
        ha = HaController(
            ha_config,
            clock=core_clock,
            backends=ActionBackends(notifiers=[notifier]),
            holder=name,
            lease_conn=conn,
            dialect=SQLITE,
            db_now=core_clock.now,
            start_threads=False,  # the test runs the leader's ticks and steps
        )
        ha.advertise_url = ha.lease.advertise_url = f"http://{name}:8800"
        made.append(ha)
        return ha, notifier

    yield make
    for ha in made:
        try:
            ha.stop()
        except Exception:  # a test may have closed it already
            pass


def test_the_first_controller_leads_and_the_second_is_a_standby_naming_it(
    make_ha: Callable[..., tuple[HaController, RecordingNotifier]], core_clock: FakeClock
) -> None:
    a, _ = make_ha("a")
    b, _ = make_ha("b")
    a.lease_round()
    b.lease_round()
    assert a.role == "leader" and a.is_leader() and a.leader_url() == "http://a:8800"
    assert b.role == "standby" and not b.is_leader() and b.leader_url() == "http://a:8800"
    assert a.ha_metrics.leader._value.get() == 1
    assert a.ha_metrics.lease_epoch._value.get() == 1
    assert b.ha_metrics.leader._value.get() == 0

    reporter = Reporter("n1")
    a.ingest_report(reporter.report(now=core_clock.now()), actor="agent")
    with pytest.raises(NotLeader, match="the leader is http://a:8800"):
        b.ingest_report(reporter.report(now=core_clock.now()), actor="agent")
    # a standby writes nothing, even called directly: its store is fenced
    with pytest.raises(LeaseLost):
        b.create_silence(rule="gpu_dbe", node=None, duration_s=60, comment="", actor="op")
    a.current.tick(now=core_clock.now())  # the leader flushes freshness
    b.lease_round()  # the standby's node list follows the store
    assert [n.name for n in b.list_nodes()] == ["n1"]


def test_a_standby_is_alive_while_its_lease_rounds_come_on_the_injected_clock(
    make_ha: Callable[..., tuple[HaController, RecordingNotifier]], core_clock: FakeClock
) -> None:
    """A standby's liveness for the systemd watchdog: its lease rounds, measured on the
    controller's clock."""
    a, _ = make_ha("a")
    b, _ = make_ha("b")
    a.lease_round()
    b.lease_round()
    assert b.role == "standby" and b.ticking(within_s=5)
    core_clock.advance(6)  # no round for longer than the limit: a wedged lease thread
    assert not b.ticking(within_s=5)
    b.lease_round()  # the lease (LEASE_S) has not lapsed: still a standby
    assert b.role == "standby" and b.ticking(within_s=5)


def test_a_standby_takes_over_a_lapsed_lease_and_the_woken_leader_acts_on_nothing(
    make_ha: Callable[..., tuple[HaController, RecordingNotifier]], core_clock: FakeClock
) -> None:
    a, a_notes = make_ha("a", errors=1)  # its first delivery fails: the step is retried
    b, b_notes = make_ha("b")
    a.lease_round()
    b.lease_round()
    reporter = Reporter("n1")
    # a opens the DBE incident and tries its notification once (a's threads are not
    # started: the tick runs the due steps)
    a.ingest_report(reporter.report(now=core_clock.now(), dbe=1), actor="agent")
    a.current.tick(now=core_clock.now())
    incident = a.list_incidents()[0]
    notify = [s for s in a.current.store.actions.for_incident(incident.id) if s.kind == "notify"]
    assert [s.state for s in notify] == ["pending"] and a_notes.sent == []

    # a stops (SIGSTOP) past its lease; b takes over with the next epoch
    core_clock.advance(LEASE_S + 1)
    b.lease_round()
    assert b.role == "leader" and b.ha_metrics.lease_epoch._value.get() == 2

    # a wakes: its worker's retry is refused by the store before anything is sent
    with pytest.raises(LeaseLost):
        a.current.run_actions(now=core_clock.now())
    assert a_notes.sent == [] and a_notes.errors == []
    assert not a.is_leader()  # by its own count already, before its lease round
    a.lease_round()
    assert a.role == "standby" and a.leader_url() == "http://b:8800"
    assert a.ha_metrics.leader._value.get() == 0

    # b finishes the remediation once; b's incident is the same row
    b.ingest_report(reporter.report(now=core_clock.now(), dbe=1), actor="agent")
    b.current.run_actions(now=core_clock.now())
    assert [n.incident_id for n in b_notes.sent] == [incident.id]
    notify = [s for s in b.current.store.actions.for_incident(incident.id) if s.kind == "notify"]
    assert [s.state for s in notify] == ["succeeded"]
    assert a_notes.sent == []
    assert len(b.list_incidents()) == 1


def test_a_clean_stop_hands_the_lease_over_at_once(
    make_ha: Callable[..., tuple[HaController, RecordingNotifier]],
) -> None:
    a, _ = make_ha("a")
    b, _ = make_ha("b")
    a.lease_round()
    b.lease_round()
    assert b.role == "standby"
    a.stop()
    b.lease_round()  # no clock advance: the released lease is free
    assert b.role == "leader" and b.ha_metrics.lease_epoch._value.get() == 2


def test_a_leader_that_cannot_renew_steps_down_when_its_lease_runs_out(
    make_ha: Callable[..., tuple[HaController, RecordingNotifier]], core_clock: FakeClock
) -> None:
    a, _ = make_ha("a")
    a.lease_round()
    assert a.role == "leader"

    def lost(epoch: int) -> bool:
        raise OSError("connection refused")

    a.lease.renew = lost  # type: ignore[method-assign]
    core_clock.advance(LEASE_S / 3)
    a.lease_round()  # a failed renewal within the lease: still leading
    assert a.role == "leader" and a.is_leader()
    core_clock.advance(LEASE_S)
    assert not a.is_leader()  # by its own count: every write is refused from here
    a.lease_round()
    assert a.role == "standby" and not a.current.running
    assert a.ha_metrics.leadership_changes_total.labels(change="lost")._value.get() == 1


def test_ha_needs_a_postgresql_store_and_an_advertise_url(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"ha\.enabled: needs store\.url"):
        build(
            ControllerConfig,
            {
                "store": {"path": str(tmp_path / "c.db")},
                "ha": {"enabled": True, "advertise_url": "http://ctl-1:8800"},
            },
            source="t",
        )
    with pytest.raises(ConfigError, match=r"ha\.advertise_url"):
        build(
            ControllerConfig,
            {"store": {"url": "postgresql://u@h/db"}, "ha": {"enabled": True}},
            source="t",
        )
    with pytest.raises(ConfigError, match=r"ha\.renew_interval_s"):
        build(ControllerConfig, {"ha": {"lease_s": 10, "renew_interval_s": 6}}, source="t")
    with pytest.raises(ConfigError, match=r"ha\.lease_s"):
        build(ControllerConfig, {"ha": {"lease_s": 0.5}}, source="t")
    ok = build(
        ControllerConfig,
        {
            "store": {"url": "postgresql://u@h/db"},
            "ha": {"enabled": True, "advertise_url": "https://ctl-1:8800"},
        },
        source="t",
    )
    assert ok.ha.renew_every_s == pytest.approx(10 / 3)


class _Standby:
    def __init__(self, leader: str) -> None:
        self.leader = leader

    def is_leader(self) -> bool:
        return False

    def leader_url(self) -> str:
        return self.leader

    def retry_after_s(self) -> int:
        return 2


@pytest.mark.parametrize("leader", ["http://ctl-1:8800", ""], ids=["leader-known", "no-leader"])
def test_a_standby_api_answers_writes_503_naming_the_leader_and_serves_reads(
    leader: str,
) -> None:
    svc = FakeService(clock=FakeClock())
    svc.add_node("node-1")
    app = create_app(
        svc,  # type: ignore[arg-type]
        tokens=TokenStore.from_plaintext(
            {"op-token": ("ops", "operator"), "agent-token": ("agents", "agent")}
        ),
        max_body_bytes=64 * 1024,
        leadership=_Standby(leader),
    )
    client = TestClient(app, raise_server_exceptions=False)
    op = {"Authorization": "Bearer op-token"}
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/reports", {"content": b"{}"}),
        ("POST", "/v1/nodes/node-1/drain", {"json": {}}),
        ("PUT", "/v1/nodes/node-1/role", {"json": {"role": "spare"}}),
        ("DELETE", "/v1/silences/1", {}),
    ]
    for method, path, kw in calls:
        r = client.request(method, path, headers=op, **kw)
        assert r.status_code == 503, (method, path, r.text)
        assert r.headers[LEADER_HEADER] == leader
        assert r.headers["Retry-After"] == "2"
        body = r.json()
        assert body["detail"]["leader"] == (leader or None)
        assert (leader in body["error"]) if leader else ("no leader" in body["error"])
    assert client.get("/v1/nodes", headers=op).status_code == 200
    assert client.get("/healthz").status_code == 200
    assert svc.methods_called() == ["list_nodes"]  # no write reached the service


class _FencedLeader(_Standby):
    """A controller that counts itself the leader while the store's fence refuses its writes
    (its lease was taken over between its last round and the write)."""

    def is_leader(self) -> bool:
        return True


class _FencedService(FakeService):
    def drain(self, name: str, *, reason: str, actor: str) -> Any:
        raise LeaseLost("the lease of epoch 3 is no longer this controller's")

    def ingest_report(self, report: Any, *, actor: str) -> Any:
        raise LeaseLost("the lease of epoch 3 is no longer this controller's")


def test_a_write_the_store_fence_refuses_answers_503_naming_the_leader() -> None:
    svc = _FencedService(clock=FakeClock())
    svc.add_node("node-1")
    app = create_app(
        svc,  # type: ignore[arg-type]
        tokens=TokenStore.from_plaintext(
            {"op-token": ("ops", "operator"), "agent-token": ("agents", "agent")}
        ),
        max_body_bytes=64 * 1024,
        leadership=_FencedLeader("http://ctl-2:8800"),
    )
    client = TestClient(app, raise_server_exceptions=False)
    report = Reporter("node-1").report(now=1000.0)
    calls: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/nodes/node-1/drain", {"json": {}}),
        ("POST", "/v1/reports", {"content": encode_json(report)}),
    ]
    for method, path, kw in calls:
        token = "agent-token" if path == "/v1/reports" else "op-token"
        r = client.request(method, path, headers={"Authorization": f"Bearer {token}"}, **kw)
        assert r.status_code == 503, (method, path, r.text)
        assert r.headers[LEADER_HEADER] == "http://ctl-2:8800"
        assert r.headers["Retry-After"] == "2"
        assert r.json()["detail"] == {
            "leader": "http://ctl-2:8800",
            "reason": "the lease of epoch 3 is no longer this controller's",
        }
