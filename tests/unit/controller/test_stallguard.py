"""The stall guard (controller.stallguard): silence means the node, not the controller. A
controller that did not tick for 150 s (paused, migrated) gives the nodes that were reporting
node_silent_after_s from its resumption before any node_silent opens; a node that stays
silent past that grace, or was silent before the stall, is still silent (FakeClock)."""

from __future__ import annotations

from tests.builders import Reporter
from trainguard.controller.stallguard import StallGuard


def test_a_gap_past_two_ticks_and_the_margin_is_a_stall() -> None:
    guard = StallGuard(tick_interval_s=1.0)
    assert guard.threshold_s == 3.0
    assert guard.beat(monotonic=10.0, now=100.0) is None  # the first tick ends no stall
    assert guard.beat(monotonic=11.0, now=101.0) is None
    assert guard.beat(monotonic=13.9, now=103.9) is None  # a slow tick is no stall
    stall = guard.beat(monotonic=163.9, now=253.9)
    assert stall is not None and stall.gap_s == 150.0 and stall.last_tick_at == 103.9
    assert guard.beat(monotonic=164.9, now=254.9) is None


def _silent_nodes(c) -> set[str]:
    return {i.node for i in c.list_incidents() if i.rule == "node_silent"}


def _run(c, clock, reporters, seconds: int) -> None:
    for _ in range(seconds):
        clock.advance(1.0)
        for r in reporters:
            c.ingest_report(r.report(now=clock.now()), actor="a")
        c.tick()


def test_after_a_controller_pause_only_a_node_that_stays_silent_past_the_grace_opens(
    make_core, core_clock
) -> None:
    c = make_core()
    n1, n2, n3, n4 = (Reporter(n) for n in ("n1", "n2", "n3", "n4"))
    _run(c, core_clock, [n1, n2, n3, n4], 3)
    _run(c, core_clock, [n1, n2, n3], 8)  # n4 dies while the controller runs
    assert _silent_nodes(c) == {"n4"}

    core_clock.advance(150.0)  # SIGSTOP ... SIGCONT: no tick, no report taken
    # a report queued during the pause is ingested before the first tick (the race)
    c.ingest_report(n1.report(now=core_clock.now()), actor="a")
    c.tick()
    assert _silent_nodes(c) == {"n4"}  # n4 still open: it was silent before the stall
    assert c.metrics.controller_stalls_total._value.get() == 1
    # the step side sees the same ages: n2 is no older than the time since resumption
    age = c.live.report_age_s("n2")
    assert age is not None and age < 1.0

    # n2 reports within the grace, n3 never again
    resumed_at = core_clock.now()
    for second in range(1, 5):
        core_clock.advance(1.0)
        c.ingest_report(n1.report(now=core_clock.now()), actor="a")
        if second == 2:
            c.ingest_report(n2.report(now=core_clock.now()), actor="a")
        c.tick()
        assert _silent_nodes(c) == {"n4"}, second
    _run(c, core_clock, [n1, n2], 3)
    assert _silent_nodes(c) == {"n3", "n4"}
    opened = next(i for i in c.list_incidents() if i.node == "n3").opened_at
    assert opened - resumed_at > 5.0  # node_silent_after_s after the resumption
    assert {n.name for n in c.list_nodes() if n.state != "active"} == set()
