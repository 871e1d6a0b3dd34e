"""The `alertmanager` channel: an incident is posted to Alertmanager's API v2 as the exported
Prometheus alert of its rule and target (same labels and annotations, plus `source`), so
Alertmanager groups both into one notification; a resolve ends it with endsAt = now."""

from __future__ import annotations

import pytest

from tests.fakes.http_receiver import Receiver
from trainguard.controller.actions.notify import (
    AlertmanagerNotifier,
    Notification,
    build_notifiers,
    exported_alert,
)
from trainguard.controller.config import NotifyConfig
from trainguard.controller.model import Target
from trainguard.controller.rules.export import to_prometheus_rules
from trainguard.controller.rules.loader import load_rules
from trainguard.controller.views import IncidentView
from trainguard.rules import shipped_dir
from trainguard.strict import ConfigError, build

OPENED = 1_700_000_000.0
SENT = 1_700_000_005.0


def _incident(rule: str = "gpu_uncorrectable_ecc", target: str = "gpu:node-7:3") -> IncidentView:
    return IncidentView(
        id=42,
        rule=rule,
        target=target,
        target_text="node-7 gpu 3",
        severity="critical",
        state="open",
        opened_at=OPENED,
        updated_at=OPENED,
        summary="node-7 gpu 3: uncorrectable ECC errors (value 2)",
        node="node-7",
        job="llama-70b",
    )


def _n(incident: IncidentView | None = None, **kw) -> Notification:
    incident = incident or _incident()
    rules = load_rules([shipped_dir() / "default.yaml"])
    labels, annotations = exported_alert(incident, rules.get(incident.rule))
    base = dict(
        event="trigger",
        incident_id=incident.id,
        rule=incident.rule,
        target=incident.target,
        target_text=incident.target_text,
        severity=incident.severity,
        state="open",
        summary=incident.summary,
        opened_at=OPENED,
        sent_at=SENT,
        idempotency_key="42:0:notify:alertmanager",
        node=incident.node,
        job=incident.job,
        labels=labels,
        annotations=annotations,
    )
    base.update(kw)
    return Notification(**base)


@pytest.mark.parametrize(
    "key",
    [
        "gpu:node-1:3",
        "nvlink:node-1:3:11",
        "ib_port:node-2:mlx5_0:1",
        "node:n-1",
        "rank:j:5",
        "job:llama-70b",
        "controller",
    ],
    ids=["gpu", "nvlink", "ib_port", "node", "rank", "job", "controller"],
)
def test_a_target_key_reads_back_as_its_target(key: str) -> None:
    assert Target.from_key(key).key == key


def test_a_key_that_is_no_target_is_refused() -> None:
    for key in ("gpu:node-1", "disk:node-1", "gpu:node-1:x"):
        with pytest.raises(ValueError):
            Target.from_key(key)


def test_the_alert_carries_the_exported_alerts_labels_and_annotations_plus_source() -> None:
    rules = load_rules([shipped_dir() / "default.yaml"])
    exported, _ = to_prometheus_rules(rules)
    (rule,) = [r for r in exported["groups"][0]["rules"] if r["alert"] == "gpu_uncorrectable_ecc"]
    am = AlertmanagerNotifier(url="http://am:9093/", labels={"cluster": "c1"}, hold_s=3600)
    (alert,) = am.payload(_n())
    # what Prometheus puts on the alert: alertname, the rule's labels, the `by (node, gpu)`
    assert alert["labels"] == {
        "alertname": "gpu_uncorrectable_ecc",
        **rule["labels"],
        "node": "node-7",
        "gpu": "3",
        "cluster": "c1",
        "source": "controller",
    }
    assert {k: alert["annotations"][k] for k in rule["annotations"]} == rule["annotations"]
    assert alert["annotations"]["incident"] == "42"
    assert alert["startsAt"] == "2023-11-14T22:13:20.000Z"
    assert alert["endsAt"] == "2023-11-14T23:13:25.000Z"  # sent_at + hold_s


def test_a_resolve_ends_the_alert_now_with_the_same_labels() -> None:
    am = AlertmanagerNotifier(url="http://am:9093")
    (trigger,) = am.payload(_n())
    (resolve,) = am.payload(_n(event="resolve", state="resolved", sent_at=OPENED + 60.5))
    assert resolve["labels"] == trigger["labels"]
    assert resolve["endsAt"] == "2023-11-14T22:14:20.500Z"


def test_a_page_of_a_warning_incident_is_a_critical_twin_that_the_resolve_ends_too() -> None:
    warning = _incident(rule="gpu_thermal_slowdown")
    warning = IncidentView(**{**warning.__dict__, "severity": "warning"})
    am = AlertmanagerNotifier(url="http://am:9093")
    (plain,) = am.payload(_n(warning))
    (page,) = am.payload(_n(warning, page=True, reason="drain budget exhausted"))
    assert plain["labels"]["severity"] == "warning"
    assert page["labels"] == {**plain["labels"], "severity": "critical"}
    assert page["annotations"]["escalation"] == "drain budget exhausted"
    resolves = am.payload(_n(warning, event="resolve", state="resolved"))
    assert sorted(r["labels"]["severity"] for r in resolves) == ["critical", "warning"]


def test_a_rule_no_longer_loaded_still_gets_the_targets_labels() -> None:
    am = AlertmanagerNotifier(url="http://am:9093")
    (alert,) = am.payload(_n(_incident(rule="gone_rule")))
    assert alert["labels"] == {
        "alertname": "gone_rule",
        "severity": "critical",
        "scope": "gpu",
        "node": "node-7",
        "gpu": "3",
        "source": "controller",
    }
    assert alert["annotations"]["summary"].startswith("node-7 gpu 3")


def test_the_controllers_own_page_has_a_name_and_its_target() -> None:
    am = AlertmanagerNotifier(url="http://am:9093")
    page = _n(incident_id=0, rule="controller_store_unreachable", target="controller:a:8800")
    (alert,) = am.payload(Notification(**{**page.__dict__, "labels": {}, "annotations": {}}))
    assert alert["labels"]["alertname"] == "controller_store_unreachable"
    assert alert["labels"]["target"] == "controller:a:8800"
    assert "incident" not in alert["annotations"]


def test_it_posts_a_json_list_to_the_api_v2_alerts_path() -> None:
    with Receiver() as rx:
        AlertmanagerNotifier(url=f"{rx.url}/am/").send(_n())
    (req,) = rx.requests
    assert req.path == "/am/api/v2/alerts"
    assert isinstance(req.json(), list) and req.json()[0]["labels"]["source"] == "controller"


def test_the_channel_is_built_from_config() -> None:
    config = build(NotifyConfig, {"alertmanager": {"url": "http://am:9093", "hold_s": 600}})
    (am,) = build_notifiers(config)
    assert am.channel == "alertmanager" and am.min_severity == "info"


@pytest.mark.parametrize(
    ("section", "reason"),
    [
        ({"url": "am:9093"}, "http"),
        ({"url": "http://am", "labels": {"node": "x"}}, "set by trainguard"),
        ({"url": "http://am", "labels": {"bad-name": "x"}}, "invalid label name"),
        ({"url": "http://am", "hold_s": 0}, "hold_s"),
    ],
    ids=["url", "own-label", "label-name", "hold"],
)
def test_a_bad_alertmanager_section_is_refused(section: dict, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        build(NotifyConfig, {"alertmanager": section})


def test_a_webhook_cannot_take_the_channels_name() -> None:
    with pytest.raises(ConfigError, match="reserved"):
        build(NotifyConfig, {"webhooks": [{"name": "alertmanager", "url": "http://x"}]})
