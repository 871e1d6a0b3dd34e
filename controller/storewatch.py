"""Watching a PostgreSQL store from outside the work that needs it, and paging when it is gone.

Every second `StoreWatch` asks the store `SELECT 1` on a connection of its own (so the
answer never waits behind a long store transaction, and a lost server is noticed even
while nothing else writes). While the store cannot be reached the controller does nothing
that needs it, which is everything it does for a cluster: no incident opens, no step runs
(controller/ha.py: a leader that cannot renew its lease steps down). That is a state a
person must hear of, and the incident machinery cannot say it (an incident is a row in the
store), so this module pages every configured notify channel itself once the store has
been unreachable for `store.page_after_s`, and resolves the page when the store is back.

A page is a Notification with incident id 0 and rule `controller_store_unreachable`, one
PagerDuty dedup key per controller instance (`trainguard-store-<instance>`), one
idempotency key per outage and event. Delivery failures that may pass (timeouts, 5xx) are
tried again every round while they still matter; a permanent one is logged once.
`trainguard_controller_store_up` is 1 while the store answers, 0 while it does not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Gauge

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.controller.actions.base import PermanentError, TransientError
from trainguard.controller.actions.notify import Notification, Notifier
from trainguard.controller.store.lease import lease_connection

__all__ = ["PAGE_RULE", "StoreWatch", "postgres_probe", "store_page"]

log = logging.getLogger("trainguard.controller.storewatch")

PAGE_RULE = "controller_store_unreachable"
PROBE_INTERVAL_S = 1.0
# a probe that has not answered within this counts as a failure (a server that answers
# nothing at all: its statement_timeout cannot fire, and TCP may not give up for long)
PROBE_TIMEOUT_S = 5.0
# a resolve that cannot be delivered is given up after this many rounds (the page stays
# open at the receiver: a person closes it)
RESOLVE_TRIES = 30
PAGES_KEPT = 100

Probe = Callable[[], None]  # raises while the store cannot be reached


def postgres_probe(url: str, *, password: str | None, timeout_s: float) -> Probe:
    """`SELECT 1` on a connection of its own (made at the first probe, made again after it
    broke), giving up after `timeout_s`."""
    conn: Any = None

    def probe() -> None:
        nonlocal conn
        if conn is None:
            conn = lease_connection(url, password=password, timeout_s=timeout_s)
        conn.execute("SELECT 1")

    return probe


def store_page(
    *,
    event: Literal["trigger", "resolve"],
    instance: str,
    store: str,
    since: float,
    now: float,
    error: str,
) -> Notification:
    """The page about this controller's store (`store`: its URL, password elided)."""
    down_since = time.strftime("%H:%M:%S UTC", time.gmtime(since))
    if event == "trigger":
        summary = (
            f"controller {instance} cannot reach its store {store} since {down_since} "
            f"({error}): it opens no incident and runs no drain, restart or notification "
            "until the store is back"
        )
    else:
        summary = f"controller {instance} reaches its store {store} again (down since {down_since})"
    return Notification(
        event=event,
        incident_id=0,
        rule=PAGE_RULE,
        target=f"controller:{instance}",
        target_text=f"controller {instance}",
        severity="critical",
        state="open" if event == "trigger" else "resolved",
        summary=summary,
        opened_at=since,
        sent_at=now,
        idempotency_key=f"store-{instance}-{int(since * 1000)}-{event}",
        page=True,
        reason="store unreachable",
        dedup=f"trainguard-store-{instance}",
    )


class StoreWatch:
    """The probe thread, the `store_up` gauge and the page. `probe` raises while the store
    cannot be reached (tests pass their own; main.py a `SELECT 1` on its own connection)."""

    def __init__(
        self,
        *,
        probe: Probe,
        notifiers: list[Notifier],
        instance: str,
        store: str,
        page_after_s: float,
        registry: CollectorRegistry | None = None,
        clock: Clock = SYSTEM_CLOCK,
        interval_s: float = PROBE_INTERVAL_S,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self._probe = probe
        self._probe_timeout_s = probe_timeout_s
        self._hung: threading.Thread | None = None  # a probe that has not answered yet
        self._hung_since = 0.0
        self._notifiers = list(notifiers)
        self.instance = instance
        self.store = store
        self._page_after_s = page_after_s
        self._clock = clock
        self._interval_s = interval_s
        self.up = True
        self.down_since: float | None = None
        self._error = ""
        self._to_trigger: list[Notifier] = []  # channels the page is still owed to
        self._triggered: list[Notifier] = []  # channels that have the page
        self._to_resolve: list[Notifier] = []
        self._resolve_tries = 0
        self._paged_since: float | None = None
        # delivered, in order, the last PAGES_KEPT (tests, status)
        self.pages_sent: list[Notification] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._gauge = Gauge(
            "trainguard_controller_store_up",
            "1 while this controller's store (PostgreSQL) answers, 0 while it cannot be "
            "reached (the controller then acts on nothing).",
            registry=registry,
        )
        self._gauge.set(1)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._loop, name="trainguard-storewatch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            started = self._clock.monotonic()
            try:
                self.round()
            except Exception:  # never let the watch die: it is what tells a person
                log.exception("event=storewatch_error")
            self._stop.wait(max(0.0, self._interval_s - (self._clock.monotonic() - started)))

    # --- one round ----------------------------------------------------------------------------

    def round(self) -> None:
        """Probe once, note the change, deliver what is owed."""
        now = self._clock.now()
        error = self._run_probe()
        if error is not None:
            self._down(now, error)
        else:
            self._back(now)
        self._deliver(now)

    def _run_probe(self) -> str | None:
        """The probe's error (one line), or None when the store answered. The probe runs on
        a thread of its own and is given `probe_timeout_s`; one that hangs is not started
        again until it returns."""
        hung = self._hung
        if hung is not None:
            if hung.is_alive():
                waited_s = self._clock.monotonic() - self._hung_since
                return f"the store has not answered a probe for {waited_s:.0f} s"
            self._hung = None
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                self._probe()
            except Exception as e:
                outcome.append(e)
            else:
                outcome.append(None)

        thread = threading.Thread(target=run, name="trainguard-storeprobe", daemon=True)
        thread.start()
        thread.join(self._probe_timeout_s)
        if thread.is_alive():
            self._hung, self._hung_since = thread, self._clock.monotonic()
            return f"no answer to a probe within {self._probe_timeout_s:g} s"
        error = outcome[0] if outcome else None
        if error is None:
            return None
        return " ".join(f"{type(error).__name__}: {error}".split())[:300]

    def _down(self, now: float, error: str) -> None:
        self._error = error
        if not self.up:
            if (
                self._paged_since != self.down_since
                and self.down_since is not None
                and now - self.down_since >= self._page_after_s
            ):
                self._paged_since = self.down_since
                self._to_trigger = list(self._notifiers)
                self._triggered = []
                self._to_resolve = []
                if not self._notifiers:
                    log.error(
                        "event=store_page_not_sent reason=no_notify_channel store=%s", self.store
                    )
            return
        self.up = False
        self.down_since = now
        self._gauge.set(0)
        log.error(
            "event=store_unreachable store=%s error=%s detail=this controller acts on nothing "
            "until the store is back; reads are answered from memory",
            self.store,
            error.replace(" ", "_"),
        )
        if self._page_after_s <= 0:
            self._down(now, error)

    def _back(self, now: float) -> None:
        if self.up:
            return
        since = self.down_since or now
        self.up = True
        self._gauge.set(1)
        log.warning("event=store_back store=%s down_s=%.1f", self.store, now - since)
        if self._paged_since == since:
            # the page went (or was owed) somewhere: resolve it where it went
            self._to_resolve = list(self._triggered)
            self._resolve_tries = 0
        self._to_trigger = []

    def _page(
        self, event: Literal["trigger", "resolve"], *, since: float, now: float
    ) -> Notification:
        error = self._error if event == "trigger" else ""
        return store_page(
            event=event, instance=self.instance, store=self.store, since=since, now=now, error=error
        )

    def _deliver(self, now: float) -> None:
        if self._to_trigger and not self.up and self.down_since is not None:
            page = self._page("trigger", since=self.down_since, now=now)
            self._to_trigger = self._send(page, self._to_trigger, delivered=self._triggered)
        if self._to_resolve and self.up and self._paged_since is not None:
            self._resolve_tries += 1
            page = self._page("resolve", since=self._paged_since, now=now)
            self._to_resolve = self._send(page, self._to_resolve, delivered=[])
            if self._to_resolve and self._resolve_tries >= RESOLVE_TRIES:
                log.error(
                    "event=store_page_resolve_given_up channels=%s",
                    ",".join(n.channel for n in self._to_resolve),
                )
                self._to_resolve = []

    def _send(
        self, page: Notification, channels: list[Notifier], *, delivered: list[Notifier]
    ) -> list[Notifier]:
        """Send `page` to each of `channels`; the ones to try again next round (those whose
        failure may pass). One channel's failure, whatever it is, never keeps the page from
        the others."""
        again: list[Notifier] = []
        for notifier in channels:
            try:
                notifier.send(page)
            except Exception as e:
                retry = isinstance(e, TransientError)
                # the delivery errors' own text is safe to log; anything else: its type only
                said = str(e) if isinstance(e, (TransientError, PermanentError)) else ""
                log.log(
                    logging.WARNING if retry else logging.ERROR,
                    "event=store_page_failed channel=%s kind=%s error=%s retry=%s",
                    notifier.channel,
                    page.event,
                    (said or type(e).__name__).replace(" ", "_"),
                    "true" if retry else "false",
                )
                if retry:
                    again.append(notifier)
                continue
            delivered.append(notifier)
            self.pages_sent.append(page)
            del self.pages_sent[:-PAGES_KEPT]
            log.warning(
                "event=store_page_sent channel=%s kind=%s instance=%s",
                notifier.channel,
                page.event,
                self.instance,
            )
        return again

    def status(self) -> dict[str, Any]:
        return {"up": self.up, "down_since": self.down_since, "error": self._error}
