"""A controller pause must not drain healthy nodes: a real controller, SIGSTOPped while three
real agents (each with its own bound token) keep trying to report, then SIGCONTed. The nodes
that kept reporting get node_silent_after_s from the resumption (the stall guard,
docs/controller.md): no incident opens and nothing is drained for them, however the reports
queued during the pause race the first tick. The race is played in its worst order on purpose:
the agents are held (SIGSTOP) with the controller and let go 1.5 s after it, so the first
ticks after the resumption always run before any of their reports. A node whose agent really
stopped during the pause is still found silent, once that grace has passed."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import short_tmpdir, wait_for
from tests.integration.agent_proc import AgentProcess, cleanup
from tests.integration.controller_proc import OP, ControllerProcess, write_config

pytestmark = pytest.mark.slow

NODES = ("node-1", "node-2", "node-3")
TOKENS = {n: f"tok-{n}" for n in NODES}
RULES = """
rules:
  - name: node_silent
    scope: node
    condition: report_age_s > 5 and state == "active"
    severity: critical
    actions: [notify, drain]
    summary: node stopped reporting
"""
PAUSE_S = 15.0  # three times node_silent_after_s (5 s)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = short_tmpdir("tgpause")
    yield path
    cleanup(path)


def _get(url: str, path: str) -> Any:
    r = httpx.get(f"{url}{path}", headers=OP, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_paused_controller_drains_no_node_that_kept_reporting(
    short_tmp: Path, controllers: list[ControllerProcess]
) -> None:
    cfg = write_config(short_tmp, rules=RULES, tick_interval_s=0.5, agent_tokens=TOKENS)
    controller = ControllerProcess(cfg, log_path=short_tmp / "controller.log")
    controllers.append(controller)
    controller.wait_listening(timeout_s=60)
    agents: dict[str, AgentProcess] = {}
    try:
        for node in NODES:
            workdir = short_tmp / node
            workdir.mkdir()
            token = workdir / "token"
            token.write_text(TOKENS[node])
            token.chmod(0o600)
            agents[node] = AgentProcess(
                workdir,
                "--node-name", node,
                "--controller", controller.url, "--token-file", str(token),
                "--report-interval-s", "0.5", "--collect-interval-s", "0.5",
            )  # fmt: skip
        wait_for(
            lambda: sorted(n["name"] for n in _get(controller.url, "/v1/nodes")) == list(NODES),
            timeout_s=30,
            what="the three agents reporting",
        )
        time.sleep(2.0)

        os.kill(controller.popen.pid, signal.SIGSTOP)
        held = [agents["node-1"].proc.pid, agents["node-2"].proc.pid]
        try:
            for pid in held:
                os.kill(pid, signal.SIGSTOP)
            agents["node-3"].terminate()  # node-3 really goes away during the pause
            time.sleep(PAUSE_S)
        finally:
            os.kill(controller.popen.pid, signal.SIGCONT)
            time.sleep(1.5)  # the first ticks run before any queued report
            for pid in held:
                os.kill(pid, signal.SIGCONT)

        # the grace: node_silent_after_s from the resumption; nothing opens within it
        # for the nodes that kept reporting, and node-3 is found silent after it
        wait_for(
            lambda: [i["node"] for i in _get(controller.url, "/v1/incidents")] == ["node-3"],
            timeout_s=30,
            what="node_silent for node-3 only",
        )
        time.sleep(3.0)
        incidents = _get(controller.url, "/v1/incidents")
        assert [(i["rule"], i["node"]) for i in incidents] == [("node_silent", "node-3")]
        states = {n["name"]: n["state"] for n in _get(controller.url, "/v1/nodes")}
        assert states["node-1"] == states["node-2"] == "active"
        assert "event=controller_stalled" in controller.log()
    finally:
        for agent in agents.values():
            agent.kill()
