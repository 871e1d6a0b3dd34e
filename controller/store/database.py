"""The store's one database connection, shared by every repository: opening it (an SQLite
file with its pragmas, or PostgreSQL through store/connection.py), migrating it
(store/schema.py), and the two ways in: `transaction()` for writes and `query()` for reads.

Why these pragmas: WAL lets readers (the API) run while the tick writes. synchronous=NORMAL
in WAL mode makes every commit durable against a process crash (kill -9: the WAL is in the
OS page cache and is replayed on open); only a power loss or kernel crash can drop the last
few commits, and it never corrupts the file. FULL would fsync every commit, which the event
and action paths do not need. Foreign keys are on so a timeline never outlives its incident.

Thread safety: one connection guarded by a re-entrant lock; `transaction()` holds it for a
whole BEGIN IMMEDIATE ... COMMIT so multi-statement changes are atomic, whichever tables they
touch. On PostgreSQL a transaction is READ COMMITTED: a transaction that reads a row and then
writes it depending on what it read (`jobs.submit`, `jobs.begin_attempt`) locks the row
(SELECT ... FOR UPDATE), which SQLite's BEGIN IMMEDIATE (the one write lock) gave for free.
With HA a `fence` (store/lease.py: the leader lease's epoch) is checked first in every write
transaction; a refused one (LeaseLost) writes nothing.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from trainguard.controller.store import schema
from trainguard.controller.store.connection import (
    Connection,
    PgConnection,
    Row,
    connect_postgres,
)
from trainguard.controller.store.dialect import POSTGRES, SQLITE, Dialect
from trainguard.controller.store.errors import StoreConnectError, StoreError
from trainguard.controller.store.sqlitefile import (
    RESTORE_HINT,
    check_existing_file,
    verify_connection,
)
from trainguard.controller.storeurl import is_postgres_url


class WriteFence(Protocol):
    """What decides whether this process may write (HA: the leader lease, store/lease.py).
    `check` runs first in every write transaction, on its connection, and raises (LeaseLost)
    to refuse it: the transaction then writes nothing."""

    def check(self, c: Connection) -> None: ...


class Database:
    """The connection of one store: `Database(path, now=...)` (SQLite) or
    `Database("postgresql://...", now=..., password=...)`; migrates an older schema forward."""

    def __init__(
        self,
        path: str | Path,
        *,
        now: Callable[[], float],
        password: str | None = None,
        connect_timeout_s: int = 10,
    ) -> None:
        self.now = now
        self.lock = threading.RLock()
        # None (one controller): every write goes through. HA sets it before the first write.
        self.fence: WriteFence | None = None
        self._pg: PgConnection | None = None
        if is_postgres_url(str(path)):
            self._open_postgres(str(path), password=password, timeout_s=connect_timeout_s)
            return
        self.dialect: Dialect = SQLITE
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
            # switched by the VACUUM in schema.switch_to_incremental_vacuum
            self._conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            schema.migrate(self)
            schema.switch_to_incremental_vacuum(self)
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
            schema.migrate(self)
        except StoreError:
            pg.close()
            raise
        except Exception as e:  # psycopg's errors: the extra may be the only place they exist
            pg.close()
            detail = " ".join(str(e).split())
            raise StoreError(f"{self.path}: not a usable trainguard store: {detail}") from None

    def close(self) -> None:
        with self.lock:
            self._conn.close()

    @contextmanager
    def transaction(self) -> Iterator[Connection]:
        """BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error), holding the store lock; on
        PostgreSQL BEGIN (READ COMMITTED) ... COMMIT. With a `fence`, its check runs first,
        in the transaction: a refused one writes nothing."""
        fence = self.fence
        if self._pg is not None:
            with self.lock, self._pg.transaction() as pg:
                if fence is not None:
                    fence.check(pg)
                yield pg
            return
        with self.lock:
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
        """Raise what the fence raises (LeaseLost) unless this process may write now (HA: it
        holds the lease, checked in the store); a no-op without a fence."""
        if self.fence is None:
            return
        with self.transaction():
            pass

    def query(self, sql: str, args: Sequence[Any] | dict[str, Any] = ()) -> list[Row]:
        """The rows of one read statement (autocommit, outside any transaction of another
        thread: the lock is held for the statement)."""
        with self.lock:
            return self._conn.execute(sql, args).fetchall()

    @contextmanager
    def sqlite_connection(self) -> Iterator[sqlite3.Connection]:
        """The SQLite connection itself, the lock held, for what has no place in a transaction
        (pragmas that read or free pages, VACUUM, a WAL checkpoint). SQLite stores only."""
        if self._pg is not None:
            raise RuntimeError("sqlite_connection() on a PostgreSQL store")
        with self.lock:
            yield self._conn


__all__ = ["Database", "WriteFence"]
