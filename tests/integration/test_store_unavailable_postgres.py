"""A PostgreSQL store whose server connection is cut (`pg_terminate_backend` from another
connection, as a server restart or a failover does) on the session's real server: the
statement that finds its connection gone raises StoreUnavailable naming the URL without its
password, the next one outside a transaction reconnects; a statement's own error stays what
it is; a transaction cut on the way commits nothing; the store watch's probe and a lease
holder that stepped down come back the same way."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tests.integration.postgres_proc import PASSWORD, ROLE, PgServer
from trainguard.controller.store import Store
from trainguard.controller.store.connection import PgConnection, connect_postgres
from trainguard.controller.store.dialect import POSTGRES
from trainguard.controller.store.errors import StoreConnectError, StoreUnavailable
from trainguard.controller.store.lease import Lease, lease_connection
from trainguard.controller.storewatch import postgres_probe


class Database:
    """A fresh database on the session's server; `cut()` terminates every connection to it
    but the caller's own, waiting until they are gone."""

    def __init__(self, server: PgServer, name: str) -> None:
        self.server = server
        self.name = name
        self.url = server.url(name)
        tcp = urlsplit(server.url(name, tcp=True))
        # the password in the URL itself: what a message must never repeat
        self.url_with_password = urlunsplit(
            tcp._replace(netloc=f"{ROLE}:{PASSWORD}@{tcp.hostname}:{tcp.port}")
        )
        self.opened: list[PgConnection] = []

    def connect(self, url: str | None = None) -> PgConnection:
        conn = connect_postgres(url or self.url, password=None, connect_timeout_s=5)
        self.opened.append(conn)
        return conn

    def cut(self) -> int:
        with psycopg.connect(self.url, autocommit=True) as admin:
            rows = admin.execute(
                "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        assert all(ok for (ok,) in rows)
        return len(rows)

    def count(self, table: str) -> int:
        with psycopg.connect(self.url, autocommit=True) as admin:
            row = admin.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture
def db(pg_server: PgServer) -> Iterator[Database]:
    name = pg_server.new_database()
    d = Database(pg_server, name)
    yield d
    for conn in d.opened:
        conn.close()
    pg_server.drop_database(name)


def _pid(conn: PgConnection) -> int:
    return int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])


def test_the_first_statement_after_the_cut_raises_store_unavailable_and_the_next_reconnects(
    db: Database,
) -> None:
    conn = db.connect(db.url_with_password)
    before = _pid(conn)
    assert db.cut() == 1
    with pytest.raises(StoreUnavailable) as info:
        conn.execute("SELECT 1")
    message = str(info.value)
    assert "connection lost" in message
    assert f"{ROLE}:***@127.0.0.1:{db.server.port}/{db.name}" in message
    assert PASSWORD not in message
    assert not conn.available
    # outside a transaction the next statement finds a new connection
    assert conn.execute("SELECT 1").fetchone()[0] == 1
    assert conn.available and _pid(conn) != before


def test_executemany_on_a_cut_connection_raises_store_unavailable(db: Database) -> None:
    conn = db.connect()
    conn.execute("CREATE TABLE t (id BIGINT PRIMARY KEY)")
    db.cut()
    with pytest.raises(StoreUnavailable, match="connection lost"):
        conn.executemany("INSERT INTO t (id) VALUES (?)", [(1,), (2,)])
    conn.executemany("INSERT INTO t (id) VALUES (?)", [(1,), (2,)])
    assert db.count("t") == 2


@pytest.mark.parametrize(
    ("sql", "error"),
    [
        pytest.param("INSERT INTO t (id) VALUES (1)", psycopg.errors.UniqueViolation, id="dup"),
        pytest.param("SELEC 1", psycopg.errors.SyntaxError, id="syntax"),
        pytest.param("SELECT nope FROM t", psycopg.errors.UndefinedColumn, id="column"),
    ],
)
def test_a_statements_own_error_stays_what_it_is(
    db: Database, sql: str, error: type[Exception]
) -> None:
    conn = db.connect()
    conn.execute("CREATE TABLE t (id BIGINT PRIMARY KEY)")
    conn.execute("INSERT INTO t (id) VALUES (1)")
    with pytest.raises(error) as info:
        conn.execute(sql)
    assert not isinstance(info.value, StoreUnavailable)
    assert conn.available
    with pytest.raises(psycopg.errors.UniqueViolation), conn.transaction():
        conn.execute("INSERT INTO t (id) VALUES (2)")
        conn.execute("INSERT INTO t (id) VALUES (1)")
    assert db.count("t") == 1  # the transaction was rolled back, not lost


@pytest.mark.parametrize("after_cut", ["statement", "commit"])
def test_a_transaction_cut_on_the_way_raises_store_unavailable_and_commits_nothing(
    db: Database, after_cut: str
) -> None:
    conn = db.connect()
    conn.execute("CREATE TABLE t (id BIGINT PRIMARY KEY)")
    with pytest.raises(StoreUnavailable, match="connection lost"), conn.transaction():
        conn.execute("INSERT INTO t (id) VALUES (1)")
        db.cut()
        if after_cut == "statement":
            conn.execute("INSERT INTO t (id) VALUES (2)")
    assert not conn.in_transaction
    assert db.count("t") == 0
    with conn.transaction():  # the next transaction has a new connection
        conn.execute("INSERT INTO t (id) VALUES (3)")
    assert db.count("t") == 1


def test_a_store_cut_from_its_server_raises_store_unavailable_then_goes_on(
    db: Database,
) -> None:
    store = Store(db.url, now=lambda: 1000.0)
    try:
        store.audit.record(ts=1.0, actor="op", action="before", target="t", detail={})
        db.cut()
        with pytest.raises(StoreUnavailable):
            store.audit.record(ts=2.0, actor="op", action="lost", target="t", detail={})
        store.audit.record(ts=3.0, actor="op", action="after", target="t", detail={})
        assert [e.action for e in store.audit.recent()] == ["after", "before"]
        db.cut()
        with pytest.raises(StoreUnavailable):
            store.audit.recent()
        assert len(store.audit.recent()) == 2
    finally:
        store.close()


def test_the_store_probe_fails_once_on_a_cut_connection_and_answers_again(
    db: Database,
) -> None:
    probe = postgres_probe(db.url, password=None, timeout_s=3)
    probe()
    assert db.cut() == 1  # the probe's own connection
    with pytest.raises(StoreUnavailable):
        probe()
    probe()


def test_the_store_probe_of_a_server_that_is_not_there_raises_without_the_password(
    db: Database,
) -> None:
    tcp = urlsplit(db.url_with_password)
    port = db.server.port + 1 if db.server.port < 65535 else db.server.port - 1
    url = urlunsplit(tcp._replace(netloc=f"{ROLE}:{PASSWORD}@127.0.0.1:{port}"))
    probe = postgres_probe(url, password=None, timeout_s=1)
    for _ in range(2):  # no connection kept: each probe tries again
        with pytest.raises(StoreConnectError) as info:
            probe()
        assert PASSWORD not in str(info.value)


def test_a_holder_that_lost_the_store_takes_its_own_lease_back_under_the_next_epoch(
    db: Database,
) -> None:
    Store(db.url, now=lambda: 1000.0).close()  # migrated: the lease row exists

    def lease(holder: str) -> Lease:
        conn = lease_connection(db.url, password=None, timeout_s=5)
        db.opened.append(conn)
        return Lease(
            conn,
            dialect=POSTGRES,
            holder=holder,
            advertise_url=f"http://{holder}:8800",
            lease_s=60.0,
        )

    a = lease("a")
    assert a.acquire() == 1
    db.cut()  # the store gone for a moment: a's renewal fails, it steps down
    with pytest.raises(StoreUnavailable):
        a.renew(1)
    b = lease("b")
    assert b.acquire() is None  # the lease is still a's for 60 s
    assert a.acquire() == 2  # a takes it back at once, fencing off epoch 1
    assert not a.renew(1)
    assert a.renew(2)
    assert b.acquire() is None
