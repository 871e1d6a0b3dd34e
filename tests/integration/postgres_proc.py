"""A real PostgreSQL server for the tests (Debian's `postgresql-15`): `initdb` and `postgres`
as a plain process with its own port and unix socket directory under a short temp dir, one
server per test session (the `pg_server` fixture in tests/conftest.py); each test gets a
fresh database (`new_database`) dropped when it ends.

initdb and postgres refuse to run as root: when the tests run as root the server runs as
`nobody` in directories owned by it. Local (unix socket) connections are trusted; TCP
connections need the password of `ROLE` (scram-sha-256), so a test can exercise a password.
Missing binaries skip the test, or fail it under CI=true or TRAINGUARD_REQUIRE_PG=1.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.helpers import free_port, short_tmpdir, wait_for

PG_BIN = Path(os.environ.get("TRAINGUARD_PG_BIN", "/usr/lib/postgresql/15/bin"))
PACKAGE = "postgresql-15"
ROLE = "trainguard"
PASSWORD = "pg-test-secret"  # a test server's password, never a real one
RUN_AS = "nobody"  # when the tests run as root

__all__ = ["BOTH_STORES", "PASSWORD", "ROLE", "PgServer", "require_postgres", "start_postgres"]

# Runs a test taking `store_location` (tests/conftest.py) on each store backend.
BOTH_STORES = pytest.mark.parametrize("store_backend", ["sqlite", "postgres"])


def require_postgres() -> Path:
    """The directory of initdb/postgres; missing, the test skips, or fails when PostgreSQL is
    required (CI=true or TRAINGUARD_REQUIRE_PG=1)."""
    if all((PG_BIN / name).exists() for name in ("initdb", "postgres", "pg_ctl")):
        return PG_BIN
    if os.environ.get("CI") == "true" or os.environ.get("TRAINGUARD_REQUIRE_PG") == "1":
        pytest.fail(f"PostgreSQL is required here: no {PG_BIN}/postgres (`make deps` as root)")
    pytest.skip(f"PostgreSQL not installed ({PG_BIN}; Debian package {PACKAGE!r}; `make deps`)")


def _as_server_user() -> dict[str, Any]:
    """subprocess arguments that run the child as RUN_AS when the tests run as root."""
    if os.getuid() != 0:
        return {}
    user = pwd.getpwnam(RUN_AS)
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


class PgServer:
    """One running server; `url()` and `new_database()` for the tests."""

    def __init__(self, *, root: Path, port: int, proc: subprocess.Popen[bytes]) -> None:
        self.root = root
        self.socket_dir = root / "sock"
        self.port = port
        self.proc = proc
        self._names = itertools.count(1)

    def url(self, database: str = "postgres", *, tcp: bool = False) -> str:
        """A URL without a password: over the unix socket (trusted) or TCP (needs PASSWORD)."""
        if tcp:
            return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{database}"
        return f"postgresql://{ROLE}@{quote(str(self.socket_dir), safe='')}:{self.port}/{database}"

    def sql(self, statements: Sequence[str], *, database: str = "postgres") -> None:
        """Run statements outside a transaction (CREATE/DROP DATABASE) as ROLE."""
        import psycopg  # noqa: PLC0415 (test helper: only tests that run PostgreSQL import it)

        with psycopg.connect(self.url(database), autocommit=True) as conn:
            for statement in statements:
                conn.execute(statement)

    def new_database(self) -> str:
        """A fresh empty database; returns its name."""
        name = f"t{os.getpid()}_{next(self._names)}"
        self.sql([f"CREATE DATABASE {name} TEMPLATE template0"])
        return name

    def drop_database(self, name: str) -> None:
        self.sql([f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"])

    def kill(self) -> None:
        """The server gone at once (immediate shutdown, SIGQUIT: every backend ends without
        a checkpoint, as in a crash): every connection breaks, new ones are refused; the
        data stays for `restart` (which recovers it from the WAL)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)
            self.proc.wait(timeout=30)

    def restart(self) -> None:
        """Start the killed server again on the same port, data and socket directory."""
        if self.proc.poll() is None:
            raise RuntimeError("postgres is still running")
        for _ in range(5):  # an old backend still holding shared memory: try again
            self.proc = _spawn(require_postgres(), self.root, self.port)
            if _wait_ready(self) == "ready":
                return
        text = (self.root / "postgres.log").read_text(errors="replace")
        raise RuntimeError(f"postgres did not start again:\n{text[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown: open connections are cut
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def _spawn(bin_dir: Path, root: Path, port: int) -> subprocess.Popen[bytes]:
    """`postgres` on the cluster under `root`, listening on `port` (TCP and unix socket)."""
    with (root / "postgres.log").open("ab") as out:
        return subprocess.Popen(
            [
                str(bin_dir / "postgres"),
                "-D",
                str(root / "data"),
                "-p",
                str(port),
                "-k",
                str(root / "sock"),
                "-c",
                "listen_addresses=127.0.0.1",
                # a test server: durability is not what is tested, speed is what is paid
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "max_connections=200",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            **_as_server_user(),
        )


def _wait_ready(server: PgServer) -> str:
    socket_file = server.socket_dir / f".s.PGSQL.{server.port}"

    def state() -> str:
        if server.proc.poll() is not None:
            return "exited"
        return "ready" if socket_file.exists() and _accepts(server) else ""

    return str(wait_for(state, timeout_s=60, what="postgres to accept connections"))


def start_postgres() -> PgServer:
    """initdb a new cluster under a short temp dir and start `postgres` on a free port."""
    bin_dir = require_postgres()
    root = short_tmpdir("tgpg")
    as_user = _as_server_user()
    uid = as_user.get("user")
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    pwfile = root / "pw"
    pwfile.write_text(PASSWORD + "\n")
    if uid is not None:
        for p in (root, sock, pwfile):
            os.chown(p, uid, -1)
    init = subprocess.run(
        [
            str(bin_dir / "initdb"),
            "-D",
            str(data),
            "-U",
            ROLE,
            f"--pwfile={pwfile}",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ],
        capture_output=True,
        text=True,
        **as_user,
        check=False,
        timeout=120,
    )
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(f"initdb failed:\n{init.stdout}\n{init.stderr}")
    log = root / "postgres.log"
    for _ in range(3):  # a free port can be taken between choosing and binding it
        port = free_port()
        server = PgServer(root=root, port=port, proc=_spawn(bin_dir, root, port))
        if _wait_ready(server) == "ready":
            return server
        if "already in use" not in log.read_text(errors="replace"):
            break
    text = log.read_text(errors="replace")
    shutil.rmtree(root, ignore_errors=True)
    pytest.fail(f"postgres did not start:\n{text}")


def _accepts(server: PgServer) -> bool:
    import psycopg  # noqa: PLC0415 (as in PgServer.sql)

    try:
        psycopg.connect(server.url(), connect_timeout=2).close()
    except psycopg.OperationalError:
        return False
    return True
