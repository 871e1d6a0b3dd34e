"""The real trainguard-controller process end to end through its API: a fatal GPU report
opens an incident, Slack / PagerDuty / a signed webhook get the documented payloads, the
node is drained, and clearing the fault resolves the incident (PagerDuty resolve, same key)."""

from __future__ import annotations

import hashlib
import hmac
import subprocess
import sys
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


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver(default_status=202) as rx:
        yield rx


@pytest.fixture
def controller_url(tmp_path: Path, receiver: Receiver) -> Iterator[str]:
    (tmp_path / "rules.yaml").write_text(RULES)
    (tmp_path / "tokens.yaml").write_text(
        "tokens:\n"
        f'  - {{name: ops, role: operator, sha256: "{hash_token("op-token")}"}}\n'
        f'  - {{name: agents, role: agent, sha256: "{hash_token("agent-token")}"}}\n'
    )
    (tmp_path / "slack_url").write_text(f"{receiver.url}/slack/T0/B0/SLACKSECRET\n")
    (tmp_path / "hmac").write_text("hook-secret\n")
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(
        f"store: {{path: {tmp_path / 'c.db'}}}\n"
        f"rules: [{tmp_path / 'rules.yaml'}]\n"
        f"api: {{host: 127.0.0.1, port: 0, tokens_file: {tmp_path / 'tokens.yaml'}}}\n"
        "tick_interval_s: 0.2\n"
        "notify:\n"
        f"  slack: {{webhook_url: {{file: {tmp_path / 'slack_url'}}}}}\n"
        f"  pagerduty: {{routing_key: {{env: TG_TEST_PD_KEY}}, url: '{receiver.url}/pd'}}\n"
        "  webhooks:\n"
        f"    - {{name: ops, url: '{receiver.url}/hook', secret: {{file: {tmp_path / 'hmac'}}}}}\n"
    )
    log = tmp_path / "controller.log"
    env = {"TG_TEST_PD_KEY": "PDROUTINGKEY", "PATH": "/usr/bin:/bin"}
    with log.open("w") as f:
        popen = subprocess.Popen(
            [str(BIN / "trainguard-controller"), "--config", str(cfg)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_for(
            lambda: "event=api_listening" in log.read_text() or popen.poll() is not None,
            timeout_s=30,
            what="the controller to listen",
        )
        assert popen.poll() is None, log.read_text()
        line = next(ln for ln in log.read_text().splitlines() if "event=api_listening" in ln)
        yield line.split("url=")[1].split()[0]
    finally:
        popen.terminate()
        popen.wait(timeout=30)
        text = log.read_text()
        for secret in ("SLACKSECRET", "PDROUTINGKEY", "hook-secret"):
            assert secret not in text, f"{secret} leaked into the log"


def _report(url: str, *, dbe: int, seq: int) -> None:
    gpu = GpuSample(
        index=0,
        uuid="GPU-0",
        pci_bus_id="0000:18:00.0",
        name="H100",
        ecc_uncorrected_volatile_total=dbe,
    )
    report = Report(node="node-9", instance="i1", seq=seq, sent_at=time.time(), gpus=(gpu,))
    r = httpx.post(f"{url}/v1/reports", content=encode_json(report), headers=AGENT, timeout=10)
    assert r.status_code == 200, r.text


def _paths(rx: Receiver) -> list[str]:
    return sorted(r.path.split("/")[1] for r in rx.requests)


@pytest.mark.slow
def test_fault_to_notifications_drain_and_resolve(controller_url: str, receiver: Receiver):
    _report(controller_url, dbe=1, seq=1)
    wait_for(lambda: len(receiver.requests) >= 3, timeout_s=20, what="three notifications")
    assert _paths(receiver) == ["hook", "pd", "slack"]
    by = {r.path.split("/")[1]: r for r in receiver.requests}

    slack = by["slack"].json()
    assert "gpu_dbe" in slack["text"] and slack["blocks"][0]["type"] == "header"
    pd = by["pd"].json()
    assert pd["routing_key"] == "PDROUTINGKEY" and pd["event_action"] == "trigger"
    assert pd["payload"]["severity"] == "critical" and pd["payload"]["component"] == "node-9"
    hook = by["hook"]
    digest = hmac.new(b"hook-secret", hook.body, hashlib.sha256).hexdigest()
    assert hook.headers["x-trainguard-signature"] == f"sha256={digest}"

    def drained() -> bool:
        node = httpx.get(f"{controller_url}/v1/nodes/node-9", headers=OP, timeout=10).json()
        return node["state"] == "drained"

    wait_for(drained, timeout_s=20, what="node-9 drained")

    _report(controller_url, dbe=0, seq=2)
    wait_for(
        lambda: any(
            r.json().get("event_action") == "resolve" for r in receiver.requests if r.path == "/pd"
        ),
        timeout_s=20,
        what="the PagerDuty resolve",
    )
    resolve = next(
        r.json()
        for r in receiver.requests
        if r.path == "/pd" and r.json()["event_action"] == "resolve"
    )
    assert resolve["dedup_key"] == pd["dedup_key"]
    incidents = httpx.get(f"{controller_url}/v1/incidents", headers=OP, timeout=10).json()
    assert [i["state"] for i in incidents] == ["resolved"]
