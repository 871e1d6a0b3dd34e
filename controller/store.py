"""The controller's durable state: one SQLite file (WAL) by default, or a PostgreSQL
database (`store.url`), with one versioned, migrated schema.

Owns nodes, jobs, incidents (+ timeline), actions, agent commands, events, silences, the
safety state and the audit log. Rows never leave this module: callers get small frozen
records or the read models in `trainguard.controller.views`. The SQL is written once, in
SQLite's spelling; controller/dialect.py connects to PostgreSQL and rewrites it there.

Why these pragmas: WAL lets readers (the API) run while the tick writes. synchronous=NORMAL
in WAL mode makes every commit durable against a process crash (kill -9: the WAL is in the
OS page cache and is replayed on open); only a power loss or kernel crash can drop the last
few commits, and it never corrupts the file. FULL would fsync every commit, which the event
and action paths do not need. Foreign keys are on so a timeline never outlives its incident.

Thread safety: one connection guarded by a re-entrant lock; `transaction()` holds it for a
whole BEGIN IMMEDIATE ... COMMIT so multi-statement changes are atomic. On PostgreSQL a
transaction is READ COMMITTED: a transaction that reads a row and then writes it depending on
what it read (`submit_job`, `begin_attempt`) locks the row (SELECT ... FOR UPDATE), which
SQLite's BEGIN IMMEDIATE (the one write lock) gave for free; inserts keyed by an idempotency
key (actions, commands, events) are INSERT ... ON CONFLICT DO NOTHING on both, so a step is
recorded once whoever writes it. Migrations take an advisory lock, so two controllers starting
at once migrate one after the other. With HA a `fence` (controller/lease.py: the leader
lease's epoch) is checked first in every write transaction; a refused one writes nothing.

Staying small: the `expire_*` methods delete one bounded batch of old rows each (one
transaction, so the API and the tick wait for one batch at most), `incremental_vacuum` gives
free pages back to the filesystem (the file is `auto_vacuum=INCREMENTAL`; an older file is
switched once at open, see `_switch_to_incremental_vacuum`) and `checkpoint_wal` empties the
-wal file. controller/maintenance.py decides when and how much. On PostgreSQL the two are
no-ops: autovacuum reclaims space and the server manages its WAL; retention is the same.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from trainguard.controller.dialect import (
    POSTGRES,
    SQLITE,
    Connection,
    Row,
    StoreConnectError,
    connect_postgres,
    is_postgres_url,
)
from trainguard.controller.views import (
    ActionView,
    AuditEntry,
    IncidentView,
    SilenceView,
    TimelineEntry,
)

log = logging.getLogger("trainguard.controller")


class StoreError(RuntimeError):
    """The store cannot be opened or used (names the file and the reason)."""


SQLITE_HEADER = b"SQLite format 3\x00"
RESTORE_HINT = (
    "restore the newest backup with 'trainguard-controller restore BACKUP_FILE' "
    "(docs/controller.md, Backup and restore), or move the file away to start an empty store"
)


def check_existing_file(path: str | Path) -> None:
    """Refuse a store file that cannot be a trainguard store before SQLite touches it: SQLite
    would treat a 0-byte file as a new empty database and the controller would start fresh over
    it (every node, incident and job gone without a word)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with p.open("rb") as f:
            header = f.read(len(SQLITE_HEADER))
    except OSError as e:
        raise StoreError(f"{p}: cannot read: {e.strerror or e}") from None
    if size == 0:
        raise StoreError(f"{p}: the store file is empty (0 bytes); {RESTORE_HINT}")
    if header != SQLITE_HEADER:
        raise StoreError(f"{p}: not an SQLite database (wrong file header); {RESTORE_HINT}")


def verify_connection(conn: sqlite3.Connection, path: str) -> None:
    """`PRAGMA quick_check` and the schema_version table: a damaged or foreign file fails."""
    try:
        result = [str(r[0]) for r in conn.execute("PRAGMA quick_check").fetchall()]
    except sqlite3.DatabaseError as e:
        raise StoreError(f"{path}: damaged store ({e}); {RESTORE_HINT}") from None
    if result != ["ok"]:
        detail = "; ".join(result[:3])
        raise StoreError(f"{path}: damaged store (quick_check: {detail}); {RESTORE_HINT}")
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if row is None:
        raise StoreError(
            f"{path}: an SQLite database, but not a trainguard store (no schema_version table); "
            "point store.path at the controller's own file"
        )


# --- schema ---------------------------------------------------------------------------------


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
    `Store._switch_to_incremental_vacuum`."""
    _run_script(
        c,
        """
        CREATE INDEX IF NOT EXISTS events_by_received ON events (received_at);
        CREATE INDEX IF NOT EXISTS commands_done ON commands (done_at) WHERE done_at IS NOT NULL;
        CREATE INDEX IF NOT EXISTS audit_by_ts ON audit_log (ts)
        """,
    )


def _migration_5(c: Connection) -> None:
    """The leader lease of controllers sharing one store (controller/lease.py): one row, always
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


# Migration N (index N-1) takes a database at version N-1 to version N. Append only.
# The scripts are SQLite's spelling; on PostgreSQL dialect.py maps the types.
MIGRATIONS: tuple[Callable[[Connection], None], ...] = (
    _migration_1,
    _migration_2,
    _migration_3,
    _migration_4,
    _migration_5,
)
SCHEMA_VERSION = len(MIGRATIONS)

TERMINAL_ACTION_STATES = ("succeeded", "failed", "skipped")
_MIGRATION_LOCK = 0x7467_5354  # PostgreSQL advisory lock key held while migrating ("tgST")
AUTO_VACUUM_INCREMENTAL = 2  # PRAGMA auto_vacuum's value for INCREMENTAL

# What a resolved incident must not be deleted with: a step not in a final state, the step
# that began a job's current attempt (the job attributes its attempt to that incident), a
# circuit breaker's incident, a drain of a node still out of service (undrain and the
# correlation of later faults look that drain up).
_INCIDENT_EXPIRED = """
    i.state = 'resolved' AND COALESCE(i.resolved_at, i.updated_at) < :cutoff
    AND NOT EXISTS (SELECT 1 FROM actions a WHERE a.incident_id = i.id
                    AND a.state NOT IN ('succeeded', 'failed', 'skipped'))
    AND NOT EXISTS (SELECT 1 FROM actions a JOIN jobs j ON j.attempt_key = a.idempotency_key
                    WHERE a.incident_id = i.id)
    AND NOT EXISTS (SELECT 1 FROM breakers b WHERE b.incident_id = i.id)
    AND NOT EXISTS (SELECT 1 FROM actions a JOIN nodes n ON n.name = a.target
                    WHERE a.incident_id = i.id AND a.kind = 'drain' AND n.state != 'active')
"""


# --- records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRecord:
    name: str
    role: str
    state: str
    labels: dict[str, str] = field(default_factory=dict)
    last_report_at: float | None = None
    instance: str | None = None
    agent_version: str = ""
    drain_reason: str | None = None
    job: str | None = None


@dataclass(frozen=True)
class JobRecord:
    """One row of the job table (the spec is the submitted JSON, validated by controller.jobs).

    `nodes`/`nproc_per_node` are the placement the next attempt starts on; `attempt_nodes` the
    nodes the current attempt was started on (what a restart must stop). `attempt_key` is the
    idempotency key of the step that began the current attempt, so a step re-run after a crash
    finds its attempt instead of beginning another.
    """

    name: str
    spec: dict[str, Any]
    state: str
    nodes: tuple[str, ...]
    attempt: int
    nproc_per_node: int
    min_nodes: int
    restarts: int
    created_at: float
    updated_at: float
    attempt_key: str | None = None
    attempt_nodes: tuple[str, ...] = ()
    rdzv_port: int | None = None
    ckpt_step: int | None = None
    last_step: int | None = None
    hwm_step: int | None = None
    started_at: float | None = None
    attempt_started_at: float | None = None
    ended_at: float | None = None
    productive_s: float = 0.0
    sampled_at: float | None = None
    state_reason: str = ""


@dataclass(frozen=True)
class CommandRecord:
    id: str
    node: str
    kind: str
    args: dict[str, Any]
    created_at: float
    delivered_at: float | None = None
    done_at: float | None = None
    ok: bool | None = None
    result: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # the result's data beyond the message


@dataclass(frozen=True)
class CommandResultRow:
    """A `command_result` event as the commands table keeps it."""

    command_id: str
    ok: bool
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NewAction:
    """An action row to insert (the intent, written before anything runs)."""

    kind: str
    target: str
    idempotency_key: str
    seq: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    state: str = "pending"
    result: str = ""


@dataclass(frozen=True)
class FreshNode:
    """In-memory freshness flushed in batches (the report path never writes per report)."""

    name: str
    last_report_at: float
    instance: str
    agent_version: str
    labels: dict[str, str]


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)


def _json_list(values: Iterable[Any]) -> str:
    return _json(list(values))


_R = TypeVar("_R")


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _from_row(cls: type[_R], row: Row, **decoded: Any) -> _R:
    """The dataclass `cls` from the row's columns of the same names; `decoded` gives the
    fields not stored as they are read (JSON text, another column's name, computed)."""
    stored = {name: row[name] for name in _field_names(cls) if name not in decoded}
    return cls(**stored, **decoded)


_TIMELINE_INSERT = (
    "INSERT INTO incident_timeline (incident_id, ts, kind, message, data) VALUES (?, ?, ?, ?, ?)"
)


def _note(
    c: Connection,
    incident_id: int,
    *,
    ts: float,
    kind: str,
    message: str,
    data: dict[str, Any],
    touch: bool,
) -> None:
    """Add one timeline entry; `touch`: also move the incident's updated_at to `ts`."""
    c.execute(_TIMELINE_INSERT, (incident_id, ts, kind, message, _json(data)))
    if touch:
        c.execute("UPDATE incidents SET updated_at = ? WHERE id = ?", (ts, incident_id))


# the columns `update_node` / `update_job` may set
_NODE_COLUMNS = frozenset({"role", "state", "drain_reason", "job", "labels"})
_JOB_COLUMNS = frozenset(
    {
        "state",
        "nodes",
        "nproc_per_node",
        "ckpt_step",
        "last_step",
        "hwm_step",
        "started_at",
        "ended_at",
        "productive_s",
        "sampled_at",
        "state_reason",
        "attempt_started_at",
    }
)


class WriteFence(Protocol):
    """What decides whether this process may write (HA: the leader lease, controller/lease.py).
    `check` runs first in every write transaction, on its connection, and raises
    (errors.NotLeader) to refuse it: the transaction then writes nothing."""

    def check(self, c: Connection) -> None: ...


class Store:
    """The store. Open with `Store(path, now=...)` (SQLite) or `Store("postgresql://...",
    now=..., password=...)`; migrates an older schema forward."""

    def __init__(
        self,
        path: str | Path,
        *,
        now: Callable[[], float],
        password: str | None = None,
        connect_timeout_s: int = 10,
    ) -> None:
        self._now = now
        self._lock = threading.RLock()
        # None (one controller): every write goes through. HA sets it before the first write.
        self.fence: WriteFence | None = None
        if is_postgres_url(str(path)):
            self._open_postgres(str(path), password=password, timeout_s=connect_timeout_s)
            return
        self.dialect = SQLITE
        self.path = str(path)
        existed = self.path != ":memory:" and Path(self.path).exists()
        if existed:
            check_existing_file(self.path)
        if self.path != ":memory:":
            parent = Path(self.path).parent
            try:
                parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise StoreError(f"{self.path}: cannot create directory: {e.strerror}") from None
        try:
            self._conn = sqlite3.connect(
                self.path, isolation_level=None, check_same_thread=False, timeout=30.0
            )
        except sqlite3.Error as e:
            raise StoreError(f"{self.path}: cannot open: {e}") from None
        self._conn.row_factory = sqlite3.Row
        try:
            if existed:
                verify_connection(self._conn, self.path)
            # takes effect at once on a new file (before its first table); an older file is
            # switched by the VACUUM in _switch_to_incremental_vacuum
            self._conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._migrate()
            self._switch_to_incremental_vacuum()
        except StoreError:
            self._conn.close()
            raise
        except sqlite3.DatabaseError as e:
            self._conn.close()
            raise StoreError(
                f"{self.path}: not a usable trainguard store: {e}; {RESTORE_HINT}"
            ) from None

    def _open_postgres(self, url: str, *, password: str | None, timeout_s: int) -> None:
        self.dialect = POSTGRES
        try:
            pg = connect_postgres(url, password=password, connect_timeout_s=timeout_s)
        except StoreConnectError as e:
            raise StoreError(str(e)) from None
        self.path = pg.safe_url  # what messages and logs name: never the password
        self._pg = pg
        self._conn = pg  # type: ignore[assignment]
        try:
            self._migrate()
        except StoreError:
            pg.close()
            raise
        except Exception as e:  # psycopg's errors: the extra may be the only place they exist
            pg.close()
            detail = " ".join(str(e).split())
            raise StoreError(f"{self.path}: not a usable trainguard store: {detail}") from None

    # --- plumbing ---------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error), holding the store lock; on
        PostgreSQL BEGIN (READ COMMITTED) ... COMMIT. With a `fence`, its check runs first,
        in the transaction: a refused one writes nothing."""
        fence = self.fence
        if self.dialect.postgres:
            with self._lock, self._pg.transaction() as pg:
                if fence is not None:
                    fence.check(pg)
                yield pg
            return
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                if fence is not None:
                    fence.check(self._conn)
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def check_fence(self) -> None:
        """Raise what the fence raises unless this process may write now (HA: it holds the
        lease, checked in the store); a no-op without a fence. The action worker calls it
        before each step's side effects outside the store."""
        if self.fence is None:
            return
        with self.transaction():
            pass

    def _query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            return self._conn.execute(sql, args).fetchall()

    def _update_row(
        self,
        kind: str,
        name: str,
        changes: dict[str, Any],
        allowed: frozenset[str],
        *,
        encode: dict[str, Callable[[Any], str]],
    ) -> None:
        """Set `changes` (columns in `allowed`; those in `encode` stored as it writes them) and
        updated_at on the row `name` of the `kind` table (nodes, jobs)."""
        bad = set(changes) - allowed
        if bad:
            raise ValueError(f"cannot update {kind} columns {sorted(bad)}")
        for column, to_text in encode.items():
            if column in changes:
                changes[column] = to_text(changes[column])
        sets = ", ".join(f"{k} = ?" for k in changes)
        with self.transaction() as c:
            c.execute(
                f"UPDATE {kind}s SET {sets}, updated_at = ? WHERE name = ?",  # noqa: S608
                (*changes.values(), self._now(), name),
            )

    def schema_version(self) -> int:
        with self._lock:
            row = self._conn.execute("SELECT version FROM schema_version").fetchone()
        return int(row[0])

    def _migrate(self) -> None:
        with self.transaction() as c:
            if self.dialect.postgres:
                # two controllers starting at once: the second waits, then finds it done
                c.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            c.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = c.execute("SELECT version FROM schema_version").fetchone()
            version = 0 if row is None else int(row[0])
            if row is None:
                c.execute("INSERT INTO schema_version (version) VALUES (0)")
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: schema version {version} is newer than this controller "
                    f"knows ({SCHEMA_VERSION}); upgrade the controller or restore a backup"
                )
            for n in range(version, SCHEMA_VERSION):
                MIGRATIONS[n](c)
                c.execute("UPDATE schema_version SET version = ?", (n + 1,))

    def _switch_to_incremental_vacuum(self) -> None:
        """Rewrite a file made before schema version 4 once (VACUUM) so that it is
        auto_vacuum=INCREMENTAL: without it, pages freed by retention are reused but the file
        never shrinks. The rewrite needs free disk about the file's size and takes seconds per
        GB; if it fails (a full disk, the very case retention is for) the controller starts
        anyway and tries again at the next start."""
        if self.dialect.postgres or self.auto_vacuum_mode() == AUTO_VACUUM_INCREMENTAL:
            return
        with self._lock:
            try:
                self._conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
                self._conn.execute("VACUUM")
            except sqlite3.OperationalError as e:
                log.warning("event=store_vacuum_switch_failed store=%s error=%s", self.path, e)
                return
        log.info("event=store_vacuum_switched store=%s auto_vacuum=incremental", self.path)

    def auto_vacuum_mode(self) -> int:
        """PRAGMA auto_vacuum: 0 none, 1 full, 2 incremental."""
        return int(self._query("PRAGMA auto_vacuum")[0][0])

    # --- size: retention, vacuum, WAL checkpoint --------------------------------------------

    def expire_events(self, *, now: float, max_age_s: float, limit: int) -> int:
        """Delete up to `limit` events received more than `max_age_s` before `now`, oldest
        first, in one transaction; returns how many. Kept whatever their age: the events of a
        node with an unresolved incident received within `max_age_s` before that incident
        opened (its evidence: the age counts from the opening while it is unresolved), and
        each node's newest event of its current agent instance (the high-water mark a restarted
        controller acknowledges from, `max_event_id`)."""
        with self.transaction() as c:
            cur = c.execute(
                """
                DELETE FROM events WHERE id IN (
                    SELECT e.id FROM events e LEFT JOIN (
                        SELECT node, MIN(opened_at) - :age AS since FROM incidents
                        WHERE state != 'resolved' AND node IS NOT NULL GROUP BY node
                    ) h ON h.node = e.node
                    WHERE e.received_at < :cutoff
                    AND (h.node IS NULL OR e.received_at < h.since)
                    AND NOT EXISTS (
                        SELECT 1 FROM nodes n WHERE n.name = e.node AND n.instance = e.instance
                        AND NOT EXISTS (
                            SELECT 1 FROM events m WHERE m.node = e.node
                            AND m.instance = e.instance AND m.event_id > e.event_id
                        )
                    )
                    ORDER BY e.received_at LIMIT :limit
                )
                """,
                {"age": max_age_s, "cutoff": now - max_age_s, "limit": limit},
            )
            return cur.rowcount

    def expire_commands(self, *, now: float, max_age_s: float, limit: int) -> int:
        """Delete up to `limit` finished commands whose result came more than `max_age_s`
        before `now`; a command still waiting for its result is never deleted."""
        with self.transaction() as c:
            cur = c.execute(
                "DELETE FROM commands WHERE id IN (SELECT id FROM commands"
                " WHERE done_at IS NOT NULL AND done_at < ? ORDER BY done_at LIMIT ?)",
                (now - max_age_s, limit),
            )
            return cur.rowcount

    def expire_incidents(self, *, now: float, max_age_s: float, limit: int) -> dict[str, int]:
        """Delete resolved incidents resolved more than `max_age_s` before `now`, each with its
        timeline and actions, in one transaction of about `limit` rows (whole incidents: one
        larger than `limit` goes alone). Never an unresolved incident, nor one holding a step
        that is not final (see _INCIDENT_EXPIRED). Returns rows deleted per table."""
        with self.transaction() as c:
            rows = c.execute(
                f"""
                SELECT i.id,
                    (SELECT COUNT(*) FROM incident_timeline t WHERE t.incident_id = i.id)
                    + (SELECT COUNT(*) FROM actions a WHERE a.incident_id = i.id) + 1
                FROM incidents i WHERE {_INCIDENT_EXPIRED} ORDER BY i.id LIMIT :limit
                """,  # noqa: S608 (a constant of this module)
                {"cutoff": now - max_age_s, "limit": limit},
            ).fetchall()
            ids: list[int] = []
            total = 0
            for incident_id, n in rows:
                if ids and total + int(n) > limit:
                    break
                ids.append(int(incident_id))
                total += int(n)
            if not ids:
                return {"incidents": 0, "incident_timeline": 0, "actions": 0}
            chosen = (_json(ids),)
            id_list = self.dialect.id_list()
            timeline = c.execute(
                f"DELETE FROM incident_timeline WHERE incident_id IN {id_list}",  # noqa: S608
                chosen,
            ).rowcount
            actions = c.execute(
                f"DELETE FROM actions WHERE incident_id IN {id_list}",  # noqa: S608
                chosen,
            ).rowcount
            incidents = c.execute(
                f"DELETE FROM incidents WHERE id IN {id_list}",  # noqa: S608
                chosen,
            ).rowcount
        return {"incidents": incidents, "incident_timeline": timeline, "actions": actions}

    def expire_operator_actions(self, *, now: float, max_age_s: float, limit: int) -> int:
        """Delete up to `limit` steps of no incident (operator drains, job submissions and
        restarts) in a final state, last changed more than `max_age_s` before `now`. Kept: the
        step that began a job's current attempt and a drain of a node still out of service."""
        with self.transaction() as c:
            cur = c.execute(
                """
                DELETE FROM actions WHERE id IN (
                    SELECT a.id FROM actions a
                    WHERE a.incident_id IS NULL AND a.state IN ('succeeded', 'failed', 'skipped')
                    AND a.updated_at < ?
                    AND NOT EXISTS (SELECT 1 FROM jobs j WHERE j.attempt_key = a.idempotency_key)
                    AND NOT (a.kind = 'drain' AND EXISTS (
                        SELECT 1 FROM nodes n WHERE n.name = a.target AND n.state != 'active'))
                    ORDER BY a.id LIMIT ?
                )
                """,
                (now - max_age_s, limit),
            )
            return cur.rowcount

    def expire_audit(self, *, now: float, max_age_s: float, limit: int) -> int:
        """Delete up to `limit` audit entries older than `max_age_s` before `now`."""
        with self.transaction() as c:
            cur = c.execute(
                "DELETE FROM audit_log WHERE id IN"
                " (SELECT id FROM audit_log WHERE ts < ? ORDER BY ts LIMIT ?)",
                (now - max_age_s, limit),
            )
            return cur.rowcount

    def page_counts(self) -> tuple[int, int]:
        """(pages in the file, of which free): what incremental_vacuum can give back.
        PostgreSQL: (0, 0), its space is autovacuum's."""
        if self.dialect.postgres:
            return 0, 0
        with self._lock:
            pages = int(self._conn.execute("PRAGMA page_count").fetchone()[0])
            free = int(self._conn.execute("PRAGMA freelist_count").fetchone()[0])
        return pages, free

    def incremental_vacuum(self, *, pages: int) -> int:
        """Give up to `pages` free pages back to the filesystem; returns how many went.
        In WAL mode the file itself shrinks at the next checkpoint. PostgreSQL: 0 (autovacuum
        reclaims dead rows; the store never runs VACUUM FULL, which locks the tables)."""
        if pages < 1 or self.dialect.postgres:
            return 0
        with self._lock:
            if self._conn.in_transaction:
                raise RuntimeError("incremental_vacuum inside a transaction")
            before = int(self._conn.execute("PRAGMA freelist_count").fetchone()[0])
            # executescript steps the pragma to the end; execute() would free a single page
            self._conn.executescript(f"PRAGMA incremental_vacuum({int(pages)})")
            after = int(self._conn.execute("PRAGMA freelist_count").fetchone()[0])
        return before - after

    def checkpoint_wal(self, *, mode: str = "TRUNCATE") -> tuple[bool, int, int]:
        """PRAGMA wal_checkpoint(mode): (busy, frames in the WAL, frames checkpointed).
        TRUNCATE copies every frame into the file and cuts the -wal file to 0 bytes; with this
        store's one connection held by the lock, nothing in this process can be reading or
        writing meanwhile, so only another process (a backup) can make it busy."""
        if mode not in ("PASSIVE", "FULL", "RESTART", "TRUNCATE"):
            raise ValueError(f"unknown checkpoint mode {mode!r}")
        if self.dialect.postgres:  # the server checkpoints its own WAL
            return False, 0, 0
        with self._lock:
            row = self._conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
        return bool(row[0]), int(row[1]), int(row[2])

    def file_sizes(self) -> tuple[int, int]:
        """(bytes of the database file, bytes of its -wal file); 0 for what does not exist.
        PostgreSQL: (pg_database_size, 0); (0, 0) while the server cannot be asked."""
        if self.dialect.postgres:
            try:
                rows = self._query("SELECT pg_database_size(current_database())")
            except Exception:  # a metrics scrape must not fail with the database away
                return 0, 0
            return int(rows[0][0]), 0
        if self.path == ":memory:":
            return 0, 0
        sizes = []
        for name in (self.path, self.path + "-wal"):
            try:
                sizes.append(os.stat(name).st_size)
            except OSError:
                sizes.append(0)
        return sizes[0], sizes[1]

    # --- nodes ------------------------------------------------------------------------------

    @staticmethod
    def _node(row: Row) -> NodeRecord:
        return _from_row(NodeRecord, row, labels=json.loads(row["labels"]))

    def list_nodes(self) -> list[NodeRecord]:
        return [self._node(r) for r in self._query("SELECT * FROM nodes ORDER BY name")]

    def get_node(self, name: str) -> NodeRecord | None:
        rows = self._query("SELECT * FROM nodes WHERE name = ?", (name,))
        return self._node(rows[0]) if rows else None

    def add_node(self, name: str, *, role: str, labels: dict[str, str]) -> NodeRecord:
        now = self._now()
        with self.transaction() as c:
            c.execute(
                "INSERT INTO nodes (name, role, state, labels, created_at, updated_at)"
                " VALUES (?, ?, 'active', ?, ?, ?) ON CONFLICT DO NOTHING",
                (name, role, _json(labels), now, now),
            )
        node = self.get_node(name)
        assert node is not None
        return node

    def update_node(self, name: str, **changes: Any) -> NodeRecord:
        """Set columns of one node (role, state, drain_reason, job, labels)."""
        self._update_row("node", name, changes, _NODE_COLUMNS, encode={"labels": _json})
        node = self.get_node(name)
        if node is None:
            raise KeyError(name)
        return node

    def flush_freshness(self, fresh: Iterable[FreshNode]) -> int:
        """Write a batch of in-memory report freshness in one transaction: on SQLite one
        UPDATE per node (in-process, microseconds each); on PostgreSQL one UPDATE of the
        whole batch joined to its columns as arrays (one round trip and one statement to
        plan, instead of one per node: what a tick at 1,024 nodes pays)."""
        rows = [
            (f.last_report_at, f.instance, f.agent_version, _json(f.labels), f.name) for f in fresh
        ]
        if not rows:
            return 0
        with self.transaction() as c:
            if self.dialect.postgres:
                at, instance, version, labels, name = (list(col) for col in zip(*rows, strict=True))
                c.execute(
                    "UPDATE nodes SET last_report_at = v.at, instance = v.instance,"
                    " agent_version = v.version, labels = v.labels"
                    " FROM unnest(CAST(? AS DOUBLE PRECISION[]), CAST(? AS TEXT[]),"
                    " CAST(? AS TEXT[]), CAST(? AS TEXT[]), CAST(? AS TEXT[]))"
                    " AS v(at, instance, version, labels, name) WHERE nodes.name = v.name",
                    (at, instance, version, labels, name),
                )
            else:
                c.executemany(
                    "UPDATE nodes SET last_report_at = ?, instance = ?, agent_version = ?,"
                    " labels = ? WHERE name = ?",
                    rows,
                )
        return len(rows)

    # --- jobs (minimal: the closed-loop work extends this table via a migration) -------------

    def upsert_job(self, name: str, *, state: str, nodes: Sequence[str]) -> None:
        now = self._now()
        with self.transaction() as c:
            c.execute(
                "INSERT INTO jobs (name, state, nodes, created_at, updated_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (name) DO UPDATE SET"
                " state = excluded.state, nodes = excluded.nodes, updated_at = excluded.updated_at",
                (name, state, _json(sorted(nodes)), now, now),
            )

    def list_jobs(self) -> list[dict[str, Any]]:
        return [
            {
                "name": r["name"],
                "state": r["state"],
                "nodes": tuple(json.loads(r["nodes"])),
                "attempt": r["attempt"],
                "spec": json.loads(r["spec"]),
            }
            for r in self._query("SELECT * FROM jobs ORDER BY name")
        ]

    @staticmethod
    def _job(row: Row) -> JobRecord:
        return _from_row(
            JobRecord,
            row,
            spec=json.loads(row["spec"]),
            nodes=tuple(json.loads(row["nodes"])),
            attempt_nodes=tuple(json.loads(row["attempt_nodes"])),
        )

    def get_job(self, name: str) -> JobRecord | None:
        rows = self._query("SELECT * FROM jobs WHERE name = ?", (name,))
        return self._job(rows[0]) if rows else None

    def job_records(self) -> list[JobRecord]:
        return [self._job(r) for r in self._query("SELECT * FROM jobs ORDER BY name")]

    def submit_job(
        self,
        name: str,
        *,
        spec: dict[str, Any],
        nodes: Sequence[str],
        nproc_per_node: int,
        min_nodes: int,
        ts: float,
        replace_states: Sequence[str],
    ) -> JobRecord | None:
        """Insert a job in state `pending`, or replace one whose state is in `replace_states`
        (a finished job resubmitted; its attempt counter carries on so rendezvous ids and
        command ids never repeat). None when a job of that name exists in another state."""
        with self.transaction() as c:
            row = c.execute(
                f"SELECT state FROM jobs WHERE name = ?{self.dialect.for_update}",  # noqa: S608
                (name,),
            ).fetchone()
            if row is not None and row[0] not in replace_states:
                return None
            values = (_json(spec), _json(list(nodes)), nproc_per_node, min_nodes, ts)
            if row is None:
                c.execute(
                    "INSERT INTO jobs (name, spec, state, nodes, nproc_per_node, min_nodes,"
                    " created_at, updated_at) VALUES (?, ?, 'pending', ?, ?, ?, ?, ?)",
                    (name, *values[:-1], ts, ts),
                )
            else:
                c.execute(
                    "UPDATE jobs SET spec = ?, nodes = ?, nproc_per_node = ?, min_nodes = ?,"
                    " updated_at = ?, state = 'pending', state_reason = '', restarts = 0,"
                    " started_at = NULL, ended_at = NULL, productive_s = 0, sampled_at = NULL,"
                    " ckpt_step = NULL, last_step = NULL, hwm_step = NULL, attempt_nodes = '[]'"
                    " WHERE name = ?",
                    (*values, name),
                )
        return self.get_job(name)

    def update_job(self, name: str, **changes: Any) -> JobRecord:
        """Set columns of one job; tuples/lists (nodes) are stored as JSON."""
        self._update_row("job", name, changes, _JOB_COLUMNS, encode={"nodes": _json_list})
        job = self.get_job(name)
        if job is None:
            raise KeyError(name)
        return job

    def begin_attempt(
        self,
        name: str,
        *,
        key: str,
        rdzv_port: Callable[[int], int],
        ts: float,
        counts_restart: bool = True,
    ) -> tuple[JobRecord, bool]:
        """The attempt that step `key` starts: the current one if this key began it already
        (a re-run after a crash), else attempt+1 on the job's current nodes, in one
        transaction; a later attempt counts as a restart unless `counts_restart` is False (a
        grow back to full size). Returns (job, began_now)."""
        with self.transaction() as c:
            row = c.execute(
                "SELECT attempt, attempt_key, nodes FROM jobs WHERE name = ?"  # noqa: S608
                + self.dialect.for_update,
                (name,),
            ).fetchone()
            if row is None:
                raise KeyError(name)
            began = row["attempt_key"] != key
            if began:
                attempt = int(row["attempt"]) + 1
                c.execute(
                    "UPDATE jobs SET attempt = ?, attempt_key = ?, attempt_nodes = nodes,"
                    " rdzv_port = ?, restarts = restarts + CASE WHEN ? > 1 THEN 1 ELSE 0 END,"
                    " state = 'starting', state_reason = '', attempt_started_at = ?,"
                    " updated_at = ? WHERE name = ?",
                    (
                        attempt,
                        key,
                        rdzv_port(attempt),
                        attempt if counts_restart else 0,
                        ts,
                        ts,
                        name,
                    ),
                )
        job = self.get_job(name)
        assert job is not None
        return job, began

    def set_job_placement(
        self,
        name: str,
        *,
        nodes: Sequence[str],
        nproc_per_node: int,
        assign: Sequence[str],
        release: Sequence[str],
    ) -> JobRecord:
        """Move a job to a new node set in one transaction: `assign` nodes become active
        members of the job (a spare leaves the pool), `release` nodes leave it."""
        now = self._now()
        with self.transaction() as c:
            c.execute(
                "UPDATE jobs SET nodes = ?, nproc_per_node = ?, updated_at = ? WHERE name = ?",
                (_json(list(nodes)), nproc_per_node, now, name),
            )
            for node in release:
                c.execute(
                    "UPDATE nodes SET job = NULL, updated_at = ? WHERE name = ? AND job = ?",
                    (now, node, name),
                )
            for node in assign:
                c.execute(
                    "UPDATE nodes SET job = ?, role = 'active', updated_at = ? WHERE name = ?",
                    (name, now, node),
                )
        job = self.get_job(name)
        assert job is not None
        return job

    # --- events -----------------------------------------------------------------------------

    def max_event_id(self, node: str, instance: str) -> int:
        rows = self._query(
            "SELECT MAX(event_id) FROM events WHERE node = ? AND instance = ?", (node, instance)
        )
        value = rows[0][0]
        return 0 if value is None else int(value)

    def insert_events(
        self,
        node: str,
        instance: str,
        events: Sequence[tuple[int, str, float, dict[str, Any]]],
        *,
        command_results: Sequence[CommandResultRow] = (),
    ) -> None:
        """Store (event_id, kind, ts, body) rows (duplicates ignored) and complete commands
        named by `command_result` events, in one transaction."""
        now = self._now()
        with self.transaction() as c:
            c.executemany(
                "INSERT INTO events (node, instance, event_id, kind, ts, body,"
                " received_at) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                [
                    (node, instance, eid, kind, ts, _json(body), now)
                    for eid, kind, ts, body in events
                ],
            )
            c.executemany(
                "UPDATE commands SET done_at = ?, ok = ?, result = ?, data = ?"
                " WHERE id = ? AND node = ? AND done_at IS NULL",
                [
                    (now, int(r.ok), r.message, _json(r.data), r.command_id, node)
                    for r in command_results
                ],
            )

    def count_events(self, node: str) -> int:
        return int(self._query("SELECT COUNT(*) FROM events WHERE node = ?", (node,))[0][0])

    def events_received_since(
        self, since: float, *, kinds: Collection[str]
    ) -> list[tuple[str, float, dict[str, Any]]]:
        """(node, received_at, event as sent) of the events of `kinds` received at or after
        `since`, in the order they were stored: what a restarted controller replays into its
        signal history before its first tick."""
        rows = self._query(
            "SELECT node, received_at, kind, body FROM events WHERE received_at >= ? ORDER BY id",
            (since,),
        )
        return [(str(r[0]), float(r[1]), json.loads(r[3])) for r in rows if r[2] in kinds]

    # --- commands ---------------------------------------------------------------------------

    @staticmethod
    def _command(row: Row) -> CommandRecord:
        return _from_row(
            CommandRecord,
            row,
            args=json.loads(row["args"]),
            ok=None if row["ok"] is None else bool(row["ok"]),
            data=json.loads(row["data"]),
        )

    def add_command(self, command_id: str, *, node: str, kind: str, args: dict[str, Any]) -> bool:
        """Queue a command; False if this id already exists (idempotent by id)."""
        with self.transaction() as c:
            cur = c.execute(
                "INSERT INTO commands (id, node, kind, args, created_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (command_id, node, kind, _json(args), self._now()),
            )
            return cur.rowcount == 1

    def get_command(self, command_id: str) -> CommandRecord | None:
        rows = self._query("SELECT * FROM commands WHERE id = ?", (command_id,))
        return self._command(rows[0]) if rows else None

    def pending_commands(self, node: str | None = None) -> list[CommandRecord]:
        if node is None:
            rows = self._query("SELECT * FROM commands WHERE done_at IS NULL ORDER BY created_at")
        else:
            rows = self._query(
                "SELECT * FROM commands WHERE done_at IS NULL AND node = ? ORDER BY created_at",
                (node,),
            )
        return [self._command(r) for r in rows]

    def mark_delivered(self, command_ids: Sequence[str]) -> None:
        with self.transaction() as c:
            c.executemany(
                "UPDATE commands SET delivered_at = ? WHERE id = ? AND delivered_at IS NULL",
                [(self._now(), cid) for cid in command_ids],
            )

    def finish_command(self, command_id: str, *, ok: bool, result: str) -> bool:
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE commands SET done_at = ?, ok = ?, result = ?"
                " WHERE id = ? AND done_at IS NULL",
                (self._now(), int(ok), result, command_id),
            )
            return cur.rowcount == 1

    # --- incidents --------------------------------------------------------------------------

    @staticmethod
    def _incident(row: Row) -> IncidentView:
        # the view's `target` is the key; the table's `target` column is the JSON target
        return _from_row(IncidentView, row, target=row["target_key"])

    def create_incident(
        self,
        *,
        rule: str,
        target_key: str,
        target: dict[str, Any],
        target_text: str,
        severity: str,
        summary: str,
        node: str | None,
        job: str | None,
        ts: float,
        timeline: Sequence[tuple[str, str, dict[str, Any]]],
    ) -> int:
        with self.transaction() as c:
            cur = c.execute(
                "INSERT INTO incidents (rule, target_key, target, target_text, severity, state,"
                " summary, node, job, opened_at, updated_at) VALUES"
                " (?, ?, ?, ?, ?, 'open', ?, ?, ?, ?, ?)" + self.dialect.returning_id,
                (
                    rule,
                    target_key,
                    _json(target),
                    target_text,
                    severity,
                    summary,
                    node,
                    job,
                    ts,
                    ts,
                ),
            )
            incident_id = self.dialect.inserted_id(cur)
            c.executemany(
                _TIMELINE_INSERT, [(incident_id, ts, k, m, _json(d)) for k, m, d in timeline]
            )
        return incident_id

    def set_incident_state(
        self,
        incident_id: int,
        state: str,
        *,
        ts: float,
        kind: str,
        message: str,
        data: dict[str, Any] | None = None,
    ) -> None:
        with self.transaction() as c:
            c.execute(
                "UPDATE incidents SET state = ?, updated_at = ?,"
                " resolved_at = CASE WHEN ? = 'resolved' THEN ? ELSE resolved_at END"
                " WHERE id = ?",
                (state, ts, state, ts, incident_id),
            )
            _note(c, incident_id, ts=ts, kind=kind, message=message, data=data or {}, touch=False)

    def add_timeline(
        self,
        incident_id: int,
        *,
        ts: float,
        kind: str,
        message: str,
        data: dict[str, Any] | None = None,
    ) -> None:
        with self.transaction() as c:
            _note(c, incident_id, ts=ts, kind=kind, message=message, data=data or {}, touch=True)

    def get_incident(self, incident_id: int) -> IncidentView | None:
        rows = self._query("SELECT * FROM incidents WHERE id = ?", (incident_id,))
        return self._incident(rows[0]) if rows else None

    def incident_target(self, incident_id: int) -> dict[str, Any]:
        rows = self._query("SELECT target FROM incidents WHERE id = ?", (incident_id,))
        return json.loads(rows[0][0]) if rows else {}

    def list_incidents(
        self, *, state: str | None = None, node: str | None = None, limit: int = 100
    ) -> list[IncidentView]:
        where, args = [], []
        if state is not None:
            where.append("state = ?")
            args.append(state)
        if node is not None:
            where.append("node = ?")
            args.append(node)
        sql = "SELECT * FROM incidents"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY id DESC LIMIT ?"
        return [self._incident(r) for r in self._query(sql, (*args, limit))]

    def unresolved_incidents(self) -> list[IncidentView]:
        rows = self._query("SELECT * FROM incidents WHERE state != 'resolved' ORDER BY id")
        return [self._incident(r) for r in rows]

    def last_incident(self, rule: str, target_key: str) -> IncidentView | None:
        rows = self._query(
            "SELECT * FROM incidents WHERE rule = ? AND target_key = ? ORDER BY id DESC LIMIT 1",
            (rule, target_key),
        )
        return self._incident(rows[0]) if rows else None

    def nodes_tripping_rule(self, rule: str, *, since: float) -> set[str]:
        rows = self._query(
            "SELECT DISTINCT node FROM incidents WHERE rule = ? AND opened_at >= ?"
            " AND node IS NOT NULL",
            (rule, since),
        )
        return {r[0] for r in rows}

    def open_incident_counts(self) -> dict[str, int]:
        """Unresolved incidents per node."""
        rows = self._query(
            "SELECT node, COUNT(*) FROM incidents WHERE state != 'resolved' AND node IS NOT NULL"
            " GROUP BY node"
        )
        return {r[0]: int(r[1]) for r in rows}

    def timeline(self, incident_id: int) -> list[TimelineEntry]:
        # by time, then insertion: the tick and the action worker stamp entries with the "now"
        # each read, so insertion order can trail time by the width of a race
        rows = self._query(
            "SELECT * FROM incident_timeline WHERE incident_id = ? ORDER BY ts, id", (incident_id,)
        )
        return [_from_row(TimelineEntry, r, data=json.loads(r["data"])) for r in rows]

    # --- actions ----------------------------------------------------------------------------

    @staticmethod
    def _action(row: Row) -> ActionView:
        return _from_row(ActionView, row, params=json.loads(row["params"]))

    def add_actions(
        self,
        incident_id: int | None,
        actions: Sequence[NewAction],
        *,
        ts: float,
        timeline: Sequence[tuple[str, str, dict[str, Any]]] = (),
    ) -> list[int]:
        """Insert the intent rows (duplicates by idempotency key are ignored) plus timeline
        notes, in one transaction. Returns the ids of the rows for these keys."""
        ids: list[int] = []
        with self.transaction() as c:
            for a in actions:
                c.execute(
                    "INSERT INTO actions (incident_id, seq, kind, target, params, state,"
                    " idempotency_key, next_attempt_at, result, created_at, updated_at)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    (
                        incident_id,
                        a.seq,
                        a.kind,
                        a.target,
                        _json(a.params),
                        a.state,
                        a.idempotency_key,
                        ts,
                        a.result,
                        ts,
                        ts,
                    ),
                )
                row = c.execute(
                    "SELECT id FROM actions WHERE idempotency_key = ?", (a.idempotency_key,)
                ).fetchone()
                ids.append(int(row[0]))
            if incident_id is not None:
                c.executemany(
                    _TIMELINE_INSERT, [(incident_id, ts, k, m, _json(d)) for k, m, d in timeline]
                )
        return ids

    def get_action(self, action_id: int) -> ActionView | None:
        rows = self._query("SELECT * FROM actions WHERE id = ?", (action_id,))
        return self._action(rows[0]) if rows else None

    def action_by_key(self, idempotency_key: str) -> ActionView | None:
        rows = self._query("SELECT * FROM actions WHERE idempotency_key = ?", (idempotency_key,))
        return self._action(rows[0]) if rows else None

    def last_shrink_incident(self, job: str) -> int | None:
        """The incident whose replace or restart step last shrank `job`'s world size (output
        mode "shrink_world"), or None."""
        field = self.dialect.json_text
        rows = self._query(
            "SELECT incident_id FROM actions WHERE incident_id IS NOT NULL"  # noqa: S608
            f" AND kind IN ('replace', 'restart') AND {field('output', 'job')} = ?"
            f" AND ({field('output', 'mode')} = 'shrink_world'"
            f" OR {field('output', 'replaced', 'mode')} = 'shrink_world')"
            " ORDER BY id DESC LIMIT 1",
            (job,),
        )
        return int(rows[0][0]) if rows else None

    def last_drain(self, node: str) -> ActionView | None:
        """The newest drain row of `node` that was not skipped or failed (an incident's or an
        operator's)."""
        rows = self._query(
            "SELECT * FROM actions WHERE kind = 'drain' AND target = ?"
            " AND state IN ('pending', 'running', 'succeeded') ORDER BY id DESC LIMIT 1",
            (node,),
        )
        return self._action(rows[0]) if rows else None

    def action_output(self, action_id: int) -> dict[str, Any]:
        rows = self._query("SELECT output FROM actions WHERE id = ?", (action_id,))
        return json.loads(rows[0][0]) if rows else {}

    def actions_for_incident(self, incident_id: int) -> list[ActionView]:
        rows = self._query(
            "SELECT * FROM actions WHERE incident_id = ? ORDER BY seq, id", (incident_id,)
        )
        return [self._action(r) for r in rows]

    def open_actions(self) -> list[tuple[ActionView, float]]:
        """Pending and running rows with their next_attempt_at, oldest first."""
        rows = self._query(
            "SELECT * FROM actions WHERE state IN ('pending', 'running') ORDER BY id"
        )
        return [(self._action(r), float(r["next_attempt_at"])) for r in rows]

    def next_attempt_at(self, action_id: int) -> float:
        rows = self._query("SELECT next_attempt_at FROM actions WHERE id = ?", (action_id,))
        return float(rows[0][0])

    def update_action(
        self,
        action_id: int,
        *,
        state: str,
        ts: float,
        result: str | None = None,
        output: dict[str, Any] | None = None,
        attempts_delta: int = 0,
        next_attempt_at: float | None = None,
        timeline: tuple[int, str, str, dict[str, Any]] | None = None,
    ) -> None:
        """Move one action row (and optionally add an incident timeline entry), atomically."""
        sets = ["state = ?", "updated_at = ?", "attempts = attempts + ?"]
        args: list[Any] = [state, ts, attempts_delta]
        if result is not None:
            sets.append("result = ?")
            args.append(result)
        if output is not None:
            sets.append("output = ?")
            args.append(_json(output))
        if next_attempt_at is not None:
            sets.append("next_attempt_at = ?")
            args.append(next_attempt_at)
        with self.transaction() as c:
            c.execute(
                f"UPDATE actions SET {', '.join(sets)} WHERE id = ?",  # noqa: S608
                (*args, action_id),
            )
            if timeline is not None:
                incident_id, kind, message, data = timeline
                _note(c, incident_id, ts=ts, kind=kind, message=message, data=data, touch=True)

    def count_auto_drains(self, *, since: float) -> int:
        """Automatic (incident-driven) drains that were not skipped/failed since `since`."""
        rows = self._query(
            "SELECT COUNT(*) FROM actions WHERE kind = 'drain' AND incident_id IS NOT NULL"
            " AND state IN ('pending', 'running', 'succeeded') AND created_at >= ?",
            (since,),
        )
        return int(rows[0][0])

    # --- silences ---------------------------------------------------------------------------

    @staticmethod
    def _silence(row: Row, now: float) -> SilenceView:
        active = row["deleted_at"] is None and row["expires_at"] > now
        return _from_row(SilenceView, row, active=active)

    def add_silence(
        self,
        *,
        rule: str | None,
        node: str | None,
        created_by: str,
        created_at: float,
        expires_at: float,
        comment: str,
    ) -> SilenceView:
        with self.transaction() as c:
            cur = c.execute(
                "INSERT INTO silences (rule, node, created_by, created_at, expires_at, comment)"  # noqa: S608
                f" VALUES (?, ?, ?, ?, ?, ?){self.dialect.returning_id}",
                (rule, node, created_by, created_at, expires_at, comment),
            )
            silence_id = self.dialect.inserted_id(cur)
        rows = self._query("SELECT * FROM silences WHERE id = ?", (silence_id,))
        return self._silence(rows[0], created_at)

    def list_silences(self, *, now: float, include_expired: bool) -> list[SilenceView]:
        rows = self._query("SELECT * FROM silences ORDER BY id")
        out = [self._silence(r, now) for r in rows]
        return out if include_expired else [s for s in out if s.active]

    def delete_silence(self, silence_id: int, *, now: float) -> bool:
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE silences SET deleted_at = ? WHERE id = ? AND deleted_at IS NULL",
                (now, silence_id),
            )
            return cur.rowcount == 1

    # --- circuit breakers -------------------------------------------------------------------

    def get_breaker(self, rule: str) -> tuple[float, int | None] | None:
        rows = self._query("SELECT tripped_at, incident_id FROM breakers WHERE rule = ?", (rule,))
        return (float(rows[0][0]), rows[0][1]) if rows else None

    def trip_breaker(
        self, rule: str, *, tripped_at: float, incident_id: int, nodes: Sequence[str]
    ) -> None:
        with self.transaction() as c:
            c.execute(
                "INSERT INTO breakers (rule, tripped_at, incident_id, nodes) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (rule) DO UPDATE SET tripped_at = excluded.tripped_at,"
                " incident_id = excluded.incident_id, nodes = excluded.nodes",
                (rule, tripped_at, incident_id, _json(sorted(nodes))),
            )

    # --- audit ------------------------------------------------------------------------------

    def audit(
        self, *, ts: float, actor: str, action: str, target: str, detail: dict[str, Any]
    ) -> int:
        with self.transaction() as c:
            cur = c.execute(
                "INSERT INTO audit_log (ts, actor, action, target, detail)"  # noqa: S608
                f" VALUES (?, ?, ?, ?, ?){self.dialect.returning_id}",
                (ts, actor, action, target, _json(detail)),
            )
            return self.dialect.inserted_id(cur)

    def audit_log(self, *, limit: int = 100) -> list[AuditEntry]:
        rows = self._query("SELECT * FROM audit_log ORDER BY id DESC LIMIT ?", (limit,))
        return [_from_row(AuditEntry, r, detail=json.loads(r["detail"])) for r in rows]


__all__ = [
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "TERMINAL_ACTION_STATES",
    "CommandRecord",
    "FreshNode",
    "JobRecord",
    "NewAction",
    "NodeRecord",
    "Store",
    "StoreError",
    "WriteFence",
]
