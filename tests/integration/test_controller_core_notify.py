"""The real trainguard-controller process end to end through its API: a fatal GPU report
opens an incident, Slack / PagerDuty / a signed webhook get the documented payloads, the
node is drained, and clearing the fault resolves the incident (PagerDuty resolve, same key)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.fakes.http_receiver import Receiver
from tests.helpers import wait_for
from tests.integration.controller_proc import (
    OP,
    ControllerProcess,
    dbe_rules,
    post_gpu_report,
    write_config,
)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver(default_status=202) as rx:
        yield rx


@pytest.fixture
def controller_url(tmp_path: Path, receiver: Receiver) -> Iterator[str]:
    (tmp_path / "slack_url").write_text(f"{receiver.url}/slack/T0/B0/SLACKSECRET\n")
    (tmp_path / "hmac").write_text("hook-secret\n")
    cfg = write_config(
        tmp_path,
        rules=dbe_rules(["notify", "drain"]),
        tick_interval_s=0.2,
        extra_yaml="notify:\n"
        f"  slack: {{webhook_url: {{file: {tmp_path / 'slack_url'}}}}}\n"
        f"  pagerduty: {{routing_key: {{env: TG_TEST_PD_KEY}}, url: '{receiver.url}/pd'}}\n"
        "  webhooks:\n"
        f"    - {{name: ops, url: '{receiver.url}/hook', secret: {{file: {tmp_path / 'hmac'}}}}}\n",
    )
    env = {"TG_TEST_PD_KEY": "PDROUTINGKEY", "PATH": "/usr/bin:/bin"}
    proc = ControllerProcess(cfg, log_path=tmp_path / "controller.log", env=env)
    try:
        proc.wait_listening()
        yield proc.url
    finally:
        proc.terminate(timeout_s=30)
        text = proc.log()
        for secret in ("SLACKSECRET", "PDROUTINGKEY", "hook-secret"):
            assert secret not in text, f"{secret} leaked into the log"


def _paths(rx: Receiver) -> list[str]:
    return sorted(r.path.split("/")[1] for r in rx.requests)


@pytest.mark.slow
def test_fault_to_notifications_drain_and_resolve(controller_url: str, receiver: Receiver):
    post_gpu_report(controller_url, node="node-9", dbe=1, seq=1)
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

    post_gpu_report(controller_url, node="node-9", dbe=0, seq=2)
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
