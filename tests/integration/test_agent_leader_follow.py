"""A real agent process given several controllers (the fake controller; one answers as a
standby does): it reports to the leader the standby names, follows a failover, loses no
event across it, and never follows a leader outside its list."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.controller_service import FakeController
from tests.helpers import wait_for
from tests.integration.agent_proc import AgentProcess, sample_value

pytestmark = pytest.mark.slow


@pytest.fixture
def pair() -> Iterator[tuple[FakeController, FakeController]]:
    """(standby, leader): the standby names the leader in every write it refuses."""
    leader = FakeController()
    standby = FakeController()
    standby.standby_of = leader.url
    yield standby, leader
    standby.stop()
    leader.stop()


def start_agent(workdir: Path, urls: list[str], token: str) -> AgentProcess:
    token_file = workdir / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    return AgentProcess(
        workdir, "--controller", ",".join(urls), "--token-file", str(token_file),
        "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
    )  # fmt: skip


def current(agent: AgentProcess, url: str) -> float | None:
    return sample_value(agent.metrics(), "trainguard_agent_controller_current", url=url)


def test_the_agent_reports_to_the_leader_a_standby_names_and_follows_a_failover(
    short_tmp: Path, pair: tuple[FakeController, FakeController]
) -> None:
    standby, leader = pair
    agent = start_agent(short_tmp, [standby.url, leader.url], leader.agent_token)
    try:
        wait_for(lambda: leader.reports, timeout_s=30, what="a first report at the leader")
        assert standby.reports == []  # refused, nothing ingested
        assert standby.statuses(503) >= 1
        log = agent.log()
        assert (
            f"event=controller_switched from={standby.url} to={leader.url} "
            "reason=leader_redirect" in log
        )
        # the metrics are a snapshot the agent refreshes on its loop: wait for the next one
        wait_for(
            lambda: (current(agent, leader.url), current(agent, standby.url)) == (1.0, 0.0),
            timeout_s=30,
            what="the metric to name the leader",
        )
        refused = standby.statuses(503)
        assert agent.inject("xid", "--gpu", "0", "--code", "31").returncode == 0
        wait_for(lambda: leader.events_of("xid"), timeout_s=30, what="the XID at the leader")
        assert standby.statuses(503) == refused  # it stays with the leader

        # failover: the standby takes over, the old leader refuses and names it
        standby.standby_of = None
        leader.standby_of = standby.url
        assert agent.inject("xid", "--gpu", "1", "--code", "74").returncode == 0
        wait_for(lambda: standby.events_of("xid"), timeout_s=30, what="the XID at the new leader")
        wait_for(
            lambda: current(agent, standby.url) == 1.0,
            timeout_s=30,
            what="the metric to name the new leader",
        )
        assert current(agent, leader.url) == 0.0
        switches = sample_value(
            agent.metrics(), "trainguard_agent_controller_switches_total", reason="leader_redirect"
        )
        assert switches == 2.0
        instance = leader.reports[0].instance
        ids = sorted(i for inst, i in [*leader.events, *standby.events] if inst == instance)
        assert ids == list(range(1, len(ids) + 1))  # nothing lost across the switch
        assert not set(leader.events) & set(standby.events)  # each acknowledged once
        xids = sorted(
            (e.gpu, e.code) for e in [*leader.events_of("xid"), *standby.events_of("xid")]
        )
        assert xids == [(0, 31), (1, 74)]
    finally:
        assert agent.terminate() == 0


def test_a_leader_outside_the_list_is_not_followed(
    short_tmp: Path, pair: tuple[FakeController, FakeController]
) -> None:
    standby, outsider = pair  # the standby names a live controller the agent was not given
    agent = start_agent(short_tmp, [standby.url], outsider.agent_token)
    try:
        wait_for(
            lambda: "event=leader_not_followed" in agent.log(),
            timeout_s=30,
            what="the agent to log the leader it does not follow",
        )
        wait_for(
            lambda: (
                (
                    sample_value(agent.metrics(), "trainguard_agent_reports_total", result="error")
                    or 0
                )
                >= 2
            ),
            timeout_s=30,
            what="failed reports",
        )
        assert outsider.requests == []
        assert f"leader='{outsider.url}' reason=not_in_controller_urls" in agent.log()
        wait_for(
            lambda: current(agent, standby.url) == 1.0,
            timeout_s=30,
            what="the metric to name the standby it stayed with",
        )
    finally:
        assert agent.terminate() == 0
