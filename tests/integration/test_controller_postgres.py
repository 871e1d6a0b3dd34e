"""The real controller process on a real PostgreSQL store: a report in, an incident and its
drain, an operator's drain through the API, a restart that finds it all again; the password
from a file, never in the log; and the start refused (exit 2) when PostgreSQL cannot be
reached or psycopg is missing."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.controller_proc import (
    BIN,
    OP,
    dbe_rules,
    post_gpu_report,
    start_controller,
    write_config,
)
from tests.integration.postgres_proc import PASSWORD, PgServer


@pytest.fixture
def pg_database(pg_server: PgServer) -> Iterator[str]:
    name = pg_server.new_database()
    yield name
    pg_server.drop_database(name)


def _get(url: str, path: str) -> dict:
    r = httpx.get(f"{url}{path}", headers=OP, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _drained(url: str, node: str) -> bool:
    r = httpx.get(f"{url}/v1/nodes/{node}", headers=OP, timeout=10)
    return r.status_code == 200 and r.json()["state"] == "drained"


@pytest.mark.slow
def test_controller_on_postgres_acts_and_finds_its_state_after_a_restart(
    tmp_path: Path, controllers: list, pg_server: PgServer, pg_database: str
) -> None:
    password_file = tmp_path / "pgpass"
    password_file.write_text(PASSWORD + "\n")
    cfg = write_config(
        tmp_path,
        rules=dbe_rules(["drain"]),
        tick_interval_s=0.2,
        stale_after_s=30,
        store={"url": pg_server.url(pg_database, tcp=True), "password_file": str(password_file)},
    )
    first = start_controller(cfg, log_path=tmp_path / "first.log")
    controllers.append(first)
    assert "store=postgresql://trainguard@127.0.0.1" in first.log()
    post_gpu_report(first.url, node="node-1", dbe=0, seq=1)
    post_gpu_report(first.url, node="node-2", dbe=0, seq=1)
    post_gpu_report(first.url, node="node-1", dbe=1, seq=2)
    wait_for(lambda: _drained(first.url, "node-1"), timeout_s=30, what="node-1 drained")
    r = httpx.post(f"{first.url}/v1/nodes/node-2/drain", headers=OP, json={}, timeout=10)
    assert r.status_code == 200, r.text
    wait_for(lambda: _drained(first.url, "node-2"), timeout_s=30, what="node-2 drained")
    (incident,) = _get(first.url, "/v1/incidents")
    assert (incident["rule"], incident["node"]) == ("gpu_dbe", "node-1")
    assert first.terminate() == 0

    second = start_controller(cfg, log_path=tmp_path / "second.log")
    controllers.append(second)
    assert _drained(second.url, "node-1") and _drained(second.url, "node-2")
    detail = _get(second.url, f"/v1/incidents/{incident['id']}")
    drains = [a for a in detail["actions"] if a["kind"] == "drain"]
    assert [(a["state"], a["attempts"]) for a in drains] == [("succeeded", 1)]

    # a lone controller on PostgreSQL holds the lease: a second one started on the same
    # database by mistake waits as a standby instead of acting beside it
    third = start_controller(cfg, log_path=tmp_path / "third.log")
    controllers.append(third)
    assert "event=ha_started" in third.log()
    r = httpx.post(f"{third.url}/v1/nodes/node-3/drain", headers=OP, json={}, timeout=10)
    assert r.status_code == 503 and "does not lead" in r.json()["error"], r.text
    assert _metric(third.url, "trainguard_controller_leader") == 0
    assert _metric(second.url, "trainguard_controller_leader") == 1
    for proc in (first, second, third):
        assert PASSWORD not in proc.log()


def _metric(url: str, name: str) -> float | None:
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


def test_unreachable_postgres_is_exit_2_naming_the_url_and_the_error(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path,
        rules=dbe_rules(),
        store={"url": "postgresql://trainguard@127.0.0.1:1/tg", "connect_timeout_s": 2},
    )
    out = subprocess.run(
        [str(BIN / "trainguard-controller"), "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={"PGPASSWORD": "never-shown", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2, out.stderr
    assert "store.url" in out.stderr and "postgresql://trainguard@127.0.0.1:1/tg" in out.stderr
    assert "cannot connect" in out.stderr and "Connection refused" in out.stderr
    assert "never-shown" not in out.stderr + out.stdout and "Traceback" not in out.stderr


BLOCKED = """
import sys
sys.modules["psycopg"] = None  # as if trainguard[postgres] was not installed
from trainguard.controller.main import main
sys.exit(main(["--config", sys.argv[1]]))
"""


def test_missing_psycopg_is_exit_2_naming_the_extra(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path, rules=dbe_rules(), store={"url": "postgresql://trainguard@127.0.0.1:1/tg"}
    )
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED, str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "pip install 'trainguard[postgres]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_backup_of_a_postgres_store_is_refused_naming_pg_dump(tmp_path: Path) -> None:
    cfg = write_config(
        tmp_path, rules=dbe_rules(), store={"url": "postgresql://trainguard@db.example/tg"}
    )
    out = subprocess.run(
        [str(BIN / "trainguard-controller"), "--config", str(cfg), "backup", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    assert "pg_dump" in out.stderr and "postgresql://trainguard@db.example/tg" in out.stderr
    assert not (tmp_path / "b").exists()
