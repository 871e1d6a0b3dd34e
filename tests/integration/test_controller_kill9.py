"""Crash safety with the real process: `kill -9` of trainguard-controller while a
notification is in flight, restart, and every action completes exactly once."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from agent.model import GpuSample
from agent.protocol import Report, encode_json
from controller.auth import hash_token
from tests.unit.controller.actions.http_receiver import Receiver

BIN = Path(sys.executable).parent
AGENT = {"Authorization": "Bearer agent-token"}
OP = {"Authorization": "Bearer op-token"}
RULES = """
rules:
  - name: gpu_dbe
    scope: gpu
    condition: ecc_uncorrected_volatile_total > 0
    severity: critical
    summary: uncorrectable ECC error
    actions: [notify, drain]
"""


def wait_for(cond: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def write_config(tmp_path: Path, notify_yaml: str) -> Path:
    (tmp_path / "rules.yaml").write_text(RULES)
    (tmp_path / "tokens.yaml").write_text(
        "tokens:\n"
        f'  - {{name: ops, role: operator, sha256: "{hash_token("op-token")}"}}\n'
        f'  - {{name: agents, role: agent, sha256: "{hash_token("agent-token")}"}}\n'
    )
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(
        f"store: {{path: {tmp_path / 'c.db'}}}\n"
        f"rules: [{tmp_path / 'rules.yaml'}]\n"
        f"api: {{host: 127.0.0.1, port: 0, tokens_file: {tmp_path / 'tokens.yaml'}}}\n"
        "tick_interval_s: 0.2\n"
        "stale_after_s: 30\n"
        f"notify:\n{notify_yaml}"
    )
    return cfg


class ControllerProc:
    """One run of the real process, with its own log file."""

    def __init__(self, cfg: Path, log: Path) -> None:
        self.log = log
        with log.open("w") as f:
            self.popen = subprocess.Popen(
                [str(BIN / "trainguard-controller"), "--config", str(cfg)],
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        wait_for(
            lambda: "event=api_listening" in log.read_text() or self.popen.poll() is not None,
            timeout_s=30,
            what="the controller to listen",
        )
        assert self.popen.poll() is None, log.read_text()
        line = next(ln for ln in log.read_text().splitlines() if "event=api_listening" in ln)
        self.url = line.split("url=")[1].split()[0]

    def kill9(self) -> None:
        self.popen.kill()
        self.popen.wait(timeout=10)


@pytest.fixture
def procs() -> Iterator[list[ControllerProc]]:
    started: list[ControllerProc] = []
    yield started
    for p in started:
        if p.popen.poll() is None:
            p.popen.kill()
            p.popen.wait(timeout=10)


def post_report(url: str, *, dbe: int, seq: int) -> None:
    gpu = GpuSample(
        index=0,
        uuid="GPU-0",
        pci_bus_id="0000:18:00.0",
        name="H100",
        ecc_uncorrected_volatile_total=dbe,
    )
    report = Report(node="node-1", instance="i1", seq=seq, sent_at=time.time(), gpus=(gpu,))
    r = httpx.post(f"{url}/v1/reports", content=encode_json(report), headers=AGENT, timeout=10)
    assert r.status_code == 200, r.text


def incident_actions(url: str) -> list[dict]:
    r = httpx.get(f"{url}/v1/incidents/1", headers=OP, timeout=10)
    return r.json()["actions"] if r.status_code == 200 else []


def all_done(url: str, expected: int) -> bool:
    actions = incident_actions(url)
    return len(actions) >= expected and all(
        a["state"] in ("succeeded", "failed", "skipped") for a in actions
    )


@pytest.mark.slow
def test_kill9_mid_webhook_delivery_resends_same_key_and_drains_once(tmp_path, procs):
    hold = threading.Event()
    with Receiver() as rx:
        rx.hold = hold
        cfg = write_config(
            tmp_path,
            f"  webhooks:\n    - {{name: hook, url: '{rx.url}/hook', timeout_s: 60}}\n",
        )
        first = ControllerProc(cfg, tmp_path / "first.log")
        procs.append(first)
        post_report(first.url, dbe=1, seq=1)
        assert rx.arrived.wait(30), "the webhook delivery never started"
        first.kill9()  # the delivery is in flight: its row is `running` in the store
        rx.hold = None
        hold.set()

        second = ControllerProc(cfg, tmp_path / "second.log")
        procs.append(second)
        post_report(second.url, dbe=1, seq=2)
        wait_for(lambda: all_done(second.url, 2), timeout_s=30, what="the plan to finish")

        keys = [r.headers["x-trainguard-idempotency-key"] for r in rx.requests]
        assert keys == ["1:0:notify:hook", "1:0:notify:hook"]  # re-sent, same key: once
        actions = {a["kind"]: a for a in incident_actions(second.url)}
        assert actions["notify"]["state"] == "succeeded"
        assert actions["drain"]["state"] == "succeeded" and actions["drain"]["attempts"] == 1
        node = httpx.get(f"{second.url}/v1/nodes/node-1", headers=OP, timeout=10).json()
        assert node["state"] == "drained"
        detail = httpx.get(f"{second.url}/v1/incidents/1", headers=OP, timeout=10).json()
        assert any(t["kind"] == "action_resumed" for t in detail["timeline"])


@pytest.mark.slow
def test_kill9_mid_slack_delivery_is_not_resent_and_pages_elsewhere(tmp_path, procs):
    hold = threading.Event()
    with Receiver() as rx:
        rx.hold = hold
        (tmp_path / "slack_url").write_text(f"{rx.url}/slack\n")
        cfg = write_config(
            tmp_path,
            f"  slack: {{webhook_url: {{file: {tmp_path / 'slack_url'}}}, timeout_s: 60}}\n"
            f"  webhooks:\n    - {{name: hook, url: '{rx.url}/hook', timeout_s: 60}}\n",
        )
        first = ControllerProc(cfg, tmp_path / "first.log")
        procs.append(first)
        post_report(first.url, dbe=1, seq=1)
        assert rx.arrived.wait(30), "the slack delivery never started"
        assert [r.path for r in rx.requests] == ["/slack"]
        first.kill9()
        rx.hold = None
        hold.set()

        second = ControllerProc(cfg, tmp_path / "second.log")
        procs.append(second)
        post_report(second.url, dbe=1, seq=2)
        wait_for(lambda: all_done(second.url, 4), timeout_s=30, what="the plan to finish")

        assert sorted(r.path for r in rx.requests) == ["/hook", "/hook", "/slack"]
        hook_keys = sorted(
            r.headers["x-trainguard-idempotency-key"] for r in rx.requests if r.path == "/hook"
        )
        assert hook_keys == ["1:0:notify:hook", "1:page:a1:notify:hook"]
        slack = next(a for a in incident_actions(second.url) if a["params"]["channel"] == "slack")
        assert slack["state"] == "failed" and "at most once" in slack["result"]
