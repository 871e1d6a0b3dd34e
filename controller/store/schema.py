"""The store's schema: its versioned migrations, applied in order at open (`migrate`), and the
one-time switch of an older SQLite file to auto_vacuum=INCREMENTAL.

Migration N takes a database at version N-1 to version N, in one transaction; two controllers
starting at once on PostgreSQL migrate one after the other (an advisory lock). A database
newer than this controller knows is refused.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING

from trainguard.controller.store.connection import Connection, PgConnection
from trainguard.controller.store.errors import StoreError

if TYPE_CHECKING:
    from trainguard.controller.store.database import Database

log = logging.getLogger("trainguard.controller")


def _run_script(c: Connection, script: str) -> None:
    # executescript() would COMMIT the migration's transaction halfway; run statements singly.
    for statement in script.split(";\n"):
        if statement.strip():
            c.execute(statement)


def _migration_1(c: Connection) -> None:
    _run_script(
        c,
        """
        CREATE TABLE nodes (
            name TEXT PRIMARY KEY,
            role TEXT NOT NULL CHECK (role IN ('active', 'spare')),
            state TEXT NOT NULL CHECK (state IN ('active', 'draining', 'drained')),
            labels TEXT NOT NULL DEFAULT '{}',
            last_report_at REAL,
            instance TEXT,
            agent_version TEXT NOT NULL DEFAULT '',
            drain_reason TEXT,
            job TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE TABLE jobs (
            name TEXT PRIMARY KEY,
            spec TEXT NOT NULL DEFAULT '{}',
            state TEXT NOT NULL,
            nodes TEXT NOT NULL DEFAULT '[]',
            attempt INTEGER NOT NULL DEFAULT 0,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE TABLE incidents (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            rule TEXT NOT NULL,
            target_key TEXT NOT NULL,
            target TEXT NOT NULL,
            target_text TEXT NOT NULL,
            severity TEXT NOT NULL,
            state TEXT NOT NULL
                CHECK (state IN ('open', 'acting', 'mitigated', 'resolved', 'suppressed')),
            summary TEXT NOT NULL DEFAULT '',
            node TEXT,
            job TEXT,
            opened_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            resolved_at REAL
        );
        -- one unresolved incident per (rule, target), enforced by the database too
        CREATE UNIQUE INDEX incidents_one_open
            ON incidents (rule, target_key) WHERE state != 'resolved';
        CREATE INDEX incidents_by_rule_opened ON incidents (rule, opened_at);
        CREATE TABLE incident_timeline (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            incident_id INTEGER NOT NULL REFERENCES incidents (id) ON DELETE CASCADE,
            ts REAL NOT NULL,
            kind TEXT NOT NULL,
            message TEXT NOT NULL,
            data TEXT NOT NULL DEFAULT '{}'
        );
        CREATE INDEX timeline_by_incident ON incident_timeline (incident_id, id);
        CREATE TABLE actions (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            incident_id INTEGER REFERENCES incidents (id) ON DELETE CASCADE,
            seq INTEGER NOT NULL DEFAULT 0,
            kind TEXT NOT NULL,
            target TEXT NOT NULL,
            params TEXT NOT NULL DEFAULT '{}',
            state TEXT NOT NULL
                CHECK (state IN ('pending', 'running', 'succeeded', 'failed', 'skipped')),
            attempts INTEGER NOT NULL DEFAULT 0,
            idempotency_key TEXT NOT NULL UNIQUE,
            next_attempt_at REAL NOT NULL,
            result TEXT NOT NULL DEFAULT '',
            output TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        CREATE INDEX actions_open ON actions (state, next_attempt_at);
        CREATE INDEX actions_by_incident ON actions (incident_id, seq);
        CREATE TABLE commands (
            id TEXT PRIMARY KEY,
            node TEXT NOT NULL,
            kind TEXT NOT NULL,
            args TEXT NOT NULL DEFAULT '{}',
            created_at REAL NOT NULL,
            delivered_at REAL,
            done_at REAL,
            ok INTEGER,
            result TEXT NOT NULL DEFAULT ''
        );
        CREATE INDEX commands_pending ON commands (node) WHERE done_at IS NULL;
        CREATE TABLE events (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            node TEXT NOT NULL,
            instance TEXT NOT NULL,
            event_id INTEGER NOT NULL,
            kind TEXT NOT NULL,
            ts REAL NOT NULL,
            body TEXT NOT NULL,
            received_at REAL NOT NULL,
            UNIQUE (node, instance, event_id)
        );
        CREATE TABLE silences (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            rule TEXT,
            node TEXT,
            created_by TEXT NOT NULL,
            created_at REAL NOT NULL,
            expires_at REAL NOT NULL,
            comment TEXT NOT NULL DEFAULT '',
            deleted_at REAL,
            CHECK (rule IS NOT NULL OR node IS NOT NULL)
        );
        CREATE TABLE breakers (
            rule TEXT PRIMARY KEY,
            tripped_at REAL NOT NULL,
            incident_id INTEGER,
            nodes TEXT NOT NULL DEFAULT '[]'
        );
        CREATE TABLE audit_log (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            ts REAL NOT NULL,
            actor TEXT NOT NULL,
            action TEXT NOT NULL,
            target TEXT NOT NULL,
            detail TEXT NOT NULL DEFAULT '{}'
        );
        """,
    )


def _migration_2(c: Connection) -> None:
    """The job table of the closed loop: placement, attempts, checkpoint and ETTR accounting."""
    _run_script(
        c,
        """
        ALTER TABLE jobs ADD COLUMN nproc_per_node INTEGER NOT NULL DEFAULT 1;
        ALTER TABLE jobs ADD COLUMN min_nodes INTEGER NOT NULL DEFAULT 1;
        ALTER TABLE jobs ADD COLUMN restarts INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE jobs ADD COLUMN attempt_key TEXT;
        ALTER TABLE jobs ADD COLUMN attempt_nodes TEXT NOT NULL DEFAULT '[]';
        ALTER TABLE jobs ADD COLUMN rdzv_port INTEGER;
        ALTER TABLE jobs ADD COLUMN ckpt_step INTEGER;
        ALTER TABLE jobs ADD COLUMN last_step INTEGER;
        ALTER TABLE jobs ADD COLUMN hwm_step INTEGER;
        ALTER TABLE jobs ADD COLUMN started_at REAL;
        ALTER TABLE jobs ADD COLUMN attempt_started_at REAL;
        ALTER TABLE jobs ADD COLUMN ended_at REAL;
        ALTER TABLE jobs ADD COLUMN productive_s REAL NOT NULL DEFAULT 0;
        ALTER TABLE jobs ADD COLUMN sampled_at REAL;
        ALTER TABLE jobs ADD COLUMN state_reason TEXT NOT NULL DEFAULT ''
        """,
    )


def _migration_3(c: Connection) -> None:
    """What a command's result carried beyond its message (collect_stacks: the stack text)."""
    _run_script(c, "ALTER TABLE commands ADD COLUMN data TEXT NOT NULL DEFAULT '{}'")


def _migration_4(c: Connection) -> None:
    """Indexes the retention deletes walk oldest-first (events by arrival, finished commands,
    the audit log by time). The switch of an older file to auto_vacuum=INCREMENTAL goes with
    this version but runs after the transaction (VACUUM cannot run inside one): see
    `switch_to_incremental_vacuum`."""
    _run_script(
        c,
        """
        CREATE INDEX IF NOT EXISTS events_by_received ON events (received_at);
        CREATE INDEX IF NOT EXISTS commands_done ON commands (done_at) WHERE done_at IS NOT NULL;
        CREATE INDEX IF NOT EXISTS audit_by_ts ON audit_log (ts)
        """,
    )


def _migration_5(c: Connection) -> None:
    """The leader lease of controllers sharing one store (store/lease.py): one row, always
    there, free (expires_at 0) until a controller with `ha.enabled` takes it."""
    _run_script(
        c,
        """
        CREATE TABLE controller_lease (
            id INTEGER PRIMARY KEY CHECK (id = 1),
            holder TEXT NOT NULL DEFAULT '',
            advertise_url TEXT NOT NULL DEFAULT '',
            epoch INTEGER NOT NULL DEFAULT 0,
            expires_at REAL NOT NULL DEFAULT 0,
            acquired_at REAL NOT NULL DEFAULT 0,
            renewed_at REAL NOT NULL DEFAULT 0
        );
        INSERT INTO controller_lease (id) VALUES (1)
        """,
    )


def _migration_6(c: Connection) -> None:
    """The node lifecycle's states (controller/nodestate.py) in the nodes table's CHECK. SQLite
    cannot change a CHECK in place: the table is rebuilt (no index or foreign key refers to
    it); PostgreSQL replaces the constraint. The list is written out: a migration is history,
    and a later state comes with its own migration."""
    if isinstance(c, PgConnection):
        _run_script(
            c,
            """
            ALTER TABLE nodes DROP CONSTRAINT IF EXISTS nodes_state_check;
            ALTER TABLE nodes ADD CONSTRAINT nodes_state_check CHECK (state IN ('active',
                'draining', 'drained', 'diagnosing', 'repairing', 'validating', 'retired'))
            """,
        )
        return
    _run_script(
        c,
        """
        CREATE TABLE nodes_v6 (
            name TEXT PRIMARY KEY,
            role TEXT NOT NULL CHECK (role IN ('active', 'spare')),
            state TEXT NOT NULL CHECK (state IN ('active', 'draining', 'drained',
                'diagnosing', 'repairing', 'validating', 'retired')),
            labels TEXT NOT NULL DEFAULT '{}',
            last_report_at REAL,
            instance TEXT,
            agent_version TEXT NOT NULL DEFAULT '',
            drain_reason TEXT,
            job TEXT,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL
        );
        INSERT INTO nodes_v6 (name, role, state, labels, last_report_at, instance,
            agent_version, drain_reason, job, created_at, updated_at)
        SELECT name, role, state, labels, last_report_at, instance, agent_version,
            drain_reason, job, created_at, updated_at FROM nodes;
        DROP TABLE nodes;
        ALTER TABLE nodes_v6 RENAME TO nodes
        """,
    )


# Migration N (index N-1) takes a database at version N-1 to version N. Append only.
# The scripts are SQLite's spelling; on PostgreSQL store/dialect.py maps the types.
MIGRATIONS: tuple[Callable[[Connection], None], ...] = (
    _migration_1,
    _migration_2,
    _migration_3,
    _migration_4,
    _migration_5,
    _migration_6,
)
SCHEMA_VERSION = len(MIGRATIONS)

_MIGRATION_LOCK = 0x7467_5354  # PostgreSQL advisory lock key held while migrating ("tgST")
AUTO_VACUUM_INCREMENTAL = 2  # PRAGMA auto_vacuum's value for INCREMENTAL


def migrate(db: Database) -> None:
    """Bring the schema to SCHEMA_VERSION, in one transaction."""
    with db.transaction() as c:
        if db.dialect.postgres:
            # two controllers starting at once: the second waits, then finds it done
            c.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
        c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = c.execute("SELECT version FROM schema_version").fetchone()
        version = 0 if row is None else int(row[0])
        if row is None:
            c.execute("INSERT INTO schema_version (version) VALUES (0)")
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{db.path}: schema version {version} is newer than this controller "
                f"knows ({SCHEMA_VERSION}); upgrade the controller or restore a backup"
            )
        for n in range(version, SCHEMA_VERSION):
            MIGRATIONS[n](c)
            c.execute("UPDATE schema_version SET version = ?", (n + 1,))


def schema_version(db: Database) -> int:
    return int(db.query("SELECT version FROM schema_version")[0][0])


def auto_vacuum_mode(db: Database) -> int:
    """PRAGMA auto_vacuum: 0 none, 1 full, 2 incremental."""
    return int(db.query("PRAGMA auto_vacuum")[0][0])


def switch_to_incremental_vacuum(db: Database) -> None:
    """Rewrite a file made before schema version 4 once (VACUUM) so that it is
    auto_vacuum=INCREMENTAL: without it, pages freed by retention are reused but the file
    never shrinks. The rewrite needs free disk about the file's size and takes seconds per
    GB; if it fails (a full disk, the very case retention is for) the controller starts
    anyway and tries again at the next start."""
    if db.dialect.postgres or auto_vacuum_mode(db) == AUTO_VACUUM_INCREMENTAL:
        return
    with db.sqlite_connection() as conn:
        try:
            conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            conn.execute("VACUUM")
        except sqlite3.OperationalError as e:
            log.warning("event=store_vacuum_switch_failed store=%s error=%s", db.path, e)
            return
    log.info("event=store_vacuum_switched store=%s auto_vacuum=incremental", db.path)


__all__ = [
    "AUTO_VACUUM_INCREMENTAL",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "auto_vacuum_mode",
    "migrate",
    "schema_version",
    "switch_to_incremental_vacuum",
]
