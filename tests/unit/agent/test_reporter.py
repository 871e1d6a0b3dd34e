"""Reporter and EventSpool against a real HTTP server on loopback that can go away."""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.reporter import (
    EventSpool,
    Reporter,
    TokenError,
    backoff_delay_s,
    encode_report,
    read_token,
)
from trainguard.agent.sim import SimHardware
from trainguard.clock import FakeClock
from trainguard.protocol import Event, FaultSpec, RankState, Report, decode_json, encode_json

TOKEN = "s3cret-token-value"


class FakeController:
    """Stores events by (instance, id) like the real controller; answers ack + commands."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reports: list[Report] = []
        self.events: dict[tuple[str, int], Event] = {}
        self.deliveries = 0
        self.auth: list[str] = []
        self.status = 200
        self.commands: list[dict[str, Any]] = []
        self.httpd: ThreadingHTTPServer | None = None
        self.port = 0
        self.start()

    def start(self) -> None:
        ctl = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with ctl.lock:
                    ctl.auth.append(self.headers.get("Authorization", ""))
                    status = ctl.status
                    if status == 200:
                        report = decode_json(Report, body)
                        ctl.reports.append(report)
                        for ev in report.events:
                            ctl.deliveries += 1
                            ctl.events[(report.instance, ev.id)] = ev
                        ids = sorted(i for inst, i in ctl.events if inst == report.instance)
                        ack = 0
                        for i in ids:  # contiguous prefix stored
                            if i != ack + 1:
                                break
                            ack = i
                        out = json.dumps({"ack_event_id": ack, "commands": ctl.commands}).encode()
                    else:
                        out = json.dumps({"detail": f"status {status}"}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    def stop(self) -> None:
        assert self.httpd is not None
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def controller() -> Iterator[FakeController]:
    ctl = FakeController()
    yield ctl
    ctl.stop()


def make_reporter(url: str, spool: EventSpool, **kw: Any) -> Reporter:
    def build(seq: int, events: tuple[Event, ...]) -> Report:
        return Report(node="node-1", instance="inst-1", seq=seq, sent_at=1.0, events=events)

    kw.setdefault("timeout_s", 2.0)
    return Reporter(
        url=url, token=TOKEN, spool=spool, build_report=build, clock=FakeClock(),
        rng=random.Random(1), **kw,
    )  # fmt: skip


def add(spool: EventSpool, n: int) -> None:
    for i in range(n):
        spool.add(kind="xid", ts=float(i), gpu=0, code=79)


def test_report_carries_bearer_token_and_acked_events_leave_the_spool(
    controller: FakeController,
) -> None:
    spool = EventSpool(max_events=100)
    add(spool, 3)
    rep = make_reporter(controller.url, spool)
    out = rep.report_once()
    assert out.result == "ok" and out.acked == 3 and out.retry_in_s == 1.0
    assert len(spool) == 0
    assert controller.auth == [f"Bearer {TOKEN}"]
    assert [e.id for e in controller.reports[0].events] == [1, 2, 3]
    rep.close()


def test_outage_loses_nothing_and_receiver_sees_each_event_once_after_dedupe(
    controller: FakeController,
) -> None:
    spool = EventSpool(max_events=1000)
    rep = make_reporter(controller.url, spool, max_events_per_report=4)
    add(spool, 5)
    assert rep.report_once().result == "ok"
    controller.stop()
    delays = []
    for _ in range(4):  # controller down: events pile up, back-off grows
        add(spool, 3)
        out = rep.report_once()
        assert out.result == "error"
        delays.append(out.retry_in_s)
    assert delays[-1] > delays[0]
    assert len(spool) == 13
    controller.start()
    for _ in range(10):
        if len(spool) == 0:
            break
        assert rep.report_once().result == "ok"
    assert len(spool) == 0
    ids = sorted(i for _, i in controller.events)
    assert ids == list(range(1, 18))  # nothing lost, ids strictly increasing
    assert rep.results_total["error"] == 4
    rep.close()


@pytest.mark.parametrize(
    ("status", "result"),
    [(401, "rejected"), (400, "rejected"), (429, "error"), (503, "error")],
    ids=["unauthorized", "bad-request", "too-many-requests", "unavailable"],
)
def test_error_statuses_keep_events_and_back_off(
    controller: FakeController, status: int, result: str
) -> None:
    controller.status = status
    spool = EventSpool(max_events=10)
    add(spool, 2)
    rep = make_reporter(controller.url, spool, interval_s=1.0, backoff_max_s=30.0)
    first = rep.report_once()
    second = rep.report_once()
    assert (first.result, first.status) == (result, status)
    assert second.retry_in_s > 0.5  # never a hot loop, even for permanent errors
    assert len(spool) == 2
    rep.close()


def test_rejected_report_is_logged_without_the_token(
    controller: FakeController, caplog: pytest.LogCaptureFixture
) -> None:
    controller.status = 401
    rep = make_reporter(controller.url, EventSpool(max_events=10))
    with caplog.at_level(logging.DEBUG):
        rep.report_once()
    assert "event=report_rejected" in caplog.text and "status=401" in caplog.text
    assert TOKEN not in caplog.text
    rep.close()


def test_payload_too_large_halves_events_per_report(controller: FakeController) -> None:
    spool = EventSpool(max_events=100)
    add(spool, 20)
    rep = make_reporter(controller.url, spool, max_events_per_report=8)
    controller.status = 413
    rep.report_once()
    controller.status = 200
    rep.report_once()
    assert len(controller.reports[0].events) == 4
    rep.close()


def test_commands_are_handed_on_once_each(controller: FakeController) -> None:
    controller.commands = [{"id": "c1", "kind": "checkpoint", "args": {"job": "j"}}]
    rep = make_reporter(controller.url, EventSpool(max_events=10))
    first = rep.report_once()
    controller.commands.append({"id": "c2", "kind": "inject_fault", "args": {"kind": "dbe"}})
    second = rep.report_once()
    assert [c.id for c in first.commands] == ["c1"]
    assert [c.id for c in second.commands] == ["c2"]
    rep.close()


def test_spool_drops_oldest_when_full_and_counts() -> None:
    spool = EventSpool(max_events=3)
    add(spool, 5)
    assert [e.id for e in spool.pending(10)] == [3, 4, 5]
    assert spool.dropped_total == 2
    assert spool.ack(4) == 2
    assert [e.id for e in spool.pending(10)] == [5]


def test_backoff_grows_exponentially_to_the_cap_with_jitter() -> None:
    rng = random.Random(0)
    for failures, full in [(1, 1.0), (2, 2.0), (3, 4.0), (6, 30.0), (50, 30.0)]:
        d = backoff_delay_s(failures, base_s=1.0, cap_s=30.0, rng=rng)
        assert full * 0.5 <= d <= full


def test_token_file_readable_by_others_warns_without_the_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert read_token(f) == TOKEN
    assert "token_file_readable_by_others" in caplog.text and TOKEN not in caplog.text
    caplog.clear()
    f.chmod(0o600)
    read_token(f)
    assert caplog.text == ""


@pytest.mark.parametrize("content", [None, "  \n"], ids=["missing", "empty"])
def test_missing_or_empty_token_file_is_an_error_naming_the_file(
    tmp_path: Path, content: str | None
) -> None:
    f = tmp_path / "token"
    if content is not None:
        f.write_text(content)
    with pytest.raises(TokenError, match=str(f)):
        read_token(f)


def test_report_encoder_matches_the_protocol_encoder_exactly() -> None:
    clock = FakeClock()
    sim = SimHardware(gpus=2, ib_ports=2, node_name="n", seed=3, clock=clock)
    sim.inject(FaultSpec(kind="gpu_lost", gpu=1))
    spool = EventSpool(max_events=10)
    spool.add(kind="nan_loss", ts=1.0, job="j", rank=0, data={"loss": float("nan"), "x": [1, None]})
    report = Report(
        node="n", instance="i", seq=7, sent_at=2.5, labels={"rack": "r1"},
        gpus=sim.collect().gpus, ib_ports=sim.collect_ib(),
        ranks=(RankState(job="j", rank=0, step=1, loss=float("-inf"), ckpt_step=None),),
        events=spool.pending(10), health={"loop_age_s": 0.1},
    )  # fmt: skip
    assert encode_report(report) == encode_json(report)
