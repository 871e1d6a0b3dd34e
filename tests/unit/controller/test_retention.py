"""Store retention and space reclaim: what each table keeps and what goes, bounded batches,
the WAL checkpoint, incremental vacuum and the switch of an older file (fake clock, no
scheduler). Retention runs on both store backends (BOTH_STORES); the WAL checkpoint, the
vacuum and the file switch are SQLite's and run on it alone (PostgreSQL: a no-op, tested once
below)."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from tests.integration.postgres_proc import BOTH_STORES
from trainguard.clock import FakeClock
from trainguard.controller.config import RetentionConfig
from trainguard.controller.maintenance import run_checkpoint, run_retention, run_vacuum
from trainguard.controller.records import FreshNode, NewAction
from trainguard.controller.store import Store
from trainguard.controller.store import schema as store_schema

DAY_S = 86400.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(store_location: str, clock: FakeClock) -> Store:
    s = Store(store_location, now=clock.now)
    yield s
    s.close()


def _policy(**days: Any) -> RetentionConfig:
    return RetentionConfig(**days)


def _event(store: Store, node: str, eid: int, *, instance: str = "i1") -> None:
    store.events.insert(node, instance, [(eid, "xid", store.db.now(), {"xid": 79})])


def _event_ids(store: Store, node: str) -> list[int]:
    rows = store.db.query("SELECT event_id FROM events WHERE node = ? ORDER BY event_id", (node,))
    return [int(r[0]) for r in rows]


def _incident(store: Store, *, node: str, rule: str = "gpu_dbe", ts: float) -> int:
    return store.incidents.create(
        rule=rule,
        target_key=f"node:{node}",
        target={"scope": "node", "node": node},
        target_text=node,
        severity="critical",
        summary="s",
        node=node,
        job=None,
        ts=ts,
        timeline=[("opened", "opened", {}), ("note", "a note", {})],
    )


def _count(store: Store, table: str) -> int:
    return int(store.db.query(f"SELECT COUNT(*) FROM {table}")[0][0])


# --- events -------------------------------------------------------------------------------


@BOTH_STORES
def test_events_older_than_the_limit_go_and_newer_ones_stay(store, clock):
    store.nodes.add("n1", role="active", labels={})
    for eid in range(1, 4):
        _event(store, "n1", eid)  # day 0
    clock.advance(10 * DAY_S)
    _event(store, "n1", 4)
    clock.advance(5 * DAY_S)  # the first three are 15 days old, the fourth 5
    result = run_retention(store, now=clock.now(), policy=_policy(events_days=14))
    assert result.deleted["events"] == 3
    assert _event_ids(store, "n1") == [4]


@BOTH_STORES
def test_an_open_incidents_node_keeps_its_evidence(store, clock):
    for node in ("sick", "healthy"):
        store.nodes.add(node, role="active", labels={})
        _event(store, node, 1)  # evidence: a day before the incident
    clock.advance(DAY_S)
    _incident(store, node="sick", ts=clock.now())
    _event(store, "sick", 2)
    _event(store, "healthy", 2)
    clock.advance(60 * DAY_S)  # the incident stays open for two months
    _event(store, "sick", 3)
    _event(store, "healthy", 3)
    run_retention(store, now=clock.now(), policy=_policy(events_days=14))
    assert _event_ids(store, "sick") == [1, 2, 3]  # aged from the opening: all kept
    assert _event_ids(store, "healthy") == [3]


@BOTH_STORES
def test_a_resolved_incident_no_longer_holds_its_nodes_events(store, clock):
    store.nodes.add("n1", role="active", labels={})
    _event(store, "n1", 1)
    incident = _incident(store, node="n1", ts=clock.now())
    clock.advance(30 * DAY_S)
    store.incidents.set_state(incident, "resolved", ts=clock.now(), kind="resolved", message="ok")
    _event(store, "n1", 2)
    run_retention(store, now=clock.now(), policy=_policy(events_days=14))
    assert _event_ids(store, "n1") == [2]


@BOTH_STORES
def test_the_newest_event_of_a_nodes_current_agent_instance_stays(store, clock):
    """It is the high-water mark a restarted controller acknowledges from."""
    store.nodes.add("n1", role="active", labels={})
    for eid in (1, 2, 3):
        _event(store, "n1", eid, instance="old")
    for eid in (7, 8):
        _event(store, "n1", eid, instance="current")
    store.nodes.flush_freshness(
        [
            FreshNode(
                name="n1",
                last_report_at=clock.now(),
                instance="current",
                agent_version="v",
                labels={},
            )
        ]
    )
    clock.advance(100 * DAY_S)
    run_retention(store, now=clock.now(), policy=_policy(events_days=14))
    assert _event_ids(store, "n1") == [8]
    assert store.events.max_event_id("n1", "current") == 8
    assert store.events.max_event_id("n1", "old") == 0


# --- commands -----------------------------------------------------------------------------


@BOTH_STORES
def test_finished_commands_go_after_the_limit_and_waiting_ones_never(store, clock):
    store.commands.add("done-old", node="n1", kind="stop_job", args={})
    store.commands.add("waiting-old", node="n1", kind="stop_job", args={})
    store.commands.finish("done-old", ok=True, result="stopped")
    clock.advance(10 * DAY_S)
    store.commands.add("done-new", node="n1", kind="stop_job", args={})
    store.commands.finish("done-new", ok=False, result="no such job")
    clock.advance(10 * DAY_S)
    result = run_retention(store, now=clock.now(), policy=_policy(commands_days=14))
    assert result.deleted["commands"] == 1
    assert store.commands.get("done-old") is None
    assert store.commands.get("waiting-old") is not None
    assert store.commands.get("done-new") is not None


# --- incidents, timelines, actions --------------------------------------------------------


def _resolve(store: Store, incident: int, ts: float) -> None:
    store.incidents.set_state(incident, "resolved", ts=ts, kind="resolved", message="done")


@BOTH_STORES
def test_resolved_incidents_go_with_their_timelines_and_actions(store, clock):
    old = _incident(store, node="n1", ts=clock.now())
    store.actions.add(
        old, [NewAction(kind="notify", target="n1", idempotency_key=f"{old}:0")], ts=clock.now()
    )
    store.actions.update(store.actions.for_incident(old)[0].id, state="succeeded", ts=clock.now())
    _resolve(store, old, clock.now())
    clock.advance(100 * DAY_S)
    recent = _incident(store, node="n2", ts=clock.now())
    _resolve(store, recent, clock.now())
    result = run_retention(store, now=clock.now(), policy=_policy(incidents_days=90))
    assert result.deleted["incidents"] == 1
    assert result.deleted["incident_timeline"] == 3  # opened, note, resolved
    assert result.deleted["actions"] == 1
    assert store.incidents.get(old) is None
    assert store.incidents.timeline(old) == [] and store.actions.for_incident(old) == []
    assert store.incidents.get(recent) is not None


@BOTH_STORES
def test_open_incidents_are_never_deleted(store, clock):
    incidents = {}
    for state in ("open", "acting", "mitigated", "suppressed"):
        incidents[state] = _incident(store, node=f"n-{state}", ts=clock.now())
        if state != "open":
            store.incidents.set_state(
                incidents[state], state, ts=clock.now(), kind=state, message=state
            )
    clock.advance(1000 * DAY_S)
    result = run_retention(store, now=clock.now(), policy=_policy(incidents_days=1))
    assert result.deleted["incidents"] == 0
    assert all(store.incidents.get(i) is not None for i in incidents.values())


@BOTH_STORES
@pytest.mark.parametrize("state", ["pending", "running"])
def test_a_resolved_incident_with_an_unfinished_step_is_kept_whole(store, clock, state):
    incident = _incident(store, node="n1", ts=clock.now())
    (action,) = store.actions.add(
        incident,
        [NewAction(kind="drain", target="n1", idempotency_key="k", state=state)],
        ts=clock.now(),
    )
    _resolve(store, incident, clock.now())
    clock.advance(1000 * DAY_S)
    run_retention(store, now=clock.now(), policy=_policy(incidents_days=1))
    assert store.incidents.get(incident) is not None
    assert len(store.incidents.timeline(incident)) == 3
    assert store.actions.get(action) is not None


@BOTH_STORES
def test_the_incident_that_began_a_jobs_current_attempt_is_kept(store, clock):
    incident = _incident(store, node="n1", ts=clock.now())
    store.actions.add(
        incident,
        [NewAction(kind="restart", target="job-a", idempotency_key="restart-key")],
        ts=clock.now(),
    )
    store.actions.update(store.actions.by_key("restart-key").id, state="succeeded", ts=clock.now())
    store.jobs.submit(
        "job-a",
        spec={},
        nodes=["n1"],
        nproc_per_node=1,
        min_nodes=1,
        ts=clock.now(),
        replace_states=(),
    )
    store.jobs.begin_attempt("job-a", key="restart-key", rdzv_port=lambda n: 29500, ts=clock.now())
    _resolve(store, incident, clock.now())
    clock.advance(1000 * DAY_S)
    run_retention(store, now=clock.now(), policy=_policy(incidents_days=1))
    assert store.incidents.get(incident) is not None
    assert store.actions.by_key("restart-key") is not None


@BOTH_STORES
def test_operator_steps_go_when_final_and_old_never_when_unfinished(store, clock):
    ids = store.actions.add(
        None,
        [
            NewAction(kind="drain", target="n1", idempotency_key="op:1", state="succeeded"),
            NewAction(kind="undrain", target="n1", idempotency_key="op:2", state="running"),
            NewAction(kind="drain", target="n2", idempotency_key="op:3", state="succeeded"),
        ],
        ts=clock.now(),
    )
    store.nodes.add("n2", role="active", labels={})
    store.nodes.update("n2", state="drained")  # n2's drain is what keeps it out: kept
    clock.advance(100 * DAY_S)
    result = run_retention(store, now=clock.now(), policy=_policy(operator_actions_days=90))
    assert result.deleted["actions"] == 1
    assert [store.actions.get(i) is not None for i in ids] == [False, True, True]


# --- audit ----------------------------------------------------------------------------------


@BOTH_STORES
def test_the_audit_log_keeps_180_days_by_default(store, clock):
    start = clock.now()
    store.audit.record(ts=start, actor="ops", action="drain", target="n1", detail={})
    store.audit.record(
        ts=start + 100 * DAY_S, actor="ops", action="undrain", target="n1", detail={}
    )
    clock.advance(200 * DAY_S)
    result = run_retention(store, now=clock.now(), policy=RetentionConfig())
    assert result.deleted["audit_log"] == 1
    assert [e.action for e in store.audit.recent()] == ["undrain"]


@BOTH_STORES
def test_zero_days_keeps_a_table_forever(store, clock):
    store.audit.record(ts=clock.now(), actor="ops", action="drain", target="n1", detail={})
    store.nodes.add("n1", role="active", labels={})
    _event(store, "n1", 1)
    _event(store, "n1", 2)
    clock.advance(10_000 * DAY_S)
    result = run_retention(store, now=clock.now(), policy=_policy(audit_days=0, events_days=0))
    assert "audit_log" not in result.deleted and "events" not in result.deleted
    assert len(store.audit.recent()) == 1 and _event_ids(store, "n1") == [1, 2]


# --- bounded batches ------------------------------------------------------------------------


@BOTH_STORES
def test_rows_are_deleted_in_transactions_of_at_most_batch_rows(store, clock, monkeypatch):
    store.events.insert("n1", "i", [(i, "xid", 0.0, {}) for i in range(1, 1051)])
    for i in range(12):  # 12 incidents of 4 rows each (incident, 3 timeline entries)
        _resolve(store, _incident(store, node=f"n{i}", ts=clock.now()), clock.now())
    clock.advance(365 * DAY_S)
    sizes: list[int] = []
    expire_events, expire_incidents = (
        store.retention.expire_events,
        store.retention.expire_incidents,
    )

    def events_batch(**kw: Any) -> int:
        n = expire_events(**kw)
        sizes.append(n)
        return n

    def incidents_batch(**kw: Any) -> dict[str, int]:
        got = expire_incidents(**kw)
        sizes.append(sum(got.values()))
        return got

    monkeypatch.setattr(store.retention, "expire_events", events_batch)
    monkeypatch.setattr(store.retention, "expire_incidents", incidents_batch)
    result = run_retention(store, now=clock.now(), policy=_policy(batch_rows=10, events_days=1))
    assert result.deleted["events"] == 1050  # n1 has no node row: no high-water mark to keep
    assert result.deleted["incidents"] == 12
    assert max(sizes) <= 10
    assert _count(store, "events") == 0 and _count(store, "incidents") == 0
    # 105 full batches + 1 empty for the events; 2 incidents (8 rows) per batch + 1 empty
    assert sizes.count(10) == 105 and sizes.count(8) == 6


@BOTH_STORES
def test_a_cancelled_run_stops_between_batches(store, clock):
    store.events.insert("n1", "i", [(i, "xid", 0.0, {}) for i in range(1, 101)])
    clock.advance(365 * DAY_S)
    calls = iter([False, False, True])
    result = run_retention(
        store, now=clock.now(), policy=_policy(batch_rows=10), cancelled=lambda: next(calls, True)
    )
    assert result.deleted["events"] == 20 and not result.complete
    assert _count(store, "events") == 80


# --- WAL checkpoint, incremental vacuum ------------------------------------------------------


@pytest.mark.parametrize("store_backend", ["postgres"])
def test_on_postgres_vacuum_and_checkpoint_are_no_ops(store, clock):
    store.events.insert("n1", "i", [(i, "xid", 0.0, {}) for i in range(1, 101)])
    clock.advance(365 * DAY_S)
    run_retention(store, now=clock.now(), policy=_policy(batch_rows=1000))
    assert store.events.count("n1") == 0
    assert run_vacuum(store, max_pages=1000) == 0
    result = run_checkpoint(store)
    assert (result.busy, result.wal_frames, result.wal_bytes_after) == (False, 0, 0)
    db_bytes, wal_bytes = store.space.file_sizes()
    assert db_bytes > 0 and wal_bytes == 0


def _fill(store: Store, n: int) -> None:
    store.events.insert("n1", "i", [(i, "xid", 0.0, {"pad": "x" * 500}) for i in range(1, n + 1)])


def test_a_checkpoint_truncates_the_wal_file(store):
    _fill(store, 3000)
    _, wal_before = store.space.file_sizes()
    assert wal_before > 1_000_000
    result = run_checkpoint(store)
    assert not result.busy
    assert result.wal_bytes_before == wal_before and result.wal_bytes_after == 0
    assert store.space.file_sizes()[1] == 0
    assert store.events.count("n1") == 3000  # nothing lost: it is in the file now


def test_incremental_vacuum_gives_freed_pages_back_and_the_file_shrinks(store, clock):
    _fill(store, 5000)
    run_checkpoint(store)
    full_bytes, _ = store.space.file_sizes()
    clock.advance(365 * DAY_S)
    run_retention(store, now=clock.now(), policy=_policy(events_days=1))
    _, free = store.space.page_counts()
    assert free > 500  # deleted rows leave free pages; the file keeps its size
    freed = run_vacuum(store, max_pages=100)
    assert freed == 100 and store.space.page_counts()[1] == free - 100  # bounded by max_pages
    freed += run_vacuum(store, max_pages=1_000_000)
    assert freed == free and store.space.page_counts()[1] == 0
    run_checkpoint(store)
    db_bytes, _ = store.space.file_sizes()
    assert db_bytes < full_bytes / 4


# --- the switch of an older file ------------------------------------------------------------


def test_an_older_file_is_switched_to_incremental_vacuum_and_migrated(tmp_path, monkeypatch):
    path = tmp_path / "c.db"
    monkeypatch.setattr(store_schema, "MIGRATIONS", store_schema.MIGRATIONS[:3])
    monkeypatch.setattr(store_schema, "SCHEMA_VERSION", 3)
    old = Store(path, now=lambda: 1000.0)
    old.nodes.add("n1", role="spare", labels={"rack": "r1"})
    old.events.insert("n1", "i", [(1, "xid", 1.0, {"xid": 79})])
    old.close()
    # a file as controllers before version 4 made it: no auto_vacuum
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA auto_vacuum=NONE")
    conn.execute("VACUUM")
    assert conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    conn.close()
    monkeypatch.undo()

    s = Store(path, now=lambda: 1000.0)
    assert s.schema_version() == store_schema.SCHEMA_VERSION
    assert s.space.auto_vacuum_mode() == store_schema.AUTO_VACUUM_INCREMENTAL
    indexes = {r[0] for r in s.db.query("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"events_by_received", "commands_done", "audit_by_ts"} <= indexes
    assert s.nodes.get("n1").role == "spare" and s.events.count("n1") == 1
    s.close()


class _NoVacuum:
    """A connection whose VACUUM fails as on a full disk (what sqlite3 raises then)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        object.__setattr__(self, "_conn", conn)

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if sql.strip().upper() == "VACUUM":
            raise sqlite3.OperationalError("database or disk is full")
        return self._conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._conn, name, value)


def test_a_failed_switch_leaves_the_store_usable(tmp_path, monkeypatch, caplog):
    path = tmp_path / "c.db"
    Store(path, now=lambda: 1000.0).close()
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA auto_vacuum=NONE")
    conn.execute("VACUUM")
    conn.close()
    connect = sqlite3.connect
    monkeypatch.setattr(sqlite3, "connect", lambda *a, **kw: _NoVacuum(connect(*a, **kw)))
    s = Store(path, now=lambda: 1000.0)
    monkeypatch.undo()
    assert s.space.auto_vacuum_mode() == 0
    assert "event=store_vacuum_switch_failed" in caplog.text
    s.nodes.add("n1", role="active", labels={})
    s.close()
    again = Store(path, now=lambda: 1000.0)  # switched at the next start
    assert again.space.auto_vacuum_mode() == store_schema.AUTO_VACUUM_INCREMENTAL
    assert again.nodes.get("n1") is not None
    again.close()
