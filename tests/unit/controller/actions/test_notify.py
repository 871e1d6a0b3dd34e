"""Notifiers against a real local HTTP receiver: payload shapes (Slack Block Kit, PagerDuty
Events v2, signed webhook), error classification, and secrets kept out of errors."""

from __future__ import annotations

import hashlib
import hmac
import socket

import pytest

from tests.fakes.http_receiver import Receiver
from trainguard.controller.actions.base import PermanentError, TransientError
from trainguard.controller.actions.notify import (
    Notification,
    PagerDutyNotifier,
    SlackNotifier,
    WebhookNotifier,
    build_notifiers,
    channels_for,
)
from trainguard.controller.config import NotifyConfig
from trainguard.strict import ConfigError, build


def _n(**kw) -> Notification:
    base = dict(
        event="trigger",
        incident_id=42,
        rule="gpu_dbe",
        target="gpu:node-7:3",
        target_text="node-7 gpu 3",
        severity="critical",
        state="open",
        summary="node-7 gpu 3: uncorrectable ECC errors (value 2)",
        opened_at=1_700_000_000.0,
        sent_at=1_700_000_005.0,
        idempotency_key="42:0:notify:x",
        node="node-7",
        job="llama-70b",
    )
    base.update(kw)
    return Notification(**base)


def test_slack_posts_block_kit_with_text_fallback():
    with Receiver() as rx:
        SlackNotifier(webhook_url=f"{rx.url}/services/T0/B0/secret").send(_n())
    body = rx.requests[0].json()
    assert body["text"].startswith("[CRITICAL] gpu_dbe: node-7 gpu 3 (incident 42)")
    types = [b["type"] for b in body["blocks"]]
    assert types == ["header", "section", "context"]
    assert body["blocks"][0]["text"]["type"] == "plain_text"
    assert "uncorrectable ECC" in body["blocks"][1]["text"]["text"]
    assert rx.requests[0].headers["content-type"] == "application/json"


def test_pagerduty_trigger_and_resolve_share_a_dedup_key():
    with Receiver(default_status=202) as rx:
        pd = PagerDutyNotifier(routing_key="R0UTING", url=f"{rx.url}/v2/enqueue")
        pd.send(_n(summary="x" * 2000))
        pd.send(_n(event="resolve", state="resolved"))
    trigger, resolve = (r.json() for r in rx.requests)
    assert trigger["routing_key"] == "R0UTING" and trigger["event_action"] == "trigger"
    assert trigger["dedup_key"] == resolve["dedup_key"] == "trainguard-incident-42"
    payload = trigger["payload"]
    assert len(payload["summary"]) == 1024
    assert payload["severity"] == "critical" and payload["class"] == "gpu_dbe"
    assert (payload["component"], payload["group"]) == ("node-7", "llama-70b")
    assert payload["source"] == "trainguard-controller"
    assert payload["custom_details"]["incident_id"] == 42
    assert resolve == {
        "routing_key": "R0UTING",
        "event_action": "resolve",
        "dedup_key": trigger["dedup_key"],
    }


@pytest.mark.parametrize(
    ("severity", "page", "expected"),
    [("warning", False, "warning"), ("info", False, "info"), ("warning", True, "critical")],
    ids=["warning", "info", "page-is-critical"],
)
def test_pagerduty_severity_mapping(severity, page, expected):
    pd = PagerDutyNotifier(routing_key="k", url="http://127.0.0.1:1/")
    assert pd.payload(_n(severity=severity, page=page))["payload"]["severity"] == expected


def test_webhook_is_signed_and_carries_idempotency_key():
    with Receiver() as rx:
        WebhookNotifier(name="ops", url=f"{rx.url}/hook", secret="s3cret").send(_n())
    req = rx.requests[0]
    expected = "sha256=" + hmac.new(b"s3cret", req.body, hashlib.sha256).hexdigest()
    assert req.headers["x-trainguard-signature"] == expected
    assert req.headers["x-trainguard-idempotency-key"] == "42:0:notify:x"
    assert req.headers["x-trainguard-event"] == "trigger"
    body = req.json()
    assert req.headers["x-trainguard-timestamp"] == str(int(body["sent_at"]))
    assert body["incident"]["id"] == 42 and body["incident"]["rule"] == "gpu_dbe"


def test_webhook_without_secret_sends_no_signature():
    with Receiver() as rx:
        WebhookNotifier(name="ops", url=rx.url).send(_n())
    assert "x-trainguard-signature" not in rx.requests[0].headers


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (500, TransientError),
        (503, TransientError),
        (429, TransientError),
        (400, PermanentError),
        (403, PermanentError),
        (404, PermanentError),
    ],
    ids=["500", "503", "429", "400", "403", "404"],
)
def test_http_status_classification(status, error):
    with Receiver() as rx:
        rx.statuses.append(status)
        with pytest.raises(error, match=f"HTTP {status}"):
            WebhookNotifier(name="ops", url=rx.url).send(_n())


def test_connection_refused_is_transient_and_does_not_leak_the_slack_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    slack = SlackNotifier(webhook_url=f"http://127.0.0.1:{port}/services/T0/B0/TOPSECRET")
    with pytest.raises(TransientError) as info:
        slack.send(_n())
    assert "TOPSECRET" not in str(info.value)


def test_build_notifiers_reads_secrets_from_file_and_env(tmp_path, monkeypatch):
    (tmp_path / "slack").write_text("http://127.0.0.1:9/hook\n")
    monkeypatch.setenv("PD_KEY", "abc")
    config = build(
        NotifyConfig,
        {
            "slack": {"webhook_url": {"file": str(tmp_path / "slack")}},
            "pagerduty": {"routing_key": {"env": "PD_KEY"}},
            "webhooks": [{"name": "ops", "url": "http://127.0.0.1:9/"}],
        },
    )
    assert [n.channel for n in build_notifiers(config)] == ["slack", "pagerduty", "ops"]


def test_missing_secret_fails_naming_the_variable_not_a_value(monkeypatch):
    monkeypatch.delenv("PD_KEY", raising=False)
    config = build(NotifyConfig, {"pagerduty": {"routing_key": {"env": "PD_KEY"}}})
    with pytest.raises(ConfigError, match="PD_KEY"):
        build_notifiers(config)


def test_channels_follow_min_severity_and_pages_reach_all():
    class N:
        def __init__(self, channel, min_severity):
            self.channel, self.min_severity, self.idempotent = channel, min_severity, True

    notifiers = [N("slack", "warning"), N("pagerduty", "critical"), N("ops", "info")]
    assert channels_for(notifiers, severity="warning", page=False) == ["slack", "ops"]
    assert channels_for(notifiers, severity="info", page=True) == ["slack", "pagerduty", "ops"]


def test_a_notification_with_its_own_dedup_key_keeps_it_on_trigger_and_resolve():
    store_page = dict(incident_id=0, dedup="trainguard-store-ctl-a:8800")
    pd = PagerDutyNotifier(routing_key="k", url="http://127.0.0.1:1/")
    trigger = pd.payload(_n(**store_page))
    resolve = pd.payload(_n(event="resolve", state="resolved", **store_page))
    assert trigger["dedup_key"] == resolve["dedup_key"] == "trainguard-store-ctl-a:8800"
    assert _n().dedup_key == "trainguard-incident-42"  # an incident's: from its id


def test_the_headline_names_the_incident_only_when_there_is_one():
    assert _n().headline() == "[CRITICAL] gpu_dbe: node-7 gpu 3 (incident 42)"
    page = _n(incident_id=0, rule="controller_store_unreachable", target_text="controller a")
    assert page.headline() == "[CRITICAL] controller_store_unreachable: controller a"
    assert _n(incident_id=0, page=True).headline() == "[CRITICAL PAGE] gpu_dbe: node-7 gpu 3"
    assert _n(incident_id=0, event="resolve").headline() == "[RESOLVED] gpu_dbe: node-7 gpu 3"
    context = SlackNotifier.payload(_n(incident_id=0))["blocks"][2]["elements"][0]["text"]
    assert context == "since 2023-11-14 22:13:20 UTC"
    context = SlackNotifier.payload(_n())["blocks"][2]["elements"][0]["text"]
    assert context == "incident 42 opened 2023-11-14 22:13:20 UTC"


def test_the_webhook_payload_leaves_the_dedup_key_out():
    body = WebhookNotifier.payload(_n(incident_id=0, dedup="trainguard-store-a"))
    assert "dedup" not in body["incident"]
    assert "trainguard-store-a" not in repr(body)
    assert body["incident"]["id"] == 0
    assert set(body["incident"]) == set(WebhookNotifier.payload(_n())["incident"])
