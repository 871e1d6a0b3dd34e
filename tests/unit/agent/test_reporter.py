"""Reporter and EventSpool against the fake controller on loopback, which can go away."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.controller_service import AGENT_TOKEN, FakeController
from tests.helpers import wait_for
from trainguard.agent.reporter import (
    EventSpool,
    Reporter,
    TokenError,
    backoff_delay_s,
    read_token,
)
from trainguard.agent.sim import SimHardware
from trainguard.clock import FakeClock, SystemClock
from trainguard.protocol import (
    Command,
    Event,
    FaultSpec,
    RankState,
    Report,
    encode_json,
)

TOKEN = AGENT_TOKEN


def make_reporter(url: str, spool: EventSpool, **kw: Any) -> Reporter:
    def build(seq: int, events: tuple[Event, ...]) -> Report:
        return Report(node="node-1", instance="inst-1", seq=seq, sent_at=1.0, events=events)

    kw.setdefault("timeout_s", 2.0)
    return Reporter(
        urls=[url], token=TOKEN, spool=spool, build_report=build, clock=FakeClock(),
        rng=random.Random(1), **kw,
    )  # fmt: skip


def add(spool: EventSpool, n: int) -> None:
    for i in range(n):
        spool.add(kind="xid", ts=float(i), gpu=0, code=79)


def test_report_carries_bearer_token_and_acked_events_leave_the_spool(
    fake_controller: FakeController,
) -> None:
    spool = EventSpool(max_events=100)
    add(spool, 3)
    rep = make_reporter(fake_controller.url, spool)
    out = rep.report_once()
    assert out.result == "ok" and out.acked == 3 and out.retry_in_s == 1.0
    assert len(spool) == 0
    assert [r.authorization for r in fake_controller.requests] == [f"Bearer {TOKEN}"]
    assert [e.id for e in fake_controller.reports[0].events] == [1, 2, 3]
    rep.close()


def test_outage_loses_nothing_and_receiver_sees_each_event_once_after_dedupe(
    fake_controller: FakeController,
) -> None:
    spool = EventSpool(max_events=1000)
    rep = make_reporter(fake_controller.url, spool, max_events_per_report=4)
    add(spool, 5)
    assert rep.report_once().result == "ok"
    fake_controller.stop()
    delays = []
    for _ in range(4):  # controller down: events pile up, back-off grows
        add(spool, 3)
        out = rep.report_once()
        assert out.result == "error"
        delays.append(out.retry_in_s)
    assert delays[-1] > delays[0]
    assert len(spool) == 13
    fake_controller.start()
    for _ in range(10):
        if len(spool) == 0:
            break
        assert rep.report_once().result == "ok"
    assert len(spool) == 0
    ids = sorted(i for _, i in fake_controller.events)
    assert ids == list(range(1, 18))  # nothing lost, ids strictly increasing
    assert rep.results_total["error"] == 4
    rep.close()


@pytest.mark.parametrize(
    ("status", "result"),
    [(401, "rejected"), (400, "rejected"), (429, "error"), (503, "error")],
    ids=["unauthorized", "bad-request", "too-many-requests", "unavailable"],
)
def test_error_statuses_keep_events_and_back_off(
    fake_controller: FakeController, status: int, result: str
) -> None:
    fake_controller.forced_status = status
    spool = EventSpool(max_events=10)
    add(spool, 2)
    rep = make_reporter(fake_controller.url, spool, interval_s=1.0, backoff_max_s=30.0)
    first = rep.report_once()
    second = rep.report_once()
    assert (first.result, first.status) == (result, status)
    assert second.retry_in_s > 0.5  # never a hot loop, even for permanent errors
    assert len(spool) == 2
    rep.close()


def test_rejected_report_is_logged_without_the_token(
    fake_controller: FakeController, caplog: pytest.LogCaptureFixture
) -> None:
    fake_controller.forced_status = 401
    rep = make_reporter(fake_controller.url, EventSpool(max_events=10))
    with caplog.at_level(logging.DEBUG):
        rep.report_once()
    assert "event=report_rejected" in caplog.text and "status=401" in caplog.text
    assert TOKEN not in caplog.text
    rep.close()


def test_payload_too_large_halves_events_per_report(fake_controller: FakeController) -> None:
    spool = EventSpool(max_events=100)
    add(spool, 20)
    rep = make_reporter(fake_controller.url, spool, max_events_per_report=8)
    fake_controller.forced_status = 413
    rep.report_once()
    fake_controller.forced_status = None
    rep.report_once()
    assert len(fake_controller.reports[0].events) == 4
    rep.close()


def test_commands_are_handed_on_once_each(fake_controller: FakeController) -> None:
    # the controller hands a command out on every report until its result arrives
    fake_controller.queue_command("node-1", Command(id="c1", kind="checkpoint", args={"job": "j"}))
    rep = make_reporter(fake_controller.url, EventSpool(max_events=10))
    first = rep.report_once()
    fake_controller.queue_command(
        "node-1", Command(id="c2", kind="inject_fault", args={"kind": "dbe"})
    )
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


def _plain_wire(value: Any) -> Any:
    # the wire's rules written the slow, obvious way: None fields dropped, non-finite as strings
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: _plain_wire(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if getattr(value, f.name) is not None
        }
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): _plain_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain_wire(v) for v in value]
    return value


def test_the_wire_encoder_writes_a_report_as_the_plain_rules_say() -> None:
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
    plain = json.dumps(_plain_wire(report), separators=(",", ":"), allow_nan=False).encode()
    assert encode_json(report) == plain


def test_job_attempts_in_the_answer_reach_the_callback_before_its_commands(
    fake_controller: FakeController,
) -> None:
    fake_controller.service.job_attempts["node-1"] = {"llm": 4}
    fake_controller.queue_command("node-1", Command(id="c1", kind="checkpoint", args={}))
    rep = make_reporter(fake_controller.url, EventSpool(max_events=10))
    seen: list[tuple[str, object]] = []
    stop = threading.Event()

    def on_commands(commands: tuple[Command, ...]) -> None:
        seen.append(("commands", [c.id for c in commands]))
        stop.set()

    def on_job_attempts(attempts: dict[str, int]) -> None:
        seen.append(("attempts", attempts))

    rep.run(stop, on_commands, on_job_attempts)
    assert seen == [("attempts", {"llm": 4}), ("commands", ["c1"])]
    fake_controller.service.job_attempts.clear()
    assert rep.report_once().job_attempts is None
    rep.close()


@contextlib.contextmanager
def _running(rep: Reporter) -> Iterator[None]:
    """`rep.run` on a thread for the block; stopped (a nudge ends its wait at once), joined and
    closed after it."""
    stop = threading.Event()
    t = threading.Thread(target=rep.run, args=(stop, lambda cmds: None), daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        rep.nudge()
        t.join(5.0)
        rep.close()
    assert not t.is_alive()


def _real_clock_reporter(url: str, spool: EventSpool, **kw: Any) -> Reporter:
    def build(seq: int, events: tuple[Event, ...]) -> Report:
        return Report(node="node-1", instance="inst-1", seq=seq, sent_at=1.0, events=events)

    return Reporter(
        urls=[url], token=TOKEN, spool=spool, build_report=build, clock=SystemClock(),
        rng=random.Random(1), timeout_s=2.0, **kw,
    )  # fmt: skip


def test_report_in_s_from_the_controller_brings_the_next_reports_forward(
    fake_controller: FakeController,
) -> None:
    """An interval of an hour: reports after the first come only because the answers ask
    for them (`report_in_s`); without it, one report in all."""
    spool = EventSpool(max_events=10)
    rep = _real_clock_reporter(fake_controller.url, spool, interval_s=3600.0, backoff_max_s=3600.0)
    assert rep.report_once().retry_in_s == 3600.0
    fake_controller.service.report_in_s["node-1"] = 0.01  # below the floor: kept 0.1 s apart
    assert rep.report_once().retry_in_s == pytest.approx(0.1)
    fake_controller.service.report_in_s["node-1"] = 7200.0  # never later than the interval
    assert rep.report_once().retry_in_s == 3600.0
    fake_controller.service.report_in_s["node-1"] = 0.2
    before = len(fake_controller.service.reports)
    with _running(rep):
        wait_for(
            lambda: len(fake_controller.service.reports) >= before + 4 or None,
            timeout_s=30.0,
            what="reports the controller asked for sooner than the interval",
        )


def test_a_spooled_event_is_reported_at_once_not_at_the_interval(
    fake_controller: FakeController,
) -> None:
    spool = EventSpool(max_events=10)
    rep = _real_clock_reporter(fake_controller.url, spool, interval_s=3600.0, backoff_max_s=3600.0)
    with _running(rep):
        wait_for(lambda: len(fake_controller.service.reports) == 1 or None, timeout_s=30.0,
                 what="the first report")  # fmt: skip
        spool.add(kind="xid", ts=1.0, gpu=0, code=48)
        rep.nudge()
        got = wait_for(
            lambda: [e for r in fake_controller.service.reports for e in r.events] or None,
            timeout_s=30.0,
            what="the XID reported long before the hour's interval",
        )
        assert [(e.kind, e.code) for e in got] == [("xid", 48)]
        wait_for(lambda: len(spool) == 0 or None, timeout_s=30.0, what="the XID acknowledged")


def test_a_nudge_does_not_cut_the_back_off_from_a_failing_controller(
    fake_controller: FakeController,
) -> None:
    spool = EventSpool(max_events=10)
    # the first report goes at once; its failure backs off ~30 s (the interval is the base)
    rep = _real_clock_reporter(fake_controller.url, spool, interval_s=30.0, backoff_max_s=3600.0)
    fake_controller.forced_status = 500
    with _running(rep):
        wait_for(lambda: fake_controller.statuses(500) >= 1 or None, timeout_s=30.0,
                 what="a failed report")  # fmt: skip
        failed = fake_controller.statuses(500)
        for _ in range(20):
            spool.add(kind="xid", ts=1.0, gpu=0, code=48)
            rep.nudge()
        # the loop saw the nudges (it took the event flag) and sent nothing more meanwhile
        wait_for(lambda: not rep._nudged.is_set() or None, timeout_s=30.0, what="nudges taken")
        assert fake_controller.statuses(500) == failed
