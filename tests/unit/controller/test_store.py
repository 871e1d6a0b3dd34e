"""Store: schema versioning and migrations, WAL, uniqueness guarantees, silences, audit.

The tests taking `store_location` run on SQLite and on PostgreSQL (BOTH_STORES); the others
are about SQLite's file itself (WAL mode, a damaged or foreign file) and run on it alone."""

from __future__ import annotations

import sqlite3

import pytest

from tests.integration.postgres_proc import BOTH_STORES
from trainguard.controller.records import CommandResultRow, FreshNode, NewAction
from trainguard.controller.store import Store
from trainguard.controller.store import schema as store_schema
from trainguard.controller.store.errors import StoreError
from trainguard.controller.store.schema import SCHEMA_VERSION


def _now() -> float:
    return 1000.0


def _columns(s: Store, table: str) -> list[str]:
    if s.dialect.postgres:
        rows = s.db.query(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ?", (table,)
        )
        return [r[0] for r in rows]
    return [r[1] for r in s.db.query(f"PRAGMA table_info({table})")]


def _integrity_errors(s: Store) -> tuple[type[Exception], ...]:
    if s.dialect.postgres:
        import psycopg  # noqa: PLC0415 (only the PostgreSQL runs have the extra to import)

        return (psycopg.IntegrityError,)
    return (sqlite3.IntegrityError,)


def test_new_store_is_at_current_schema_in_wal_mode(tmp_path):
    s = Store(tmp_path / "c.db", now=_now)
    assert s.schema_version() == SCHEMA_VERSION
    mode = sqlite3.connect(tmp_path / "c.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


@BOTH_STORES
def test_reopening_keeps_data(store_location):
    s = Store(store_location, now=_now)
    assert s.schema_version() == SCHEMA_VERSION
    s.nodes.add("n1", role="spare", labels={"rack": "r1"})
    s.close()
    again = Store(store_location, now=_now)
    node = again.nodes.get("n1")
    assert (node.role, node.labels) == ("spare", {"rack": "r1"})


@BOTH_STORES
def test_older_file_is_migrated_forward_in_order(store_location, monkeypatch):
    path = store_location
    Store(path, now=_now).close()  # the current version
    base = store_schema.SCHEMA_VERSION
    applied = []

    def migration_next(c: store_schema.Connection) -> None:
        applied.append(base + 1)
        c.execute("ALTER TABLE jobs ADD COLUMN next_test INTEGER NOT NULL DEFAULT 1")

    monkeypatch.setattr(store_schema, "MIGRATIONS", (*store_schema.MIGRATIONS, migration_next))
    monkeypatch.setattr(store_schema, "SCHEMA_VERSION", base + 1)
    s = Store(path, now=_now)
    assert applied == [base + 1] and s.schema_version() == base + 1
    s.jobs.upsert("job-a", state="running", nodes=["n1"])
    s.close()
    assert applied == [base + 1]  # not applied twice
    assert Store(path, now=_now).schema_version() == base + 1


@BOTH_STORES
def test_failed_migration_leaves_the_file_at_its_old_version(store_location, monkeypatch):
    path = store_location
    Store(path, now=_now).close()

    def broken(c: store_schema.Connection) -> None:
        c.execute("ALTER TABLE jobs ADD COLUMN x INTEGER")
        c.execute("THIS IS NOT SQL")

    base = store_schema.SCHEMA_VERSION
    monkeypatch.setattr(store_schema, "MIGRATIONS", (*store_schema.MIGRATIONS, broken))
    monkeypatch.setattr(store_schema, "SCHEMA_VERSION", base + 1)
    with pytest.raises(StoreError):
        Store(path, now=_now)
    monkeypatch.undo()
    s = Store(path, now=_now)
    assert s.schema_version() == base
    assert "x" not in _columns(s, "jobs")


@BOTH_STORES
def test_newer_schema_than_known_is_a_clear_error(store_location):
    path = store_location
    s = Store(path, now=_now)
    with s.db.transaction() as c:
        c.execute("UPDATE schema_version SET version = 99")
    s.close()
    with pytest.raises(StoreError, match="schema version 99 is newer"):
        Store(path, now=_now)


def test_a_file_that_is_not_sqlite_is_a_clear_error(tmp_path):
    path = tmp_path / "c.db"
    path.write_bytes(b"this is not a database" * 100)
    with pytest.raises(StoreError, match="not an SQLite database") as e:
        Store(path, now=_now)
    assert "trainguard-controller restore" in str(e.value)
    assert path.read_bytes() == b"this is not a database" * 100  # left as it was


def test_an_empty_file_never_becomes_a_fresh_store(tmp_path):
    path = tmp_path / "c.db"
    path.write_bytes(b"")
    with pytest.raises(StoreError, match=r"empty \(0 bytes\)"):
        Store(path, now=_now)
    assert path.stat().st_size == 0


def test_a_damaged_page_fails_quick_check(tmp_path):
    path = tmp_path / "c.db"
    s = Store(path, now=_now)
    for i in range(300):
        s.nodes.add(f"node-{i}", role="active", labels={"rack": "r" * 200})
    s.close()
    # checkpoint the WAL into the main file, then overwrite a page in its middle
    c = sqlite3.connect(path)
    c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    c.close()
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 8 * page
    data[4 * page : 5 * page] = b"\xff" * page
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="damaged store") as e:
        Store(path, now=_now)
    assert "trainguard-controller restore" in str(e.value)


def test_a_foreign_sqlite_database_is_refused(tmp_path):
    path = tmp_path / "other.db"
    c = sqlite3.connect(path)
    c.execute("CREATE TABLE t (x)")
    c.commit()
    c.close()
    with pytest.raises(StoreError, match="not a trainguard store"):
        Store(path, now=_now)


@BOTH_STORES
def test_only_one_unresolved_incident_per_rule_and_target(store_location):
    s = Store(store_location, now=_now)
    kw = dict(
        rule="r",
        target_key="node:n1",
        target={"scope": "node", "node": "n1"},
        target_text="n1",
        severity="critical",
        summary="",
        node="n1",
        job=None,
        ts=1.0,
        timeline=[],
    )
    first = s.incidents.create(**kw)
    with pytest.raises(_integrity_errors(s)):
        s.incidents.create(**kw)
    s.incidents.set_state(first, "resolved", ts=2.0, kind="resolved", message="ok")
    assert s.incidents.create(**kw) != first


@BOTH_STORES
def test_action_idempotency_key_is_unique(store_location):
    s = Store(store_location, now=_now)
    a = NewAction(kind="drain", target="n1", idempotency_key="k1")
    (first,) = s.actions.add(None, [a], ts=1.0)
    (second,) = s.actions.add(None, [a], ts=2.0)
    assert first == second
    assert len(s.actions.open()) == 1


@BOTH_STORES
def test_duplicate_events_are_ignored_by_the_unique_constraint(store_location):
    s = Store(store_location, now=_now)
    rows = [(1, "xid", 1.0, {"id": 1}), (2, "xid", 2.0, {"id": 2})]
    s.events.insert("n1", "i", rows)
    s.events.insert("n1", "i", rows)
    assert s.events.count("n1") == 2 and s.events.max_event_id("n1", "i") == 2


@BOTH_STORES
def test_silences_expire_and_delete(store_location):
    s = Store(store_location, now=_now)
    silence = s.silences.add(
        rule="r", node=None, created_by="op", created_at=0.0, expires_at=10.0, comment="c"
    )
    assert [x.id for x in s.silences.find(now=5.0, include_expired=False)] == [silence.id]
    assert s.silences.find(now=11.0, include_expired=False) == []
    assert s.silences.delete(silence.id, now=5.0) is True
    assert s.silences.delete(silence.id, now=5.0) is False
    assert s.silences.find(now=5.0, include_expired=False) == []


@BOTH_STORES
def test_audit_log_is_newest_first(store_location):
    s = Store(store_location, now=_now)
    s.audit.record(ts=1.0, actor="alice", action="drain", target="n1", detail={"reason": "x"})
    s.audit.record(ts=2.0, actor="bob", action="undrain", target="n1", detail={})
    assert [e.actor for e in s.audit.recent(limit=10)] == ["bob", "alice"]


@BOTH_STORES
def test_audit_and_incidents_page_below_an_id(store_location):
    s = Store(store_location, now=_now)
    for i in range(5):
        s.audit.record(ts=float(i), actor="a", action="drain", target=f"n{i}", detail={})
        s.incidents.create(
            rule="r",
            target_key=f"node:n{i}",
            target={"scope": "node", "node": f"n{i}"},
            target_text=f"n{i}",
            severity="critical",
            summary="",
            node=f"n{i}",
            job=None,
            ts=float(i),
            timeline=[],
        )
    ids = [e.id for e in s.audit.recent(limit=10)]
    assert [e.id for e in s.audit.recent(limit=2, before_id=ids[1])] == ids[2:4]
    found = [i.id for i in s.incidents.find(limit=10)]
    assert [i.id for i in s.incidents.find(limit=2, before_id=found[1])] == found[2:4]
    assert s.incidents.find(node="n0", before_id=found[-1]) == []


@BOTH_STORES
def test_command_result_data_is_kept_with_the_command(store_location):
    s = Store(store_location, now=_now)
    s.commands.add("stacks-1-n1", node="n1", kind="collect_stacks", args={"job": "j"})
    result = CommandResultRow(
        command_id="stacks-1-n1",
        ok=True,
        message="stacks of 1 of 1 rank(s)",
        data={"stacks": "--- rank 0 ---\n  File x", "log_path": "/l"},
    )
    s.events.insert("n1", "i", [], command_results=[result])
    cmd = s.commands.get("stacks-1-n1")
    assert (cmd.ok, cmd.result, cmd.data) == (True, result.message, result.data)


@BOTH_STORES
def test_version_2_file_gains_command_data_and_keeps_its_commands(store_location, monkeypatch):
    path = store_location
    monkeypatch.setattr(store_schema, "MIGRATIONS", store_schema.MIGRATIONS[:2])
    monkeypatch.setattr(store_schema, "SCHEMA_VERSION", 2)
    old = Store(path, now=_now)
    with old.db.transaction() as c:
        c.execute(
            "INSERT INTO commands (id, node, kind, args, created_at) VALUES (?, ?, ?, ?, ?)",
            ("c1", "n1", "stop_job", "{}", 1.0),
        )
    old.close()
    monkeypatch.undo()
    s = Store(path, now=_now)
    assert s.schema_version() == SCHEMA_VERSION  # migrated to the newest
    assert s.commands.get("c1").data == {}


@BOTH_STORES
def test_a_freshness_flush_updates_each_reporting_node_and_no_other(store_location):
    s = Store(store_location, now=_now)
    for name in ("n1", "n2", "n3"):
        s.nodes.add(name, role="active", labels={"rack": "r0"})
    written = s.nodes.flush_freshness(
        [
            FreshNode("n1", 1234.5, "inst-a", "1.2.3", {"rack": "r1", "zone": "z'1%"}),
            FreshNode("n3", 1236.25, "", "", {}),
            FreshNode("gone", 1.0, "x", "y", {}),  # deleted meanwhile: nothing to update
        ]
    )
    assert written == 3
    nodes = {n.name: n for n in s.nodes.all()}
    assert set(nodes) == {"n1", "n2", "n3"}
    n1, n2, n3 = nodes["n1"], nodes["n2"], nodes["n3"]
    assert (n1.last_report_at, n1.agent_version) == (1234.5, "1.2.3")
    assert n1.labels == {"rack": "r1", "zone": "z'1%"}
    assert n2.last_report_at is None and n2.labels == {"rack": "r0"}
    assert (n3.last_report_at, n3.labels) == (1236.25, {})
    assert s.nodes.flush_freshness([]) == 0
    s.close()
