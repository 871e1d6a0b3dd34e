"""Bounded state per node: the budget of job names a node may introduce (controller.jobnames)
and their expiry, alone and in a controller core on the fake clock."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from tests.builders import Reporter
from trainguard.clock import FakeClock
from trainguard.controller.composition import Controller
from trainguard.controller.jobnames import REASON_NODE, REASON_TOTAL, JobNames
from trainguard.protocol import JobProcess, RankState, Report


def _names(known: set[str] | None = None, **kw: float) -> JobNames:
    known = known if known is not None else set()
    args = {"max_per_node": 2, "max_total": 3, "expire_after_s": 10.0, **kw}
    return JobNames(
        max_per_node=int(args["max_per_node"]),
        max_total=int(args["max_total"]),
        expire_after_s=args["expire_after_s"],
        is_known=known.__contains__,
    )


def test_a_node_holds_at_most_its_budget_of_unknown_names() -> None:
    names = _names()
    assert names.admit("n1", ["a", "b"], now=0.0).refused == {}
    assert names.admit("n1", ["a", "b", "c"], now=1.0).refused == {"c": REASON_NODE}
    assert names.held("n1") == 2


def test_names_the_job_table_holds_cost_nothing() -> None:
    names = _names(known={"real"})
    assert names.admit("n1", ["real", "a", "b"], now=0.0).refused == {}
    assert names.held("n1") == 2


def test_the_total_budget_bounds_all_nodes_together() -> None:
    names = _names()
    names.admit("n1", ["a", "b"], now=0.0)
    assert names.admit("n2", ["c", "d"], now=0.0).refused == {"d": REASON_TOTAL}
    # a name another node already holds costs no total place
    assert names.admit("n3", ["a"], now=0.0).refused == {}
    assert names.total() == 3


def test_names_not_reported_for_the_expiry_time_are_forgotten() -> None:
    names = _names(max_per_node=5, max_total=10)
    names.admit("n1", ["a", "b"], now=0.0)
    names.admit("n2", ["b"], now=0.0)
    names.admit("n1", ["a"], now=5.0)  # a stays reported
    assert names.expire(now=9.0) == []
    assert names.expire(now=10.0) == ["b"]  # n1's and n2's places both lapsed
    assert names.held("n1") == 1 and names.held("n2") == 0
    assert names.expire(now=15.0) == ["a"]
    assert names.total() == 0
    # the freed places take new names again
    assert names.admit("n1", ["x", "y"], now=16.0).refused == {}


def test_an_expired_name_the_job_table_now_holds_is_not_forgotten() -> None:
    known: set[str] = set()
    names = _names(known=known)
    names.admit("n1", ["a"], now=0.0)
    known.add("a")
    assert names.expire(now=20.0) == []
    assert names.total() == 0


def test_a_removed_node_frees_its_places() -> None:
    names = _names()
    names.admit("n1", ["a", "b"], now=0.0)
    names.forget_node("n1")
    assert names.total() == 0 and names.held("n1") == 0
    assert names.expire(now=100.0) == []


# --- in the controller core -----------------------------------------------------------------


def _flood(reporter: Reporter, *, now: float, start: int, count: int = 1024) -> Report:
    base = reporter.report(now=now)
    ranks = tuple(RankState(job=f"flood-{start + i}", rank=0, step=1) for i in range(count))
    jobs = tuple(
        JobProcess(job=f"flood-{start + i}", attempt=1, state="running", pid=100 + i)
        for i in range(min(count, 256))
    )
    return dataclasses.replace(base, ranks=ranks, jobs=jobs)


@pytest.fixture
def core(make_core: Callable[..., Controller]) -> Controller:
    return make_core(
        api={"max_unknown_jobs_per_node": 8, "max_unknown_jobs": 100, "unknown_job_expire_s": 60}
    )


def test_a_flood_of_job_names_from_one_node_stays_bounded_and_expires(
    core: Controller, core_clock: FakeClock
) -> None:
    flooder, other = Reporter("node-1"), Reporter("node-2")
    steady = dataclasses.replace(
        other.report(now=core_clock.now()),
        ranks=(RankState(job="outside", rank=0, step=5),),
    )
    core.ingest_report(steady, actor="agent-node-2")
    for i in range(20):
        core_clock.advance(1.0)
        core.ingest_report(
            _flood(flooder, now=core_clock.now(), start=i * 1024), actor="agent-node-1"
        )
        reply = core.ingest_report(
            dataclasses.replace(steady, seq=steady.seq + i + 1, sent_at=core_clock.now()),
            actor="agent-node-2",
        )
        assert reply.ack_event_id == 0
    # what every report and every tick walks holds the node's budget, not the flood
    assert len(core.live.jobs_seen) <= 9
    assert len(core.jobs._live) <= 9
    assert len(core.signals.jobs()) <= 9
    names = [j.name for j in core.list_jobs()]
    assert len(names) <= 9 and "outside" in names
    refused = core.metrics.job_names_refused_total.labels(reason=REASON_NODE)._value.get()
    assert refused == 20 * 1024 - 8
    audited = [a for a in core.audit_log(limit=100) if a.action == "job_names_refused"]
    assert len(audited) == 1 and audited[0].target == "node-1"
    assert core.get_node("node-2").reporting

    # the flood stops; node-2 goes on reporting its job: the flood's names expire
    for i in range(7):
        core_clock.advance(10.0)
        core.ingest_report(
            dataclasses.replace(steady, seq=steady.seq + 100 + i, sent_at=core_clock.now()),
            actor="agent-node-2",
        )
        core.tick()
    assert [j.name for j in core.list_jobs()] == ["outside"]
    assert set(core.signals.jobs()) == {"outside"}
    assert set(core.jobs._live) <= {"outside"}
    # the node's places are free again
    core.ingest_report(_flood(flooder, now=core_clock.now(), start=0, count=3), actor="n1")
    assert len(core.list_jobs()) == 4


def test_a_zero_budget_refuses_every_unknown_name(
    make_core: Callable[..., Controller], core_clock: FakeClock
) -> None:
    core = make_core(api={"max_unknown_jobs_per_node": 0})
    rec = core.reports.job_names
    assert rec.max_per_node == 0
    reporter = Reporter("node-1")
    core.ingest_report(_flood(reporter, now=core_clock.now(), start=0, count=4), actor="a")
    assert core.list_jobs() == []


def test_a_jobs_ranks_are_what_each_nodes_last_report_had(
    core: Controller, core_clock: FakeClock
) -> None:
    reporter = Reporter("node-1")
    for first in (0, 1000, 2000):  # a node renumbering its ranks on every report
        base = reporter.report(now=core_clock.now())
        ranks = tuple(RankState(job="outside", rank=first + i, step=first) for i in range(8))
        core.ingest_report(dataclasses.replace(base, ranks=ranks), actor="a")
    view = core.get_job("outside")
    assert (view.ranks, view.last_step) == (8, 2000)
    # a report without the job keeps its last ranks (the job's last known state)
    core.ingest_report(reporter.report(now=core_clock.now()), actor="a")
    assert core.get_job("outside").ranks == 8
