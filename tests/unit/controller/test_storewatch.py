"""The store watch (controller/storewatch.py) round by round on a FakeClock, with a probe that
fails while the test says the store is down and recording notifiers: the store_up gauge, no
page before store.page_after_s, one trigger per outage and channel, delivery failures tried
again only when they may pass, the resolve only where the trigger went, a second outage paged
anew; and the page itself (store_page): who, what, its keys, no password."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from tests.helpers import wait_for
from trainguard.clock import FakeClock
from trainguard.controller.actions.base import PermanentError, TransientError
from trainguard.controller.actions.notify import Notification, Notifier, RecordingNotifier
from trainguard.controller.storeurl import redact_url
from trainguard.controller.storewatch import PAGE_RULE, RESOLVE_TRIES, StoreWatch, store_page

INSTANCE = "ctl-a:8800"
STORE_URL = "postgresql://trainguard:s3cr3t-pw@db.example:5432/trainguard"
PAGE_AFTER_S = 10.0


class FlakyProbe:
    """A probe that raises while `down` is set (what a SELECT 1 on a lost server does)."""

    def __init__(self) -> None:
        self.down = False
        self.calls = 0
        self.error: Exception = ConnectionError("connection refused\n  is the server running?")

    def __call__(self) -> None:
        self.calls += 1
        if self.down:
            raise self.error


class Site:
    """A StoreWatch on a fake clock, its probe, its channels and its registry."""

    def __init__(
        self,
        *notifiers: RecordingNotifier,
        page_after_s: float = PAGE_AFTER_S,
        store: str = redact_url(STORE_URL),
    ) -> None:
        self.clock = FakeClock()
        self.probe = FlakyProbe()
        self.registry = CollectorRegistry()
        self.notifiers = list(notifiers)
        channels: list[Notifier] = list(notifiers)
        self.watch = StoreWatch(
            probe=self.probe,
            notifiers=channels,
            instance=INSTANCE,
            store=store,
            page_after_s=page_after_s,
            registry=self.registry,
            clock=self.clock,
        )

    def up(self) -> float | None:
        return self.registry.get_sample_value("trainguard_controller_store_up")

    def rounds(self, n: int, *, every_s: float = 1.0) -> None:
        """`n` rounds, the clock moved `every_s` before each (one probe interval)."""
        for _ in range(n):
            self.clock.advance(every_s)
            self.watch.round()


def events(notifier: RecordingNotifier) -> list[str]:
    return [n.event for n in notifier.sent]


@pytest.fixture
def pager() -> RecordingNotifier:
    return RecordingNotifier("pagerduty", min_severity="critical")


@pytest.fixture
def slack() -> RecordingNotifier:
    return RecordingNotifier("slack", min_severity="warning")


def test_the_gauge_is_1_while_the_store_answers_and_0_while_it_does_not(
    pager: RecordingNotifier,
) -> None:
    site = Site(pager)
    assert site.up() == 1.0  # before the first probe: not reported down
    site.rounds(1)
    assert (site.up(), site.watch.up) == (1.0, True)
    site.probe.down = True
    site.rounds(1)
    assert (site.up(), site.watch.up) == (0.0, False)
    assert site.watch.status()["down_since"] == site.clock.now()
    site.probe.down = False
    site.rounds(1)
    assert (site.up(), site.watch.up) == (1.0, True)


def test_the_probe_error_is_kept_on_one_line_and_bounded(pager: RecordingNotifier) -> None:
    site = Site(pager)
    site.probe.down = True
    site.rounds(1)
    assert site.watch.status()["error"] == (
        "ConnectionError: connection refused is the server running?"
    )
    site.probe.error = RuntimeError("x" * 1000)
    site.rounds(1)
    assert len(site.watch.status()["error"]) == 300


def test_no_page_before_page_after_s_then_one_trigger_per_channel_for_the_outage(
    pager: RecordingNotifier, slack: RecordingNotifier
) -> None:
    site = Site(pager, slack)
    site.probe.down = True
    site.rounds(1)  # the first failed probe: down since now
    since = site.clock.now()
    site.rounds(9)  # 9 s down: not yet
    assert site.clock.now() - since == 9.0
    assert pager.sent == [] and slack.sent == []
    site.rounds(1)  # 10 s down: page_after_s reached
    assert events(pager) == ["trigger"] and events(slack) == ["trigger"]
    site.rounds(30)  # still down: the page is not repeated
    assert events(pager) == ["trigger"] and events(slack) == ["trigger"]
    assert [p.event for p in site.watch.pages_sent] == ["trigger", "trigger"]
    assert pager.sent[0].opened_at == since
    assert pager.sent[0].sent_at == since + 10.0


def test_an_outage_shorter_than_page_after_s_is_neither_paged_nor_resolved(
    pager: RecordingNotifier,
) -> None:
    site = Site(pager)
    site.probe.down = True
    site.rounds(9)
    site.probe.down = False
    site.rounds(5)
    site.probe.down = True  # a new outage: its own 10 s from its own first failed probe
    site.rounds(9)
    assert pager.sent == []
    site.probe.down = False
    site.rounds(5)
    assert pager.sent == []
    assert site.watch.pages_sent == []


def test_the_store_back_resolves_the_page_on_every_channel_that_got_it(
    pager: RecordingNotifier, slack: RecordingNotifier
) -> None:
    site = Site(pager, slack)
    site.probe.down = True
    site.rounds(11)
    site.probe.down = False
    site.rounds(1)
    assert events(pager) == ["trigger", "resolve"] and events(slack) == ["trigger", "resolve"]
    trigger, resolve = pager.sent
    assert resolve.state == "resolved" and trigger.state == "open"
    assert resolve.dedup_key == trigger.dedup_key
    assert resolve.opened_at == trigger.opened_at  # the outage it closes
    site.rounds(10)  # resolved once
    assert events(pager) == ["trigger", "resolve"]


def test_a_transient_delivery_failure_is_tried_again_next_round_a_permanent_one_never(
    slack: RecordingNotifier,
) -> None:
    flaky = RecordingNotifier("pagerduty", errors=[TransientError("pagerduty: HTTP 503")])
    broken = RecordingNotifier("ops", errors=[PermanentError("ops: HTTP 404: no such hook")])
    site = Site(flaky, broken, slack)
    site.probe.down = True
    site.rounds(11)  # the page round: pagerduty and ops fail, slack has it
    assert (events(flaky), events(broken), events(slack)) == ([], [], ["trigger"])
    assert flaky.errors == [] and broken.errors == []  # each was tried once
    site.rounds(1)  # pagerduty again (and ops, if it were retried, would now succeed)
    assert (events(flaky), events(broken), events(slack)) == (["trigger"], [], ["trigger"])
    site.rounds(10)
    assert (events(flaky), events(broken), events(slack)) == (["trigger"], [], ["trigger"])
    site.probe.down = False
    site.rounds(1)
    # resolved where the trigger went; ops, which never had it, is not told
    assert events(flaky) == ["trigger", "resolve"]
    assert events(slack) == ["trigger", "resolve"]
    assert events(broken) == []


def test_a_channel_failing_unexpectedly_does_not_keep_the_page_from_the_others(
    slack: RecordingNotifier,
) -> None:
    buggy = RecordingNotifier("ops", errors=[RuntimeError("a bug in a notifier")] * 100)
    site = Site(buggy, slack)
    site.probe.down = True
    for _ in range(12):
        site.clock.advance(1)
        try:
            site.watch.round()
        except RuntimeError:  # the thread's loop logs it and goes on
            pass
    assert events(slack) == ["trigger"]


def test_a_trigger_still_owed_when_the_store_returns_is_neither_sent_nor_resolved(
    slack: RecordingNotifier,
) -> None:
    flaky = RecordingNotifier("pagerduty", errors=[TransientError("pagerduty: timed out")])
    site = Site(flaky, slack)
    site.probe.down = True
    site.rounds(11)
    assert (events(flaky), events(slack)) == ([], ["trigger"])
    site.probe.down = False  # back before pagerduty's next try
    site.rounds(5)
    assert events(flaky) == []
    assert events(slack) == ["trigger", "resolve"]


def test_a_resolve_that_fails_transiently_is_tried_again_and_given_up_after_bounded_tries(
    slack: RecordingNotifier,
) -> None:
    flaky = RecordingNotifier("pagerduty")
    site = Site(flaky, slack)
    site.probe.down = True
    site.rounds(11)
    flaky.errors = [TransientError("pagerduty: HTTP 502")] * 2
    site.probe.down = False
    site.rounds(1)
    assert (events(flaky), events(slack)) == (["trigger"], ["trigger", "resolve"])
    site.rounds(2)
    assert events(flaky) == ["trigger", "resolve"]
    assert events(slack) == ["trigger", "resolve"]

    never = RecordingNotifier("ops")
    site = Site(never)
    site.probe.down = True
    site.rounds(11)
    never.errors = [TransientError("ops: HTTP 500")] * (RESOLVE_TRIES + 5)
    site.probe.down = False
    site.rounds(RESOLVE_TRIES + 5)
    assert events(never) == ["trigger"]
    # given up after RESOLVE_TRIES tries: the rest of the queued errors were never reached
    assert len(never.errors) == 5


def test_a_second_outage_pages_again_under_a_new_idempotency_key(
    pager: RecordingNotifier,
) -> None:
    site = Site(pager)
    for _ in range(2):
        site.probe.down = True
        site.rounds(11)
        site.probe.down = False
        site.rounds(3)
    assert events(pager) == ["trigger", "resolve", "trigger", "resolve"]
    keys = [n.idempotency_key for n in pager.sent]
    assert len(set(keys)) == 4  # one per outage and event
    assert {n.dedup_key for n in pager.sent} == {f"trainguard-store-{INSTANCE}"}
    first, _, second, _ = pager.sent
    assert second.opened_at > first.opened_at


def test_page_after_0_pages_at_the_first_failed_probe(pager: RecordingNotifier) -> None:
    site = Site(pager, page_after_s=0)
    site.rounds(3)
    assert pager.sent == []
    site.probe.down = True
    site.rounds(1)
    assert events(pager) == ["trigger"]
    assert pager.sent[0].opened_at == pager.sent[0].sent_at == site.clock.now()
    site.rounds(5)
    assert events(pager) == ["trigger"]
    site.probe.down = False
    site.rounds(1)
    assert events(pager) == ["trigger", "resolve"]


def test_without_a_notify_channel_the_watch_still_tracks_the_store() -> None:
    site = Site()
    site.probe.down = True
    site.rounds(20)
    assert site.up() == 0.0 and site.watch.pages_sent == []
    site.probe.down = False
    site.rounds(1)
    assert site.up() == 1.0


def test_the_page_says_which_controller_cannot_reach_which_store_and_never_the_password(
    pager: RecordingNotifier,
) -> None:
    site = Site(pager)
    site.probe.down = True
    site.rounds(11)
    site.probe.down = False
    site.rounds(1)
    trigger, resolve = pager.sent
    for page in (trigger, resolve):
        assert page.page is True
        assert page.severity == "critical"
        assert page.rule == PAGE_RULE == "controller_store_unreachable"
        assert page.incident_id == 0
        assert page.dedup_key == f"trainguard-store-{INSTANCE}"
        assert page.target == f"controller:{INSTANCE}"
        assert "s3cr3t-pw" not in page.summary
        assert "(incident" not in page.headline()
    assert "db.example:5432" in trigger.summary and f"controller {INSTANCE}" in trigger.summary
    assert "ConnectionError: connection refused" in trigger.summary
    assert "again" in resolve.summary
    assert trigger.headline() == f"[CRITICAL PAGE] {PAGE_RULE}: controller {INSTANCE}"
    assert resolve.headline() == f"[RESOLVED] {PAGE_RULE}: controller {INSTANCE}"
    assert trigger.idempotency_key != resolve.idempotency_key


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(
            lambda since: store_page(
                event="trigger",
                instance="i",
                store="s",
                since=since,
                now=since + 10,
                error="e",
            ),
            id="trigger",
        ),
        pytest.param(
            lambda since: store_page(
                event="resolve", instance="i", store="s", since=since, now=since + 10, error=""
            ),
            id="resolve",
        ),
    ],
)
def test_store_page_keys_depend_on_the_outage_and_the_event_not_on_when_it_is_sent(
    make: Callable[[float], Notification],
) -> None:
    a = make(1_700_000_000.0)
    assert make(1_700_000_000.0).idempotency_key == a.idempotency_key
    assert make(1_700_000_100.0).idempotency_key != a.idempotency_key
    assert make(1_700_000_100.0).dedup_key == a.dedup_key == "trainguard-store-i"


def test_the_watch_thread_probes_every_interval_until_stopped(
    pager: RecordingNotifier,
) -> None:
    site = Site()
    watch = StoreWatch(
        probe=site.probe,
        notifiers=[pager],
        instance=INSTANCE,
        store="s",
        page_after_s=0,
        clock=site.clock,
        interval_s=0.01,
    )
    watch.start()
    try:
        site.probe.down = True
        wait_for(lambda: events(pager) == ["trigger"], timeout_s=10, what="the trigger")
        site.probe.down = False
        wait_for(lambda: events(pager)[-1:] == ["resolve"], timeout_s=10, what="the resolve")
    finally:
        watch.stop()
    assert not [t for t in threading.enumerate() if t.name == "trainguard-storewatch"]
    assert events(pager) == ["trigger", "resolve"]


def test_a_probe_that_never_answers_counts_as_down_and_is_not_started_again_until_it_returns(
    pager: RecordingNotifier,
) -> None:
    # a server that answers nothing (a cut network): the probe hangs, the watch does not
    release = threading.Event()
    calls: list[int] = []

    def hanging_probe() -> None:
        calls.append(1)
        release.wait(30)

    clock = FakeClock()
    registry = CollectorRegistry()
    watch = StoreWatch(
        probe=hanging_probe,
        notifiers=[pager],
        instance=INSTANCE,
        store=redact_url(STORE_URL),
        page_after_s=0,
        registry=registry,
        clock=clock,
        probe_timeout_s=0.05,
    )
    watch.round()
    assert registry.get_sample_value("trainguard_controller_store_up") == 0
    assert "no answer to a probe within 0.05 s" in watch.status()["error"]
    assert events(pager) == ["trigger"]
    clock.advance(1)
    watch.round()  # still hanging: counted down again, no second probe started
    assert len(calls) == 1
    assert "has not answered a probe for 1 s" in watch.status()["error"]  # on the clock
    release.set()
    wait_for(lambda: watch._hung is None or not watch._hung.is_alive(), timeout_s=10, what="probe")
    clock.advance(1)
    watch.round()
    assert len(calls) == 2
    assert registry.get_sample_value("trainguard_controller_store_up") == 1
    assert events(pager) == ["trigger", "resolve"]
