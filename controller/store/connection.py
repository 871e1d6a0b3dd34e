"""The store's connections: what it uses of one (`Connection`, `Row`), and `PgConnection`, one
psycopg connection used the way the store uses sqlite3's (SQLite's spelling rewritten by
store/dialect.py; a lost server raises StoreUnavailable). psycopg (the `postgres` extra) is
imported only when a PostgreSQL store is opened.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol
from urllib.parse import parse_qsl, urlsplit

from trainguard.controller.store.dialect import postgres_sql
from trainguard.controller.store.errors import StoreConnectError, StoreUnavailable
from trainguard.controller.storeurl import redact_url

POSTGRES_EXTRA_HINT = "pip install 'trainguard[postgres]'"


class Row(Protocol):
    """A result row by column index or name (sqlite3.Row, PgRow)."""

    def __getitem__(self, key: Any, /) -> Any: ...

    def keys(self) -> list[str]: ...


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    @property
    def lastrowid(self) -> int | None: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Connection(Protocol):
    """What the store uses of a connection (sqlite3.Connection, PgConnection)."""

    def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...

    def executemany(self, sql: str, parameters: Any, /) -> Any: ...


# --- PostgreSQL connections ---------------------------------------------------------------------


class PgRow:
    """A PostgreSQL row read like an sqlite3.Row: by index or by column name."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: Mapping[str, int], values: Sequence[Any]) -> None:
        self._index = index
        self._values = values

    def __getitem__(self, key: int | str) -> Any:
        if isinstance(key, str):
            return self._values[self._index[key]]
        return self._values[key]

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._values)

    def keys(self) -> list[str]:
        return list(self._index)


def _pg_row_factory(cursor: Any) -> Any:
    names = [c.name for c in (cursor.description or ())]
    index = {name: i for i, name in enumerate(names)}
    return lambda values: PgRow(index, values)


class PgCursor:
    """The answer of one statement: its rows (fetched at once) and rowcount."""

    def __init__(self, rows: list[Any], rowcount: int) -> None:
        self._rows = rows
        self._next = 0
        self.rowcount = rowcount
        self.lastrowid: int | None = None  # PostgreSQL: INSERT ... RETURNING id

    def fetchone(self) -> Any:
        if self._next >= len(self._rows):
            return None
        self._next += 1
        return self._rows[self._next - 1]

    def fetchall(self) -> list[Any]:
        rows, self._next = self._rows[self._next :], len(self._rows)
        return rows


# A server that vanishes without closing its connections (a powered-off host, a cut network)
# answers nothing: without these a statement waits for the kernel's retransmissions to give
# up (about 15 minutes). Unacknowledged data for longer than this, or an idle connection
# whose keepalive probes go unanswered this long, breaks the connection (StoreUnavailable).
DEFAULT_TCP_TIMEOUT_S = 10.0


def tcp_liveness(url: str, *, timeout_s: float) -> dict[str, int]:
    """libpq keepalive and tcp_user_timeout settings that notice a silent server within
    about `timeout_s`; those the URL sets itself are left to it."""
    given = {k for k, _ in parse_qsl(urlsplit(url).query, keep_blank_values=True)}
    idle_s = max(1, int(timeout_s / 2))
    out = {
        "keepalives": 1,
        "keepalives_idle": idle_s,
        "keepalives_interval": max(1, int(timeout_s / 6)),
        "keepalives_count": 3,
        "tcp_user_timeout": max(1000, int(timeout_s * 1000)),
    }
    return {k: v for k, v in out.items() if k not in given}


class PgConnection:
    """One psycopg connection used the way the store uses sqlite3's: `execute` with SQLite's
    spelling, autocommit outside `transaction()`. A broken connection (PostgreSQL restarted)
    is replaced at the next statement outside a transaction; a statement on a connection that
    breaks, or that finds none can be made, raises StoreUnavailable."""

    def __init__(
        self,
        url: str,
        *,
        password: str | None,
        connect_timeout_s: int,
        tcp_timeout_s: float = DEFAULT_TCP_TIMEOUT_S,
    ) -> None:
        self.url = url
        self.safe_url = redact_url(url)
        self._password = password
        self._connect_timeout_s = connect_timeout_s
        self._tcp = tcp_liveness(url, timeout_s=tcp_timeout_s)
        self._in_transaction = False
        self._lock = threading.RLock()
        self._conn = self._connect()

    def _connect(self) -> Any:
        try:
            # the postgres extra: SQLite-only installations never need psycopg
            import psycopg  # noqa: PLC0415
        except ImportError:
            raise StoreConnectError(
                f"store.url is a PostgreSQL URL but psycopg is not installed: {POSTGRES_EXTRA_HINT}"
            ) from None
        kwargs: dict[str, Any] = {"connect_timeout": self._connect_timeout_s, **self._tcp}
        if self._password is not None:
            kwargs["password"] = self._password
        try:
            conn = psycopg.connect(
                self.url,
                autocommit=True,
                row_factory=_pg_row_factory,
                application_name="trainguard-controller",
                **kwargs,
            )
        except psycopg.Error as e:
            detail = " ".join(str(e).split())
            raise StoreConnectError(f"{self.safe_url}: cannot connect: {detail}") from None
        return conn

    @property
    def in_transaction(self) -> bool:
        return self._in_transaction

    def _live(self) -> Any:
        if not self._in_transaction and (self._conn.closed or self._conn.broken):
            try:
                self._conn = self._connect()
            except StoreConnectError as e:
                raise StoreUnavailable(str(e)) from None
        return self._conn

    def _lost(self, e: Exception) -> StoreUnavailable | None:
        """StoreUnavailable when `e` came with the connection breaking (or was raised on one
        already gone); None for an error of the statement itself (a constraint, a type)."""
        if isinstance(e, StoreUnavailable):
            return e
        if not (self._conn.closed or self._conn.broken):
            return None
        detail = " ".join(str(e).split())[:300] or type(e).__name__
        return StoreUnavailable(f"{self.safe_url}: connection lost: {detail}")

    @property
    def available(self) -> bool:
        """The connection is open (not known to be broken); the next statement may still find
        it gone."""
        return not (self._conn.closed or self._conn.broken)

    def execute(self, sql: str, parameters: Any = (), /) -> PgCursor:
        with self._lock:
            try:
                cur = self._live().execute(postgres_sql(sql), parameters)
                rows = cur.fetchall() if cur.description is not None else []
            except Exception as e:
                lost = self._lost(e)
                if lost is None:
                    raise
                raise lost from None
            return PgCursor(rows, cur.rowcount)

    def executemany(self, sql: str, parameters: Any, /) -> PgCursor:
        rows = list(parameters)
        with self._lock:
            if not rows:
                return PgCursor([], 0)
            try:
                with self._live().cursor() as cur:
                    cur.executemany(postgres_sql(sql), rows)
                    return PgCursor([], cur.rowcount)
            except Exception as e:
                lost = self._lost(e)
                if lost is None:
                    raise
                raise lost from None

    @contextmanager
    def transaction(self) -> Iterator[PgConnection]:
        """BEGIN (READ COMMITTED) ... COMMIT, ROLLBACK on error. A connection lost on the way
        (BEGIN, a statement, COMMIT) raises StoreUnavailable: nothing of it was committed
        (a COMMIT lost in flight may have been; what the store writes is idempotent or
        checked again on the next try)."""
        with self._lock:
            conn = self._live()
            self._in_transaction = True
            try:
                with conn.transaction():
                    yield self
            except Exception as e:
                lost = self._lost(e)
                if lost is None:
                    raise
                raise lost from None
            finally:
                self._in_transaction = False

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def connect_postgres(
    url: str,
    *,
    password: str | None,
    connect_timeout_s: int,
    tcp_timeout_s: float = DEFAULT_TCP_TIMEOUT_S,
) -> PgConnection:
    return PgConnection(
        url, password=password, connect_timeout_s=connect_timeout_s, tcp_timeout_s=tcp_timeout_s
    )


__all__ = [
    "DEFAULT_TCP_TIMEOUT_S",
    "POSTGRES_EXTRA_HINT",
    "Connection",
    "Cursor",
    "PgConnection",
    "PgRow",
    "Row",
    "connect_postgres",
    "tcp_liveness",
]
