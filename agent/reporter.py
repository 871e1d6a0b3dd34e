"""Reporting to the controller: the bounded event spool and the POST /v1/reports loop.

Events get strictly increasing ids within this agent instance and stay in the spool until the
controller acknowledges them, so an outage loses nothing (short of the spool overflowing,
which drops the oldest and counts it). While the controller is down the reporter backs off
exponentially with jitter; commands from responses are handed on once each.

Delta reports: most hardware values do not change from one second to the next, so after a
full report the controller acknowledged, a report lists only the GPUs, NVLinks and IB ports
that changed since the last acknowledged one (`base_seq`), with a full snapshot every
`full_report_every` reports, whenever something disappeared, and whenever the controller
asks (`want_full`). Ranks, jobs, events and health always travel whole.

Several controllers (an HA leader and standbys): the reporter sends to its current one. A
standby's 503 naming the leader (`trainguard.leader`) moves it there at once and the same
report is resent, full; a connection error or timeout moves it to the next URL. Each URL is
tried at most once per report, so two standbys naming each other cost two requests, then the
usual back-off. A leader outside the configured list is never followed (logged instead).
Only a 200 acknowledges events, so a report a standby refused loses nothing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import ssl
import stat
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args

import httpx

from trainguard.clock import Clock
from trainguard.leader import LEADER_HEADER, follow, leader_named
from trainguard.model import GpuSample, IbPortSample
from trainguard.protocol import (
    Command,
    CommandKind,
    Event,
    EventKind,
    ProtocolError,
    Report,
    ReportResponse,
    encode_json,
    from_wire,
)

log = logging.getLogger("trainguard.agent.reporter")

ReportResult = Literal["ok", "error", "rejected"]
REPORT_RESULTS: tuple[ReportResult, ...] = ("ok", "error", "rejected")
SEEN_COMMANDS_MAX = 4096  # command ids remembered for dedupe (the controller resends a few)
FULL_REPORT_EVERY = 30  # a full snapshot at least this often (reports), deltas in between
# The least time between the starts of two reports when an event or the controller's
# `report_in_s` asks for one sooner than the interval: a node in an event storm reports at
# most 10 times a second, and a controller cannot ask for more.
MIN_REPORT_GAP_S = 0.1
# The longest single wait of the loop: a stop is seen within it even without a nudge.
_WAIT_SLICE_S = 0.5
# Why the reporter moved to another controller (a label of the agent's switch counter).
SwitchReason = Literal["leader_redirect", "unreachable", "unavailable", "leader_not_listed"]
SWITCH_REASONS: tuple[SwitchReason, ...] = get_args(SwitchReason)


class TokenError(ValueError):
    """The token file is missing, unreadable or empty (message names the file)."""


def read_token(path: str | Path) -> str:
    """Read the bearer token; warn (without the token) if others can read the file."""
    p = Path(path)
    try:
        st = p.stat()
        token = p.read_text(encoding="utf-8").strip()
    except OSError as e:
        raise TokenError(f"{p}: cannot read token file: {e.strerror or e}") from None
    if not token:
        raise TokenError(f"{p}: token file is empty")
    if st.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning(
            "event=token_file_readable_by_others path=%s mode=%s hint=chmod_600",
            p,
            oct(stat.S_IMODE(st.st_mode)),
        )
    return token


class EventSpool:
    """Unacknowledged events, oldest first, at most `max_events` (then the oldest go)."""

    def __init__(self, *, max_events: int) -> None:
        if max_events < 1:
            raise ValueError("max_events must be >= 1")
        self._lock = threading.Lock()
        self._events: deque[Event] = deque()
        self._max = max_events
        self._next_id = 1
        self.dropped_total = 0
        self.added_total = 0

    def add(
        self,
        *,
        kind: EventKind,
        ts: float,
        gpu: int | None = None,
        job: str | None = None,
        rank: int | None = None,
        code: int | None = None,
        message: str = "",
        data: dict[str, Any] | None = None,
    ) -> Event:
        with self._lock:
            event = Event(
                id=self._next_id,
                kind=kind,
                ts=ts,
                gpu=gpu,
                job=job,
                rank=rank,
                code=code,
                message=message[:512],
                data=data or {},
            )
            self._next_id += 1
            self._events.append(event)
            self.added_total += 1
            while len(self._events) > self._max:
                lost = self._events.popleft()
                self.dropped_total += 1
                if self.dropped_total == 1 or self.dropped_total % 1000 == 0:
                    # first drop and every 1000th: a long outage must not flood the journal
                    log.warning(
                        "event=spool_full dropped_event_id=%d kind=%s dropped_total=%d",
                        lost.id,
                        lost.kind,
                        self.dropped_total,
                    )
            return event

    def pending(self, limit: int) -> tuple[Event, ...]:
        with self._lock:
            return tuple(e for _, e in zip(range(limit), self._events, strict=False))

    def ack(self, event_id: int) -> int:
        """Drop every event with id <= `event_id`; returns how many were dropped."""
        n = 0
        with self._lock:
            while self._events and self._events[0].id <= event_id:
                self._events.popleft()
                n += 1
        return n

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)


def backoff_delay_s(failures: int, *, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Delay before the next try after `failures` consecutive failures (>= 1).

    Exponential from `base_s`, capped at `cap_s`, with jitter in [50 %, 100 %] so 2,000
    agents that lost the controller together do not come back in lockstep.
    """
    delay = min(cap_s, base_s * (2.0 ** max(0, failures - 1)))
    return delay * rng.uniform(0.5, 1.0)


@dataclass(frozen=True)
class ReportOutcome:
    result: ReportResult
    retry_in_s: float  # when the next report should go, from now
    status: int | None = None
    commands: tuple[Command, ...] = ()  # new ones only (already-seen ids removed)
    acked: int = 0  # events dropped from the spool
    # fencing: job -> its current attempt, for jobs of which this node runs an older one
    job_attempts: dict[str, int] | None = None


BuildReport = Callable[[int, tuple[Event, ...]], Report]


class DeltaEncoder:
    """Turns full reports into delta reports against the last one the controller acknowledged.

    `prepare` gets the full report about to be sent and returns what to send; `acknowledged`
    is told the outcome of the one sent. Only an acknowledged report (200 without
    `want_full`) becomes the base, so a lost request or response never loses a change: the
    next delta still lists everything changed since the base, and a controller that applied
    the lost report answers `want_full` to the mismatching `base_seq`.
    `full_every` <= 1 sends full reports only (still marked `full`, which new controllers
    accept and old ones refuse; `enabled=False` sends the original report unchanged).
    """

    def __init__(self, *, full_every: int = FULL_REPORT_EVERY, enabled: bool = True) -> None:
        self.full_every = full_every
        self.enabled = enabled
        self._base: Report | None = None  # last full snapshot the controller acknowledged
        self._gpus: dict[int, GpuSample] = {}
        self._ports: dict[tuple[str, int], IbPortSample] = {}
        self._since_full = 0  # acknowledged deltas since the base's last full report
        self._in_flight: Report | None = None  # full snapshot of the report being sent
        self._sent_full = False
        self.full_total = 0
        self.delta_total = 0

    def reset(self) -> None:
        """Forget the base: the next report is full."""
        self._base = None
        self._gpus = {}
        self._ports = {}

    def prepare(self, report: Report) -> Report:
        if not self.enabled:
            self._in_flight = None
            return report
        self._in_flight = report
        delta = None
        if self._base is not None and self._since_full + 1 < self.full_every:
            delta = self._delta(report)
        self._sent_full = delta is None
        if delta is None:
            self.full_total += 1
            return dataclasses.replace(report, full=True, base_seq=None)
        self.delta_total += 1
        return delta

    def acknowledged(self, ok: bool, *, want_full: bool = False) -> None:
        """The controller answered the prepared report (ok) or it may not have seen it."""
        sent, self._in_flight = self._in_flight, None
        if sent is None or not ok:
            return
        if want_full:
            log.info("event=full_report_wanted seq=%d", sent.seq)
            self.reset()
            return
        self._base = sent
        self._gpus = {g.index: g for g in sent.gpus}
        self._ports = {(p.device, p.port): p for p in sent.ib_ports}
        self._since_full = 0 if self._sent_full else self._since_full + 1

    def _delta(self, report: Report) -> Report | None:
        """The delta of `report` against the base, or None where only a full report will do
        (a GPU, NVLink or port appeared or disappeared)."""
        assert self._base is not None
        held_gpus, held_ports = self._gpus, self._ports
        if len(report.gpus) != len(held_gpus) or len(report.ib_ports) != len(held_ports):
            return None
        gpus: list[GpuSample] = []
        for g in report.gpus:
            old = held_gpus.get(g.index)
            if old is None:
                return None
            if g is old or g == old:
                continue
            links = g.nvlinks
            if links != old.nvlinks:
                if len(links) != len(old.nvlinks) or any(
                    a.link != b.link for a, b in zip(links, old.nvlinks, strict=True)
                ):
                    return None
                links = tuple(a for a, b in zip(links, old.nvlinks, strict=True) if a != b)
            else:
                links = ()
            gpus.append(dataclasses.replace(g, nvlinks=links))
        ports: list[IbPortSample] = []
        for p in report.ib_ports:
            old_port = held_ports.get((p.device, p.port))
            if old_port is None:
                return None
            if p is not old_port and p != old_port:
                ports.append(p)
        return dataclasses.replace(
            report, full=False, base_seq=self._base.seq, gpus=tuple(gpus), ib_ports=tuple(ports)
        )


class Reporter:
    """POSTs one Report per `interval_s` to `<controller>/v1/reports`, following the leader
    among `urls` (tried in order, the first is current at start); see `report_once`, `run`."""

    def __init__(
        self,
        *,
        urls: Sequence[str],
        token: str | None,
        spool: EventSpool,
        build_report: BuildReport,
        clock: Clock,
        interval_s: float = 1.0,
        timeout_s: float = 5.0,
        backoff_max_s: float = 30.0,
        max_events_per_report: int = 500,
        verify: bool | str | ssl.SSLContext = True,
        rng: random.Random | None = None,
        transport: httpx.BaseTransport | None = None,
        full_report_every: int = FULL_REPORT_EVERY,
    ) -> None:
        if not urls:
            raise ValueError("urls must name at least one controller")
        self.urls: tuple[str, ...] = tuple(u.rstrip("/") for u in urls)
        self._current = 0
        self._spool = spool
        self._build = build_report
        self._clock = clock
        self._interval_s = interval_s
        self._backoff_max_s = backoff_max_s
        self._max_events = max_events_per_report
        self._rng = rng or random.Random()
        headers = {"Content-Type": "application/json"}
        if token is not None:  # else the client certificate names the node (mutual TLS)
            headers["Authorization"] = f"Bearer {token}"
        # one client for every controller: the same token or client certificate for each
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0)),
            verify=verify,
            transport=transport,
        )
        self._seq = 0
        self._failures = 0
        self.deltas = DeltaEncoder(full_every=full_report_every, enabled=full_report_every > 1)
        self._seen: OrderedDict[str, None] = OrderedDict()
        # whether the controller last said this node is a spare (None: not said yet)
        self.spare: bool | None = None
        self._down_logged = False
        self._unlisted_leader: str | None = None  # last leader outside `urls` that was logged
        self._stop: threading.Event | None = None  # set by run(): no new try once stopping
        self._nudged = threading.Event()  # nudge(): report soon
        self.results_total: dict[str, int] = dict.fromkeys(REPORT_RESULTS, 0)
        self.switches_total: dict[str, int] = dict.fromkeys(SWITCH_REASONS, 0)
        self.last_ok_mono: float | None = None

    @property
    def current_url(self) -> str:
        """The controller the next report goes to first."""
        return self.urls[self._current]

    @property
    def endpoint(self) -> str:
        return self.current_url + "/v1/reports"

    def close(self) -> None:
        self._client.close()

    def nudge(self) -> None:
        """Report soon (an event was spooled, or the agent stops): `run` sends the next
        report MIN_REPORT_GAP_S after the last one started at the latest instead of at the
        interval; no effect while backing off from a failing controller. Any thread."""
        self._nudged.set()

    def report_once(
        self, *, timeout_s: float | None = None, deadline_mono: float | None = None
    ) -> ReportOutcome:
        """Build and send one report now; handles ack, dedupe, back-off bookkeeping and the
        move to another controller (at most one request per URL).

        `timeout_s` bounds each request (default: the client's `timeout_s`); with
        `deadline_mono` (clock.monotonic()) no further controller is tried past it.
        """
        self._seq += 1
        events = self._spool.pending(self._max_events)
        full = self._build(self._seq, events)
        body = encode_json(self.deltas.prepare(full))
        tried: set[int] = set()
        while True:
            tried.add(self._current)
            try:
                resp = self._post(body, timeout_s=timeout_s, deadline_mono=deadline_mono)
            except httpx.HTTPError as e:
                self.deltas.acknowledged(False)
                reason = f"{type(e).__name__}: {e}"
                nxt = self._next_untried(tried, deadline_mono)
                if nxt is None:
                    return self._failed("error", None, reason)
                self._switch(nxt, reason="unreachable", detail=reason)
                body = self._resend_full(full)
                continue
            if resp.status_code == 503:
                self.deltas.acknowledged(False)
                nxt, why = self._after_refusal(resp, tried, deadline_mono)
                if nxt is None:
                    return self._failed(
                        "error", 503, _short_reason(resp), floor_s=_retry_after_s(resp)
                    )
                self._switch(nxt, reason=why, detail=_short_reason(resp))
                body = self._resend_full(full)
                continue
            return self._answered(resp)

    def _post(
        self, body: bytes, *, timeout_s: float | None, deadline_mono: float | None
    ) -> httpx.Response:
        if deadline_mono is not None:
            left_s = max(0.1, deadline_mono - self._clock.monotonic())
            timeout_s = left_s if timeout_s is None else min(timeout_s, left_s)
        if timeout_s is None:
            return self._client.post(self.endpoint, content=body)
        return self._client.post(self.endpoint, content=body, timeout=timeout_s)

    def _answered(self, resp: httpx.Response) -> ReportOutcome:
        """The outcome of a controller's answer other than a 503."""
        if resp.status_code == 200:
            try:
                answer = decode_response(resp.content)
            except (ValueError, ProtocolError) as e:
                self.deltas.acknowledged(False)
                return self._failed("error", 200, f"bad response body: {e}")
            self.deltas.acknowledged(True, want_full=bool(answer.want_full))
            return self._succeeded(answer)
        self.deltas.acknowledged(False)
        reason = _short_reason(resp)
        if resp.status_code == 422 and self.deltas.enabled and _refuses_deltas(resp):
            # a controller older than delta reports: full reports in the original shape
            self.deltas.enabled = False
            log.warning("event=delta_reports_off reason=%r", reason)
        if resp.status_code == 413 and self._max_events > 1:
            # the body was too large: carry fewer events per report from now on
            self._max_events = max(1, self._max_events // 2)
        if 400 <= resp.status_code < 500 and resp.status_code != 429:
            return self._failed("rejected", resp.status_code, reason)
        return self._failed("error", resp.status_code, reason)

    def _after_refusal(
        self, resp: httpx.Response, tried: set[int], deadline_mono: float | None
    ) -> tuple[int | None, SwitchReason]:
        """Where to resend after a 503: the leader it names if that is one of `urls` not
        tried yet for this report, else the next untried URL (None: every URL was tried)."""
        header = resp.headers.get(LEADER_HEADER)
        target = follow(header, self.urls)
        if target is not None:
            index = self.urls.index(target)
            if index not in tried and self._may_try(deadline_mono):
                return index, "leader_redirect"
            # the leader it names was tried for this report (two standbys naming each other,
            # or a leader that stepped down meanwhile): the rest of the list, then back-off
            return self._next_untried(tried, deadline_mono), "unavailable"
        leader = leader_named(header)
        if leader is None:
            return self._next_untried(tried, deadline_mono), "unavailable"
        if leader != self._unlisted_leader:  # once per name: back-off repeats it otherwise
            self._unlisted_leader = leader
            log.warning(
                "event=leader_not_followed url=%s leader=%r reason=not_in_controller_urls "
                "controller_urls=%s",
                self.current_url,
                leader[:200],
                ",".join(self.urls),
            )
        return self._next_untried(tried, deadline_mono), "leader_not_listed"

    def _may_try(self, deadline_mono: float | None) -> bool:
        if deadline_mono is not None:
            return self._clock.monotonic() < deadline_mono
        return self._stop is None or not self._stop.is_set()

    def _next_untried(self, tried: set[int], deadline_mono: float | None) -> int | None:
        """The next URL after the current one (wrapping) not tried for this report."""
        if not self._may_try(deadline_mono):
            return None
        n = len(self.urls)
        for step in range(1, n):
            index = (self._current + step) % n
            if index not in tried:
                return index
        return None

    def _switch(self, index: int, *, reason: SwitchReason, detail: str) -> None:
        before = self.current_url
        self._current = index
        self.switches_total[reason] += 1
        # while every controller fails, the rounds of the back-off would log each move
        level = logging.DEBUG if self._down_logged else logging.INFO
        log.log(
            level,
            "event=controller_switched from=%s to=%s reason=%s detail=%r",
            before,
            self.current_url,
            reason,
            detail[:200],
        )

    def _resend_full(self, full: Report) -> bytes:
        """The report again, for another controller: full, since the delta base is what the
        previous controller acknowledged, which the next may not hold."""
        self.deltas.reset()
        return encode_json(self.deltas.prepare(full))

    def _succeeded(self, answer: ReportResponse) -> ReportOutcome:
        self.results_total["ok"] += 1
        if answer.spare is not None:
            self.spare = answer.spare
        self.last_ok_mono = self._clock.monotonic()
        if self._down_logged:
            log.info(
                "event=controller_reachable url=%s after_failures=%d",
                self.current_url,
                self._failures,
            )
        self._down_logged = False
        self._failures = 0
        self._unlisted_leader = None
        acked = self._spool.ack(answer.ack_event_id)
        retry_in_s = self._interval_s
        if answer.report_in_s is not None:  # the controller is acting on this node
            retry_in_s = min(retry_in_s, max(MIN_REPORT_GAP_S, answer.report_in_s))
        fresh = []
        for cmd in answer.commands:
            if cmd.id in self._seen:
                continue
            self._seen[cmd.id] = None
            if len(self._seen) > SEEN_COMMANDS_MAX:
                self._seen.popitem(last=False)
            fresh.append(cmd)
        return ReportOutcome(
            result="ok",
            retry_in_s=retry_in_s,
            status=200,
            commands=tuple(fresh),
            acked=acked,
            job_attempts=dict(answer.job_attempts) if answer.job_attempts else None,
        )

    def _failed(
        self, result: ReportResult, status: int | None, reason: str, *, floor_s: float = 0.0
    ) -> ReportOutcome:
        """Count a failed report; `floor_s`: the least delay the controller asked for
        (Retry-After), kept within the back-off cap."""
        self.results_total[result] += 1
        self._failures += 1
        delay = backoff_delay_s(
            self._failures, base_s=self._interval_s, cap_s=self._backoff_max_s, rng=self._rng
        )
        delay = max(delay, min(floor_s, self._backoff_max_s))
        if result == "rejected":
            # permanent for this report: say so every time, the back-off keeps it rare
            log.error(
                "event=report_rejected url=%s status=%s reason=%r seq=%d retry_in_s=%.1f",
                self.endpoint,
                status,
                reason,
                self._seq,
                delay,
            )
        elif not self._down_logged:
            log.warning(
                "event=controller_unreachable url=%s status=%s reason=%r spool=%d controllers=%d",
                self.endpoint,
                status,
                reason,
                len(self._spool),
                len(self.urls),
            )
            self._down_logged = True
        else:
            log.debug(
                "event=report_failed status=%s reason=%r retry_in_s=%.1f", status, reason, delay
            )
        return ReportOutcome(result=result, retry_in_s=delay, status=status)

    def final_report(self, *, timeout_s: float) -> ReportOutcome:
        """One last report on shutdown, bounded by `timeout_s` (all controllers tried
        together), so the events of the stop itself (job exits, trainer exits, command
        results) reach the controller. Commands in its response are not run (the agent is
        going away) and are logged as such."""
        try:
            outcome = self.report_once(
                timeout_s=timeout_s, deadline_mono=self._clock.monotonic() + timeout_s
            )
        except Exception:  # shutting down: report the bug, never hang or raise here
            log.exception("event=final_report_error")
            return ReportOutcome(result="error", retry_in_s=0.0)
        for cmd in outcome.commands:
            log.warning(
                "event=command_not_run command_id=%s kind=%s reason=agent_stopping",
                cmd.id,
                cmd.kind,
            )
        log.info(
            "event=final_report result=%s status=%s acked=%d unsent_events=%d controller=%s",
            outcome.result,
            outcome.status,
            outcome.acked,
            len(self._spool),
            self.current_url,
        )
        return outcome

    def run(
        self,
        stop: threading.Event,
        on_commands: Callable[[tuple[Command, ...]], None],
        on_job_attempts: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        """Report until `stop` is set; new commands go to `on_commands`, the controller's
        `job_attempts` to `on_job_attempts` (neither may block)."""
        self._stop = stop
        next_mono = self._clock.monotonic()
        last_start: float | None = None
        backing_off = False
        while not stop.is_set():
            now = self._clock.monotonic()
            if self._nudged.is_set():
                self._nudged.clear()
                if not backing_off:  # a failing controller is not retried sooner
                    soon = now if last_start is None else max(now, last_start + MIN_REPORT_GAP_S)
                    next_mono = min(next_mono, soon)
            if now < next_mono:
                self._nudged.wait(min(next_mono - now, _WAIT_SLICE_S))
                continue
            started = now
            last_start = started
            try:
                outcome = self.report_once()
            except Exception:  # a bug here must not end reporting for good
                log.exception("event=reporter_error")
                outcome = ReportOutcome(result="error", retry_in_s=self._backoff_max_s)
            if outcome.job_attempts and on_job_attempts is not None:
                try:
                    on_job_attempts(outcome.job_attempts)
                except Exception:  # stopping a stale attempt must not end reporting
                    log.exception("event=job_attempts_error")
            if outcome.commands:
                on_commands(outcome.commands)
            backing_off = outcome.result != "ok"
            if outcome.result == "ok":
                # keep the cadence (from the previous start) unless we fell behind
                next_mono = max(next_mono + outcome.retry_in_s, started)
            else:
                next_mono = self._clock.monotonic() + outcome.retry_in_s


def _retry_after_s(resp: httpx.Response) -> float:
    """A Retry-After of whole seconds (the form the controller sends), else 0."""
    value = resp.headers.get("Retry-After", "").strip()
    if not value.isdigit():
        return 0.0
    return float(min(int(value), 3600))


_COMMAND_KINDS = frozenset(k.value for k in CommandKind)


def decode_response(raw: bytes) -> ReportResponse:
    """Strictly decode a ReportResponse, except that a command of a kind this agent does not
    know is kept (and answered "unknown command kind" by the executor) instead of failing
    the whole response: a newer controller must not stop an older agent's reporting."""
    data = json.loads(raw)
    unknown: dict[int, str] = {}
    if isinstance(data, dict) and isinstance(data.get("commands"), list):
        commands = list(data["commands"])
        for i, c in enumerate(commands):
            if isinstance(c, dict) and isinstance(c.get("kind"), str):
                if c["kind"] not in _COMMAND_KINDS:
                    unknown[i] = c["kind"]
                    commands[i] = {**c, "kind": CommandKind.CHECKPOINT.value}  # any known kind
        data = {**data, "commands": commands}
    answer = from_wire(ReportResponse, data)
    if not unknown:
        return answer
    fixed = tuple(
        dataclasses.replace(c, kind=cast(CommandKind, unknown[i])) if i in unknown else c
        for i, c in enumerate(answer.commands)
    )
    return dataclasses.replace(answer, commands=fixed)


def _refuses_deltas(resp: httpx.Response) -> bool:
    """A 422 naming one of the delta fields as unknown: the controller predates them."""
    try:
        detail = resp.json().get("detail")
    except (ValueError, AttributeError):
        return False
    return (
        isinstance(detail, dict)
        and detail.get("field") in ("full", "base_seq")
        and detail.get("reason") == "unknown key"
    )


def _short_reason(resp: httpx.Response) -> str:
    """A bounded, single-line reason from an error response (JSON `detail` if present)."""
    text = resp.text[:300]
    try:
        detail = json.loads(text).get("detail")
        if detail:
            text = str(detail)[:300]
    except (ValueError, AttributeError):
        pass
    return " ".join(text.split()) or resp.reason_phrase
