"""Re-sending every open incident's alert(s) to Alertmanager on a cadence (as Prometheus
re-sends firing alerts every resend_delay).

Alertmanager keeps alerts in memory only: after its restart, a lost POST or an HA peer that
never saw one, an open incident's page would be gone until the incident resolves. The leader
re-posts each open incident's alert (and its critical twin once paged) to each alertmanager
channel its trigger reached, every `notify.alertmanager.resend_s`, with endsAt
RESEND_HOLD_INTERVALS intervals ahead, so alerts the controller stops re-sending resolve by
themselves. A re-send is idempotent in Alertmanager: it writes no action row; a failure is
logged and counted (trainguard_controller_alert_resends_total{outcome="failed"}) and the next
round is the retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainguard.controller.actionkinds import ActionKind
from trainguard.controller.actions.base import PermanentError, TransientError
from trainguard.controller.actions.notify import AlertmanagerNotifier, incident_notification
from trainguard.controller.config import RESEND_HOLD_INTERVALS
from trainguard.controller.rules.loader import Rule
from trainguard.controller.views import ActionView, IncidentView

__all__ = ["AlertResender", "reached_channels"]

log = logging.getLogger("trainguard.controller")

_DELIVERED = ("succeeded", "running")  # running: sent, then a crash before it was recorded


def reached_channels(actions: Sequence[ActionView]) -> dict[str, bool]:
    """{channel: paged} for each channel an incident's trigger notification reached."""
    out: dict[str, bool] = {}
    for a in actions:
        channel = str(a.params.get("channel") or "")
        if (
            a.kind != ActionKind.NOTIFY
            or not channel
            or a.params.get("event", "trigger") != "trigger"
            or a.state not in _DELIVERED
        ):
            continue
        out[channel] = out.get(channel, False) or bool(a.params.get("page", False))
    return out


@dataclass
class AlertResender:
    """`resend(now)` re-posts the open incidents' alerts when `resend_s` has passed since the
    last round; it does nothing while `leader()` is false (an HA standby, a deposed leader)."""

    notifiers: Sequence[AlertmanagerNotifier]
    resend_s: float
    open_incidents: Callable[[], list[IncidentView]]
    actions_of: Callable[[int], list[ActionView]]
    leader: Callable[[], bool] = field(default=lambda: True)
    rule_of: Callable[[str], Rule | None] = field(default=lambda name: None)
    base_url: str = ""
    on_result: Callable[[str, str], None] = field(default=lambda channel, outcome: None)
    _last_at: float | None = field(default=None, init=False)

    def due(self, now: float) -> bool:
        return self._last_at is None or now - self._last_at >= self.resend_s

    def resend(self, now: float) -> int:
        """One round if due; returns how many incidents' alerts were posted."""
        if not self.notifiers or not self.leader():
            self._last_at = None  # a new leader re-sends at once
            return 0
        if not self.due(now):
            return 0
        self._last_at = now
        ends_at = now + RESEND_HOLD_INTERVALS * self.resend_s
        by_channel = {n.channel: n for n in self.notifiers}
        posted = 0
        failing: set[str] = set()  # one failure per channel and round: no timeout per alert
        for incident in self.open_incidents():
            reached = reached_channels(self.actions_of(incident.id))
            for channel, paged in sorted(reached.items()):
                notifier = by_channel.get(channel)
                if notifier is None or channel in failing:
                    continue
                notification = incident_notification(
                    incident,
                    event="trigger",
                    sent_at=now,
                    idempotency_key=f"{incident.id}:resend:{channel}",
                    base_url=self.base_url,
                    rule=self.rule_of(incident.rule),
                    page=paged,
                )
                try:
                    notifier.resend(notification, paged=paged, ends_at=ends_at)
                except (TransientError, PermanentError) as e:
                    failing.add(channel)
                    self.on_result(channel, "failed")
                    log.warning(
                        "event=alert_resend_failed incident=%d channel=%s error=%r",
                        incident.id,
                        channel,
                        str(e),
                    )
                    continue
                self.on_result(channel, "sent")
                posted += 1
        return posted
