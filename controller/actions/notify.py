"""Notifications: the Notifier Protocol, Slack / PagerDuty Events v2 / signed-webhook /
Alertmanager API v2 backends over httpx, a recording fake, and the `notify` action handler.

Delivery errors are classified for the action worker: connection errors, timeouts, HTTP 429
and 5xx are transient (retried with backoff); any other 4xx is permanent. Secrets (the Slack
webhook URL, the routing key, the HMAC secret) are held by the notifier and never appear in
an error message, a log line or the timeline.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

import httpx

from trainguard.controller.actions.base import (
    ActionContext,
    Outcome,
    PermanentError,
    TransientError,
)
from trainguard.controller.config import SEVERITY_RANK, NotifyConfig
from trainguard.controller.model import Target
from trainguard.controller.rules.export import alert_annotations, alert_labels
from trainguard.controller.rules.loader import Rule
from trainguard.controller.views import IncidentView

log = logging.getLogger("trainguard.controller.notify")
# httpx logs every request URL at INFO; a Slack webhook URL is itself the credential.
logging.getLogger("httpx").setLevel(logging.WARNING)

SUMMARY_MAX_CHARS = 1024  # PagerDuty's limit for payload.summary
USER_AGENT = "trainguard-controller"
PD_SEVERITY = {"critical": "critical", "warning": "warning", "info": "info"}


@dataclass(frozen=True)
class Notification:
    """One message about one incident, the same for every channel."""

    event: Literal["trigger", "resolve"]
    incident_id: int
    rule: str
    target: str  # Target.key
    target_text: str
    severity: str
    state: str
    summary: str
    opened_at: float
    sent_at: float
    idempotency_key: str
    node: str | None = None
    job: str | None = None
    page: bool = False  # an escalation: a person must look now
    reason: str = ""  # why this escalation (budget exhausted, breaker, action failed)
    url: str = ""
    # the alert key when not an incident's (incident_id 0: the controller's own page, e.g.
    # its store unreachable, controller/storewatch.py)
    dedup: str = ""
    # the labels and annotations of the exported Prometheus alert of this rule and target
    # (controller/rules/export.py alert_labels); empty for the controller's own pages
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def dedup_key(self) -> str:
        """Stable per incident: every trigger/resolve of one incident maps to one alert."""
        return self.dedup or f"trainguard-incident-{self.incident_id}"

    def headline(self) -> str:
        prefix = "RESOLVED" if self.event == "resolve" else self.severity.upper()
        page = " PAGE" if self.page and self.event == "trigger" else ""
        about = f" (incident {self.incident_id})" if self.incident_id else ""
        return f"[{prefix}{page}] {self.rule}: {self.target_text}{about}"


class Notifier(Protocol):
    channel: str  # "slack", "pagerduty", or the webhook's name
    min_severity: str  # incidents below it are not sent (pages always are)
    idempotent: bool  # the receiver dedupes a re-send of the same idempotency key

    def send(self, notification: Notification) -> None:
        """Deliver or raise TransientError / PermanentError."""


def _post(
    client: httpx.Client, url: str, *, channel: str, body: bytes, headers: dict[str, str]
) -> httpx.Response:
    try:
        response = client.post(url, content=body, headers=headers)
    except httpx.TimeoutException:
        raise TransientError(f"{channel}: timed out") from None
    except httpx.TransportError as e:
        # The exception text can carry the URL, which is the secret for Slack: name the type.
        raise TransientError(f"{channel}: connection failed ({type(e).__name__})") from None
    code = response.status_code
    if code == 429 or code >= 500:
        raise TransientError(f"{channel}: HTTP {code}")
    if code >= 400:
        detail = response.text[:200].replace("\n", " ")
        raise PermanentError(f"{channel}: HTTP {code}: {detail}")
    return response


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()


class SlackNotifier:
    """Slack incoming webhook: Block Kit `blocks` plus a plain `text` fallback.

    Slack has no idempotency key, so a delivery interrupted by a crash is not repeated
    (at most once); every other Slack message is delivered exactly once.
    """

    idempotent = False

    def __init__(
        self, *, webhook_url: str, min_severity: str = "warning", timeout_s: float = 5.0
    ) -> None:
        self.channel = "slack"
        self.min_severity = min_severity
        self._url = webhook_url
        self._client = httpx.Client(timeout=timeout_s, headers={"User-Agent": USER_AGENT})

    @staticmethod
    def payload(n: Notification) -> dict[str, Any]:
        fields = [
            {"type": "mrkdwn", "text": f"*Target*\n{n.target_text}"},
            {"type": "mrkdwn", "text": f"*Severity*\n{n.severity}"},
            {"type": "mrkdwn", "text": f"*Rule*\n{n.rule}"},
            {"type": "mrkdwn", "text": f"*State*\n{n.state}"},
        ]
        if n.job:
            fields.append({"type": "mrkdwn", "text": f"*Job*\n{n.job}"})
        text = n.summary or n.target_text
        if n.reason:
            text += f"\n*Escalated:* {n.reason}"
        opened = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(n.opened_at))
        context = (
            f"incident {n.incident_id} opened {opened}" if n.incident_id else f"since {opened}"
        )
        if n.url:
            context += f" | <{n.url}|details>"
        blocks: list[dict[str, Any]] = [
            {"type": "header", "text": {"type": "plain_text", "text": n.headline()[:150]}},
            {"type": "section", "text": {"type": "mrkdwn", "text": text[:3000]}, "fields": fields},
            {"type": "context", "elements": [{"type": "mrkdwn", "text": context}]},
        ]
        return {"text": f"{n.headline()}: {n.summary}"[:3000], "blocks": blocks}

    def send(self, notification: Notification) -> None:
        body = _json_bytes(self.payload(notification))
        _post(
            self._client,
            self._url,
            channel=self.channel,
            body=body,
            headers={"Content-Type": "application/json"},
        )


class PagerDutyNotifier:
    """PagerDuty Events API v2: trigger on open, resolve on resolve, one dedup_key per
    incident, so PagerDuty itself dedupes a re-sent trigger (safe to repeat after a crash)."""

    idempotent = True

    def __init__(
        self,
        *,
        routing_key: str,
        url: str = "https://events.pagerduty.com/v2/enqueue",
        min_severity: str = "critical",
        source: str = "trainguard-controller",
        timeout_s: float = 5.0,
    ) -> None:
        self.channel = "pagerduty"
        self.min_severity = min_severity
        self._routing_key = routing_key
        self._url = url
        self._source = source
        self._client = httpx.Client(timeout=timeout_s, headers={"User-Agent": USER_AGENT})

    def payload(self, n: Notification) -> dict[str, Any]:
        body: dict[str, Any] = {
            "routing_key": self._routing_key,
            "event_action": n.event,
            "dedup_key": n.dedup_key,
        }
        if n.event == "resolve":
            return body
        summary = f"{n.headline()}: {n.summary}" if n.summary else n.headline()
        if n.reason:
            summary += f" [escalated: {n.reason}]"
        body["payload"] = {
            "summary": summary[:SUMMARY_MAX_CHARS],
            "source": self._source,
            "severity": "critical" if n.page else PD_SEVERITY.get(n.severity, "error"),
            "component": n.node or n.target,
            "group": n.job or n.node or "cluster",
            "class": n.rule,
            "custom_details": {
                "incident_id": n.incident_id,
                "target": n.target,
                "target_text": n.target_text,
                "state": n.state,
                "opened_at": n.opened_at,
                "page": n.page,
                "reason": n.reason,
            },
        }
        if n.url:
            body["links"] = [{"href": n.url, "text": f"incident {n.incident_id}"}]
        return body

    def send(self, notification: Notification) -> None:
        _post(
            self._client,
            self._url,
            channel=self.channel,
            body=_json_bytes(self.payload(notification)),
            headers={"Content-Type": "application/json"},
        )


def sign(secret: str, body: bytes) -> str:
    """The X-Trainguard-Signature value: "sha256=" + hex HMAC-SHA256 of the raw body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


class WebhookNotifier:
    """Generic webhook: POST JSON, signed with HMAC-SHA256, carrying an idempotency key.

    Headers: X-Trainguard-Event (trigger|resolve), X-Trainguard-Timestamp (unix seconds,
    also `sent_at` in the signed body, so a receiver can refuse old replays),
    X-Trainguard-Idempotency-Key (the same on every re-send of one delivery), and
    X-Trainguard-Signature when a secret is configured.
    """

    idempotent = True

    def __init__(
        self,
        *,
        name: str,
        url: str,
        secret: str | None = None,
        min_severity: str = "info",
        timeout_s: float = 5.0,
    ) -> None:
        self.channel = name
        self.min_severity = min_severity
        self._url = url
        self._secret = secret
        self._client = httpx.Client(timeout=timeout_s, headers={"User-Agent": USER_AGENT})

    @staticmethod
    def payload(n: Notification) -> dict[str, Any]:
        incident = asdict(n)
        for key in (
            "event", "sent_at", "idempotency_key", "page", "reason", "dedup", "labels",
            "annotations",
        ):  # fmt: skip
            incident.pop(key)
        incident["id"] = incident.pop("incident_id")
        return {
            "version": 1,
            "event": n.event,
            "sent_at": n.sent_at,
            "idempotency_key": n.idempotency_key,
            "page": n.page,
            "reason": n.reason,
            "incident": incident,
        }

    def send(self, notification: Notification) -> None:
        body = _json_bytes(self.payload(notification))
        headers = {
            "Content-Type": "application/json",
            "X-Trainguard-Event": notification.event,
            "X-Trainguard-Timestamp": str(int(notification.sent_at)),
            "X-Trainguard-Idempotency-Key": notification.idempotency_key,
        }
        if self._secret is not None:
            headers["X-Trainguard-Signature"] = sign(self._secret, body)
        _post(self._client, self._url, channel=self.channel, body=body, headers=headers)


def _rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


class AlertmanagerNotifier:
    """Alertmanager API v2: an incident is an alert labelled like the exported Prometheus
    alert of its rule and target, plus `source="controller"`.

    Alertmanager groups by labels the two share (the shipped route: alertname, node, job), so
    a fault seen by both Prometheus and the controller is one group: one notification, one
    PagerDuty dedup key (Alertmanager's hash of the group key), resolved when both alerts
    are. The `source` label keeps them two alerts, so one source's resolve cannot end the
    other's. A trigger's endsAt is `hold_s` ahead; the resolve posts endsAt = now.

    An escalation (page) of an incident below critical is a second alert labelled critical,
    so the critical route pages it; a resolve ends both. Alertmanager dedupes a re-sent
    alert, so a re-send after a crash is safe.
    """

    idempotent = True
    SOURCE = "controller"

    def __init__(
        self,
        *,
        url: str,
        min_severity: str = "info",
        labels: dict[str, str] | None = None,
        hold_s: float = 86400.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.channel = "alertmanager"
        self.min_severity = min_severity
        self._url = url.rstrip("/") + "/api/v2/alerts"
        self._labels = dict(labels or {})
        self._hold_s = hold_s
        self._client = httpx.Client(timeout=timeout_s, headers={"User-Agent": USER_AGENT})

    def _alert(self, n: Notification, *, severity: str, ends_at: float) -> dict[str, Any]:
        # as Prometheus adds its external labels: only where the alert has no such label
        labels = {**self._labels, **(n.labels or {"alertname": n.rule, "target": n.target})}
        labels.update(severity=severity, source=self.SOURCE)
        annotations = dict(n.annotations) or {"summary": n.summary or n.headline()}
        if n.incident_id:
            annotations["incident"] = str(n.incident_id)
        if n.reason and n.event == "trigger":
            annotations["escalation"] = n.reason
        alert: dict[str, Any] = {
            "labels": labels,
            "annotations": annotations,
            "startsAt": _rfc3339(n.opened_at),
            "endsAt": _rfc3339(ends_at),
        }
        if n.url:
            alert["generatorURL"] = n.url
        return alert

    def payload(self, n: Notification) -> list[dict[str, Any]]:
        """The alerts to post: the incident's, and its critical twin for a page."""
        if n.event == "resolve":
            severities = sorted({n.severity, "critical"})
            return [self._alert(n, severity=s, ends_at=n.sent_at) for s in severities]
        severity = "critical" if n.page else n.severity
        return [self._alert(n, severity=severity, ends_at=n.sent_at + self._hold_s)]

    def resend_payload(
        self, n: Notification, *, paged: bool, ends_at: float
    ) -> list[dict[str, Any]]:
        """An open incident's alerts again, firing until `ends_at`: its own and, once paged,
        its critical twin (one alert when the incident is critical itself)."""
        severities = sorted({n.severity, "critical"} if paged else {n.severity})
        return [self._alert(n, severity=s, ends_at=ends_at) for s in severities]

    def send(self, notification: Notification) -> None:
        self._post_alerts(self.payload(notification))

    def resend(self, notification: Notification, *, paged: bool, ends_at: float) -> None:
        """Post an open incident's alerts again (controller/actions/alertresend.py)."""
        self._post_alerts(self.resend_payload(notification, paged=paged, ends_at=ends_at))

    def _post_alerts(self, alerts: list[dict[str, Any]]) -> None:
        _post(
            self._client,
            self._url,
            channel=self.channel,
            body=_json_bytes(alerts),
            headers={"Content-Type": "application/json"},
        )


class RecordingNotifier:
    """Test double: records every notification; raises the queued errors first, in order."""

    def __init__(
        self,
        channel: str = "recording",
        *,
        min_severity: str = "info",
        idempotent: bool = True,
        errors: list[Exception] | None = None,
    ) -> None:
        self.channel = channel
        self.min_severity = min_severity
        self.idempotent = idempotent
        self.errors = list(errors or [])
        self.sent: list[Notification] = []
        self._lock = threading.Lock()

    def send(self, notification: Notification) -> None:
        with self._lock:
            if self.errors:
                raise self.errors.pop(0)
            self.sent.append(notification)


def build_notifiers(config: NotifyConfig) -> list[Notifier]:
    """The configured channels, secrets read now (a missing secret fails at start)."""
    out: list[Notifier] = []
    if config.slack is not None:
        out.append(
            SlackNotifier(
                webhook_url=config.slack.webhook_url.read(),
                min_severity=config.slack.min_severity,
                timeout_s=config.slack.timeout_s,
            )
        )
    if config.pagerduty is not None:
        pd = config.pagerduty
        out.append(
            PagerDutyNotifier(
                routing_key=pd.routing_key.read(),
                url=pd.url,
                min_severity=pd.min_severity,
                source=pd.source,
                timeout_s=pd.timeout_s,
            )
        )
    if config.alertmanager is not None:
        am = config.alertmanager
        out.append(
            AlertmanagerNotifier(
                url=am.url,
                min_severity=am.min_severity,
                labels=am.labels,
                hold_s=am.hold_s,
                timeout_s=am.timeout_s,
            )
        )
    for hook in config.webhooks:
        out.append(
            WebhookNotifier(
                name=hook.name,
                url=hook.url,
                secret=hook.secret.read() if hook.secret is not None else None,
                min_severity=hook.min_severity,
                timeout_s=hook.timeout_s,
            )
        )
    return out


def channels_for(notifiers: list[Notifier], *, severity: str, page: bool) -> list[str]:
    """Channels that take an incident of `severity` (a page goes to every channel)."""
    rank = SEVERITY_RANK.get(severity, 0)
    return [n.channel for n in notifiers if page or rank >= SEVERITY_RANK.get(n.min_severity, 0)]


def exported_alert(
    incident: IncidentView, rule: Rule | None
) -> tuple[dict[str, str], dict[str, str]]:
    """(labels, annotations) of the exported Prometheus alert this incident matches."""
    try:
        target = Target.from_key(incident.target)
    except ValueError:
        return {}, {}
    labels = alert_labels(
        rule=incident.rule,
        severity=incident.severity,
        target=target,
        rule_labels=rule.labels if rule is not None else {},
    )
    annotations = alert_annotations(rule) if rule is not None else {}
    return labels, annotations


def incident_notification(
    incident: IncidentView,
    *,
    event: Literal["trigger", "resolve"],
    sent_at: float,
    idempotency_key: str,
    base_url: str,
    rule: Rule | None,
    page: bool = False,
    reason: str = "",
) -> Notification:
    """What every channel is told of `incident` (the notify step's and a re-send's)."""
    url = f"{base_url.rstrip('/')}/v1/incidents/{incident.id}" if base_url else ""
    labels, annotations = exported_alert(incident, rule)
    return Notification(
        event=event,
        incident_id=incident.id,
        rule=incident.rule,
        target=incident.target,
        target_text=incident.target_text,
        severity=incident.severity,
        state=incident.state,
        summary=incident.summary,
        opened_at=incident.opened_at,
        sent_at=sent_at,
        idempotency_key=idempotency_key,
        node=incident.node,
        job=incident.job,
        page=page,
        reason=reason,
        url=url,
        labels=labels,
        annotations=annotations,
    )


@dataclass
class NotifyHandler:
    """The `notify` step: one row per channel, params {"channel", "event", "page", "reason"}.

    `rule_of` names the loaded rule of an incident (None once it is gone): its labels and
    annotations ride on the notification as the exported alert's (AlertmanagerNotifier)."""

    notifiers: dict[str, Notifier]
    base_url: str = ""
    on_failure: Callable[[str], None] = field(default=lambda channel: None)
    rule_of: Callable[[str], Rule | None] = field(default=lambda name: None)
    kind: str = "notify"
    remediation: bool = False

    def idempotent(self, params: dict[str, Any]) -> bool:
        notifier = self.notifiers.get(str(params.get("channel", "")))
        return notifier is None or notifier.idempotent

    def run(self, ctx: ActionContext) -> Outcome:
        channel = str(ctx.params.get("channel", ""))
        if not channel:
            return Outcome(message="no notification channel takes this severity", skipped=True)
        notifier = self.notifiers.get(channel)
        if notifier is None:
            raise PermanentError(f"notification channel {channel!r} is not configured")
        incident = ctx.incident
        if incident is None:
            raise PermanentError("notify needs an incident")
        notification = incident_notification(
            incident,
            event="resolve" if ctx.params.get("event") == "resolve" else "trigger",
            sent_at=ctx.now,
            idempotency_key=ctx.action.idempotency_key,
            page=bool(ctx.params.get("page", False)),
            reason=str(ctx.params.get("reason", "")),
            base_url=self.base_url,
            rule=self.rule_of(incident.rule),
        )
        try:
            notifier.send(notification)
        except (TransientError, PermanentError):
            self.on_failure(channel)
            raise
        log.info(
            "event=notified incident=%d channel=%s kind=%s page=%s",
            incident.id,
            channel,
            notification.event,
            notification.page,
        )
        return Outcome(
            message=f"{notification.event} sent to {channel}", output={"channel": channel}
        )


__all__ = [
    "AlertmanagerNotifier",
    "Notification",
    "Notifier",
    "NotifyHandler",
    "PagerDutyNotifier",
    "RecordingNotifier",
    "SlackNotifier",
    "WebhookNotifier",
    "build_notifiers",
    "channels_for",
    "incident_notification",
    "sign",
]
