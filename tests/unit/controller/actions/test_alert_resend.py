"""Re-sending open incidents to Alertmanager: every resend_s on the leader only, each open
incident's alert (and its critical twin once paged) to each alertmanager channel its trigger
reached, endsAt a few intervals ahead; no action row, failures counted, not retried."""

from __future__ import annotations

import datetime as dt

import pytest

from tests.fakes.http_receiver import Receiver
from trainguard.clock import FakeClock
from trainguard.controller.actions.alertresend import AlertResender, reached_channels
from trainguard.controller.actions.notify import AlertmanagerNotifier
from trainguard.controller.config import RESEND_HOLD_INTERVALS, NotifyConfig
from trainguard.controller.views import ActionView, IncidentView
from trainguard.strict import ConfigError, build

OPENED = 1_700_000_000.0


def _incident(id: int = 7, *, severity: str = "warning", state: str = "open") -> IncidentView:
    return IncidentView(
        id=id,
        rule="gpu_thermal_throttle",
        target=f"gpu:node-{id}:0",
        target_text=f"node-{id} gpu 0",
        severity=severity,
        state=state,
        opened_at=OPENED,
        updated_at=OPENED,
        summary="hot",
        node=f"node-{id}",
        job=None,
    )


def _notify(
    incident_id: int, *, channel: str = "alertmanager", state: str = "succeeded", **params
) -> ActionView:
    return ActionView(
        id=incident_id * 10 + len(params),
        incident_id=incident_id,
        kind="notify",
        target="t",
        state=state,  # type: ignore[arg-type]
        attempts=1,
        idempotency_key=f"{incident_id}:{channel}:{params}",
        created_at=OPENED,
        updated_at=OPENED,
        params={"channel": channel, "event": "trigger", **params},
    )


def _epoch(rfc3339: str) -> float:
    return dt.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


class World:
    def __init__(self, rx: Receiver, *, resend_s: float = 60.0) -> None:
        self.clock = FakeClock(OPENED + 5)
        self.incidents = [_incident()]
        self.actions: dict[int, list[ActionView]] = {7: [_notify(7)]}
        self.is_leader = True
        self.results: list[tuple[str, str]] = []
        self.resender = AlertResender(
            notifiers=[AlertmanagerNotifier(url=rx.url, timeout_s=2.0)],
            resend_s=resend_s,
            open_incidents=lambda: list(self.incidents),
            actions_of=lambda i: list(self.actions.get(i, [])),
            leader=lambda: self.is_leader,
            on_result=lambda channel, outcome: self.results.append((channel, outcome)),
        )

    def resend(self) -> int:
        return self.resender.resend(self.clock.now())


def test_open_incidents_are_resent_every_resend_s_not_in_between() -> None:
    with Receiver() as rx:
        w = World(rx, resend_s=60)
        assert w.resend() == 1
        w.clock.advance(59)
        assert w.resend() == 0
        w.clock.advance(1)
        assert w.resend() == 1
    assert len(rx.requests) == 2
    assert w.results == [("alertmanager", "sent")] * 2


def test_the_resent_alert_ends_a_few_intervals_ahead_and_keeps_its_start() -> None:
    with Receiver() as rx:
        w = World(rx, resend_s=30)
        w.resend()
    ((alert,),) = [r.json() for r in rx.requests]
    assert _epoch(alert["endsAt"]) == pytest.approx(w.clock.now() + RESEND_HOLD_INTERVALS * 30)
    assert _epoch(alert["startsAt"]) == pytest.approx(OPENED)
    assert alert["labels"]["severity"] == "warning"
    assert alert["labels"]["source"] == "controller"
    assert alert["annotations"]["incident"] == "7"


def test_a_standby_resends_nothing_and_a_new_leader_resends_at_once() -> None:
    with Receiver() as rx:
        w = World(rx)
        w.is_leader = False
        assert w.resend() == 0
        w.clock.advance(600)
        assert w.resend() == 0
        assert rx.requests == []
        w.is_leader = True
        assert w.resend() == 1
        w.is_leader = False
        w.clock.advance(1)
        assert w.resend() == 0
        w.is_leader = True
        assert w.resend() == 1  # leadership regained: no interval to wait out
    assert len(rx.requests) == 2


def test_resolved_incidents_are_not_resent() -> None:
    # the store's unresolved() drops them; a channel the trigger never reached is skipped too
    with Receiver() as rx:
        w = World(rx)
        w.incidents = []
        assert w.resend() == 0
        w.incidents = [_incident(8)]
        w.actions[8] = [_notify(8, channel="slack"), _notify(8, state="skipped")]
        w.clock.advance(60)
        assert w.resend() == 0
    assert rx.requests == []


def test_a_paged_incident_is_resent_with_its_critical_twin() -> None:
    with Receiver() as rx:
        w = World(rx)
        w.actions[7].append(_notify(7, page=True, reason="unacknowledged"))
        w.resend()
    (req,) = rx.requests
    assert sorted(a["labels"]["severity"] for a in req.json()) == ["critical", "warning"]


def test_a_critical_incident_paged_is_one_alert() -> None:
    with Receiver() as rx:
        w = World(rx)
        w.incidents = [_incident(severity="critical")]
        w.actions[7].append(_notify(7, page=True))
        w.resend()
    assert [a["labels"]["severity"] for a in rx.requests[0].json()] == ["critical"]


def test_a_failed_resend_is_counted_and_waits_for_the_next_round() -> None:
    with Receiver(default_status=503) as rx:
        w = World(rx)
        w.incidents = [_incident(7), _incident(8)]
        w.actions[8] = [_notify(8)]
        assert w.resend() == 0
        assert len(rx.requests) == 1  # one failure per channel and round
        assert w.results == [("alertmanager", "failed")]
        w.clock.advance(30)
        assert w.resend() == 0 and len(rx.requests) == 1
        rx.default_status = 200
        w.clock.advance(30)
        assert w.resend() == 2


def test_reached_channels_reads_trigger_rows_delivered_and_pages() -> None:
    actions = [
        _notify(1),
        _notify(1, channel="pagerduty", state="running"),
        _notify(1, channel="slack", state="failed"),
        _notify(1, page=True),
        _notify(1, channel="webhook", event="resolve"),
    ]
    assert reached_channels(actions) == {"alertmanager": True, "pagerduty": False}


@pytest.mark.parametrize("resend_s", [0, 9.9, 3601, -1], ids=["zero", "low", "high", "negative"])
def test_a_resend_interval_out_of_bounds_is_refused(resend_s: float) -> None:
    with pytest.raises(ConfigError, match="resend_s: must be between 10 and 3600 s"):
        build(NotifyConfig, {"alertmanager": {"url": "http://am", "resend_s": resend_s}})


def test_the_resend_interval_defaults_to_a_minute() -> None:
    config = build(NotifyConfig, {"alertmanager": {"url": "http://am"}})
    assert config.alertmanager is not None and config.alertmanager.resend_s == 60.0
