"""Fixtures every test directory may use. Shared helpers are plain modules (tests/helpers.py,
tests/builders.py, tests/fakes/); a fixture is never imported from another test module.

Store backends: a test taking `store_location` runs on SQLite unless it is parametrised with
`store_backend` (`BOTH_STORES` from tests/integration/postgres_proc.py): then also on a fresh
database of the session's one PostgreSQL server (`pg_server`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.controller_service import FakeController
from tests.helpers import short_tmpdir
from tests.integration.postgres_proc import PgServer, start_postgres


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A fresh directory with a short path (for unix sockets), removed afterwards."""
    d = short_tmpdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fake_controller() -> Iterator[FakeController]:
    """The fake controller serving on loopback; its agent token is `.agent_token`."""
    ctl = FakeController()
    yield ctl
    ctl.stop()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """One PostgreSQL server for the whole session (started by the first test that needs it)."""
    server = start_postgres()
    yield server
    server.stop()


@pytest.fixture
def store_backend() -> str:
    """The store backend of a test that is not parametrised over both."""
    return "sqlite"


@pytest.fixture
def store_location(
    store_backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[str]:
    """Where the test's store lives: an SQLite file in tmp_path, or the URL of a fresh
    PostgreSQL database (dropped afterwards)."""
    if store_backend == "sqlite":
        yield str(tmp_path / "controller.db")
        return
    server: PgServer = request.getfixturevalue("pg_server")
    name = server.new_database()
    yield server.url(name)
    server.drop_database(name)
