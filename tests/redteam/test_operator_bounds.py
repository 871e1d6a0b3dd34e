"""An operator token's own bounds on a real controller (issue 20): silences past
`api.max_silences` and a drain reason of 200 KiB.

- Silences beyond `api.max_silences` (5 here) are refused with a 4xx naming the limit, and
  nothing past it is stored; `GET /v1/silences?limit=2` answers two and an
  `X-Trainguard-Continue` header, and following it yields the rest.
- A drain whose reason is 200 KiB is refused with 422 naming `reason`, and the node is not
  drained; a drain with a normal reason works.
- Throughout, the process serves and its /metrics passes `promtool check metrics`.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import short_tmpdir
from tests.integration.agent_proc import cleanup
from tests.integration.controller_proc import (
    OP,
    ControllerProcess,
    dbe_rules,
    post_gpu_report,
    start_controller,
    write_config,
)

MAX_SILENCES = 5
CONTINUE = "X-Trainguard-Continue"


@dataclass
class Rig:
    proc: ControllerProcess
    db: Path

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.proc.url}{path}", params=params, headers=OP, timeout=30)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.proc.url}{path}", json=body, headers=OP, timeout=30)

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10) as db:
            return db.execute(sql).fetchall()


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    workdir = short_tmpdir("tgop")
    config = write_config(workdir, rules=dbe_rules(), tick_interval_s=0.5)
    text = config.read_text()
    config.write_text(text.replace("api: {", f"api: {{max_silences: {MAX_SILENCES}, ", 1))
    proc = start_controller(config, log_path=workdir / "controller.log")
    try:
        yield Rig(proc=proc, db=workdir / "c.db")
    finally:
        proc.kill()
        cleanup(workdir)


def _promtool_clean(body: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is required in CI (Debian package 'prometheus')")
        pytest.skip("promtool not installed")
    check = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, text=True, timeout=30,
        check=False,
    )  # fmt: skip
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr


def _assert_serving(rig: Rig) -> None:
    assert rig.proc.popen.poll() is None, rig.proc.log()
    assert httpx.get(f"{rig.proc.url}/healthz", timeout=30).status_code == 200
    m = httpx.get(f"{rig.proc.url}/metrics", timeout=30)
    assert m.status_code == 200
    _promtool_clean(m.text)
    assert "Traceback" not in rig.proc.log()


def test_silences_past_the_cap_are_refused_and_the_list_answers_a_page_at_a_time(
    rig: Rig,
) -> None:
    created = []
    for i in range(MAX_SILENCES):
        r = rig.post("/v1/silences", {"rule": f"rule_{i}", "duration_s": 3600})
        assert r.status_code == 201, r.text
        created.append(r.json()["id"])
    for i in range(3):
        r = rig.post("/v1/silences", {"rule": f"more_{i}", "duration_s": 3600})
        assert 400 <= r.status_code < 500, r.text
        assert "api.max_silences" in r.text and f"({MAX_SILENCES})" in r.text, r.text
    # nothing stored past the cap
    assert rig.rows("SELECT count(*) FROM silences") == [(MAX_SILENCES,)]
    assert rig.rows("SELECT count(*) FROM silences WHERE rule LIKE 'more_%'") == [(0,)]

    # a page of two, then follow the continue header to the end
    seen: list[int] = []
    params: dict[str, Any] = {"limit": 2}
    pages = 0
    while True:
        r = rig.get("/v1/silences", **params)
        assert r.status_code == 200, r.text
        ids = [s["id"] for s in r.json()]
        pages += 1
        assert len(ids) <= 2
        seen.extend(ids)
        token = r.headers.get(CONTINUE)
        if pages == 1:
            assert len(ids) == 2 and token is not None, r.headers
        if token is None:
            break
        assert pages < 10, "the pages do not end"
        params = {"limit": 2, "continue": token}
    assert seen == sorted(created)
    assert pages == 3
    _assert_serving(rig)


def test_a_drain_with_a_200_kib_reason_is_refused_and_a_normal_one_drains(rig: Rig) -> None:
    post_gpu_report(rig.proc.url, node="n1", dbe=0, seq=1)
    assert rig.get("/v1/nodes/n1").json()["state"] == "active"

    r = rig.post("/v1/nodes/n1/drain", {"reason": "x" * (200 * 1024)})
    assert r.status_code == 422, r.text[:2000]
    assert "reason" in r.text[:2000]
    assert len(r.content) < 64 * 1024  # the refusal does not echo the reason back
    node = rig.get("/v1/nodes/n1").json()
    assert node["state"] == "active" and not node.get("drain_reason"), node
    assert rig.rows("SELECT count(*) FROM audit_log WHERE action = 'drain'") == [(0,)]
    _assert_serving(rig)

    r = rig.post("/v1/nodes/n1/drain", {"reason": "bad fan, ticket 1234"})
    assert r.status_code == 200, r.text
    node = rig.get("/v1/nodes/n1").json()
    assert node["state"] in ("draining", "drained"), node
    assert node["drain_reason"] == "bad fan, ticket 1234", node
    _assert_serving(rig)
