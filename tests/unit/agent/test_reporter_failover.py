"""The reporter with several controllers, each a real HTTP server on loopback (the fake
controller, which can answer as a standby does): it follows a standby's 503 to the leader
within its list, moves past dead URLs, never loops between standbys, never follows a leader
outside its list, and no event is acknowledged but by the controller that ingested it."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakes.controller_service import AGENT_TOKEN, FakeController
from tests.helpers import free_port
from trainguard.agent.metrics import AgentSnapshot, metric_families
from trainguard.agent.reporter import EventSpool, Reporter
from trainguard.clock import FakeClock
from trainguard.protocol import Event, Report


@pytest.fixture
def pair() -> Iterator[tuple[FakeController, FakeController]]:
    """(standby, leader): the standby names the leader in every write it refuses."""
    leader = FakeController()
    standby = FakeController()
    standby.standby_of = leader.url
    yield standby, leader
    standby.stop()
    leader.stop()


def make_reporter(urls: list[str], spool: EventSpool, **kw: Any) -> Reporter:
    def build(seq: int, events: tuple[Event, ...]) -> Report:
        return Report(node="node-1", instance="inst-1", seq=seq, sent_at=1.0, events=events)

    kw.setdefault("timeout_s", 2.0)
    return Reporter(
        urls=urls, token=AGENT_TOKEN, spool=spool, build_report=build, clock=FakeClock(),
        rng=random.Random(1), **kw,
    )  # fmt: skip


def add(spool: EventSpool, n: int) -> None:
    for i in range(n):
        spool.add(kind="xid", ts=float(i), gpu=0, code=79)


def posts(ctl: FakeController) -> list[int]:
    """The statuses of the reports `ctl` answered."""
    return [r.status for r in ctl.requests if r.method == "POST"]


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there now


def test_a_standby_s_503_moves_the_report_to_the_leader_at_once(
    pair: tuple[FakeController, FakeController], caplog: pytest.LogCaptureFixture
) -> None:
    standby, leader = pair
    spool = EventSpool(max_events=100)
    add(spool, 3)
    rep = make_reporter([standby.url, leader.url], spool)
    with caplog.at_level(logging.INFO, logger="trainguard.agent.reporter"):
        out = rep.report_once()
    assert (out.result, out.acked, out.retry_in_s) == ("ok", 3, 1.0)  # no back-off
    assert rep.current_url == leader.url
    assert posts(standby) == [503] and standby.reports == []  # refused, nothing ingested
    assert [e.id for e in leader.reports[0].events] == [1, 2, 3]
    assert rep.switches_total["leader_redirect"] == 1
    assert (
        f"event=controller_switched from={standby.url} to={leader.url} reason=leader_redirect"
        in caplog.text
    )
    # later reports go straight to the leader
    assert rep.report_once().result == "ok"
    assert posts(standby) == [503] and posts(leader) == [200, 200]
    rep.close()


def test_the_report_resent_to_another_controller_is_full(
    pair: tuple[FakeController, FakeController],
) -> None:
    standby, leader = pair
    rep = make_reporter([leader.url, standby.url], EventSpool(max_events=10))
    assert rep.report_once().result == "ok"
    assert rep.report_once().result == "ok"
    assert leader.reports[-1].full is False  # a delta against what the leader acknowledged
    # failover: the old leader becomes a standby naming the new one
    standby.standby_of = None
    leader.standby_of = standby.url
    assert rep.report_once().result == "ok"
    assert rep.current_url == standby.url
    # the delta base was the old leader's: the new one gets everything
    assert standby.reports[0].full is True and standby.reports[0].base_seq is None
    rep.close()


def test_an_unreachable_url_moves_the_report_to_the_next(
    pair: tuple[FakeController, FakeController],
) -> None:
    _, leader = pair
    dead = dead_url()
    spool = EventSpool(max_events=10)
    add(spool, 2)
    rep = make_reporter([dead, leader.url], spool)
    out = rep.report_once()
    assert (out.result, out.acked) == ("ok", 2)
    assert rep.current_url == leader.url
    assert rep.switches_total["unreachable"] == 1
    rep.close()


def test_a_dead_url_then_a_standby_still_reaches_the_leader(
    pair: tuple[FakeController, FakeController],
) -> None:
    standby, leader = pair
    rep = make_reporter([dead_url(), standby.url, leader.url], EventSpool(max_events=10))
    assert rep.report_once().result == "ok"
    assert rep.current_url == leader.url
    assert (rep.switches_total["unreachable"], rep.switches_total["leader_redirect"]) == (1, 1)
    rep.close()


def test_two_standbys_naming_each_other_cost_one_request_each_then_back_off() -> None:
    a, b = FakeController(), FakeController()
    a.standby_of, b.standby_of = b.url, a.url
    try:
        spool = EventSpool(max_events=10)
        add(spool, 2)
        rep = make_reporter([a.url, b.url], spool, interval_s=1.0, backoff_max_s=30.0)
        delays = []
        for round_ in range(1, 4):
            out = rep.report_once()
            assert (out.result, out.status) == ("error", 503)
            # each controller once per report: bounded, never a loop between the two
            assert len(posts(a)) + len(posts(b)) == 2 * round_
            delays.append(out.retry_in_s)
        assert all(d >= 1.0 for d in delays)  # at least the standbys' Retry-After
        assert delays[-1] > delays[0]  # and the usual growing back-off
        assert len(spool) == 2  # nothing acknowledged
        assert a.reports == [] and b.reports == []
        rep.close()
    finally:
        a.stop()
        b.stop()


def test_a_leader_outside_the_list_is_never_followed_and_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    outsider, standby = FakeController(), FakeController()
    standby.standby_of = outsider.url  # a live controller: following it would work
    try:
        spool = EventSpool(max_events=10)
        add(spool, 1)
        rep = make_reporter([standby.url], spool)
        with caplog.at_level(logging.WARNING, logger="trainguard.agent.reporter"):
            first = rep.report_once()
            second = rep.report_once()
        assert (first.result, second.result) == ("error", "error")
        assert outsider.requests == []
        assert len(spool) == 1
        assert rep.current_url == standby.url
        lines = [r.getMessage() for r in caplog.records if "leader_not_followed" in r.message]
        assert len(lines) == 1  # once per leader named, not once per report
        assert f"leader='{outsider.url}'" in lines[0]
        assert "reason=not_in_controller_urls" in lines[0]
        rep.close()
    finally:
        outsider.stop()
        standby.stop()


def test_a_leader_outside_the_list_does_not_stop_the_rest_of_the_list(
    pair: tuple[FakeController, FakeController],
) -> None:
    standby, leader = pair
    standby.standby_of = "http://elsewhere.invalid:8800"
    rep = make_reporter([standby.url, leader.url], EventSpool(max_events=10))
    assert rep.report_once().result == "ok"
    assert rep.current_url == leader.url
    assert rep.switches_total["leader_not_listed"] == 1
    rep.close()


def test_events_survive_a_failover_and_each_is_acked_once_by_a_leader(
    pair: tuple[FakeController, FakeController],
) -> None:
    standby, leader = pair
    spool = EventSpool(max_events=100)
    rep = make_reporter([leader.url, standby.url], spool, max_events_per_report=3)
    add(spool, 2)
    assert rep.report_once().acked == 2
    # an election: both refuse and name no leader, the events wait in the spool
    leader.standby_of = ""
    standby.standby_of = ""
    add(spool, 4)
    out = rep.report_once()
    assert (out.result, out.status, out.acked) == ("error", 503, 0)
    assert len(spool) == 4
    # the former standby wins; the old leader names it
    standby.standby_of = None
    leader.standby_of = standby.url
    while len(spool):
        assert rep.report_once().result == "ok"
    add(spool, 1)
    assert rep.report_once().acked == 1
    assert sorted(i for _, i in leader.events) == [1, 2]
    assert sorted(i for _, i in standby.events) == [3, 4, 5, 6, 7]
    assert not set(leader.events) & set(standby.events)
    rep.close()


def test_every_controller_down_backs_off_after_one_round_and_comes_back(
    pair: tuple[FakeController, FakeController],
) -> None:
    standby, leader = pair
    spool = EventSpool(max_events=10)
    add(spool, 1)
    rep = make_reporter([leader.url, standby.url], spool)
    leader.stop()
    standby.stop()
    first, second = rep.report_once(), rep.report_once()
    assert (first.result, first.status) == ("error", None)
    assert second.retry_in_s > first.retry_in_s * 0.5 > 0
    assert rep.switches_total["unreachable"] == 2  # one move per round of two
    leader.start()
    standby.start()
    assert rep.report_once().result == "ok"
    assert rep.current_url == leader.url
    rep.close()


def test_the_metrics_show_which_controller_is_current() -> None:
    snap = AgentSnapshot(
        node="n1",
        version="1",
        controller_urls=("http://a:1", "http://b:2"),
        controller_current="http://b:2",
        controller_switches_total={"leader_redirect": 2, "unreachable": 0},
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in metric_families(snap)
        for s in fam.samples
    }
    current = "trainguard_agent_controller_current"
    assert samples[(current, (("node", "n1"), ("url", "http://a:1")))] == 0.0
    assert samples[(current, (("node", "n1"), ("url", "http://b:2")))] == 1.0
    switches = "trainguard_agent_controller_switches_total"
    assert samples[(switches, (("node", "n1"), ("reason", "leader_redirect")))] == 2.0
