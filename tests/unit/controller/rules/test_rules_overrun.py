"""Rule evaluation measured against its budget, on a fake timer: a rule past its budget is
cut (its targets keep their state), rules past the tick's budget wait, a rule that overruns
`overrun_ticks` in a row is disabled and opens one controller-level incident that notifies,
and a reload enables it again and resolves that incident."""

from __future__ import annotations

from typing import Any

from tests.unit.controller.rules.scenario import Cluster, make_node
from trainguard.controller.model import Decision
from trainguard.controller.rules.engine import EvalTiming, evaluate
from trainguard.controller.rules.overrun import (
    CONTROLLER_TARGET,
    OverrunGuard,
    disabled_decision,
)

RULES = """
rules:
  - name: hot
    scope: gpu
    condition: temperature_celsius > 80
    severity: critical
    actions: [notify]
    summary: GPU hot
  - name: slow_rank
    scope: node
    condition: report_age_s > 100
    severity: info
    summary: silent
"""


class StepTimer:
    """A fake monotonic timer: each read advances it by `step_s` (each read is one node's
    targets about to be tested, or the start or end of a rule)."""

    def __init__(self, step_s: float) -> None:
        self.t = 0.0
        self.step_s = step_s

    def __call__(self) -> float:
        self.t += self.step_s
        return self.t


def _cluster() -> Cluster:
    c = Cluster(RULES)
    c.add(make_node("n1"))
    c.add(make_node("n2"))
    c.nodes["n1"].gpus[1]["temperature_celsius"] = 91.0
    c.run(2)
    return c


def _timed(c: Cluster, timing: EvalTiming) -> list[Decision]:
    c.clock.advance(1.0)
    now = c.clock.now()
    for node in c.nodes.values():
        rep, events = node.report(now)
        c.signals.ingest(rep, now=now, new_events=events)
    c.last, c.memory = evaluate(
        rules=c.rules, signals=c.signals, now=now, memory=c.memory, timing=timing
    )
    return c.last


def test_a_rule_within_budget_is_measured_and_decides_as_usual() -> None:
    c = _cluster()
    timing = EvalTiming(timer=StepTimer(0.001), rule_budget_s=1.0, tick_budget_s=3.0)
    _timed(c, timing)
    assert c.states("hot") == {"gpu:n1:1": "firing"}
    assert set(timing.spent_s) == {"hot", "slow_rank"}
    assert timing.cut == set() and timing.deferred == []


def test_a_rule_past_its_budget_is_cut_and_its_targets_keep_their_state() -> None:
    c = _cluster()
    assert c.states("hot") == {"gpu:n1:1": "firing"}
    c.nodes["n1"].gpus[1]["temperature_celsius"] = 60.0  # would resolve if evaluated
    c.nodes["n2"].gpus[0]["temperature_celsius"] = 95.0  # would fire if evaluated
    # 2 nodes: a read per node; the second node's read passes the 1.5 s budget
    timing = EvalTiming(timer=StepTimer(1.0), rule_budget_s=1.5, tick_budget_s=100.0)
    _timed(c, timing)
    assert timing.cut == {"hot"}
    assert timing.spent_s["hot"] >= 1.5
    assert c.states("hot") == {"gpu:n1:1": "firing"}  # no verdict: neither resolved nor new
    # evaluated again in budget, the engine's verdict stands
    _timed(c, EvalTiming(timer=StepTimer(0.001), rule_budget_s=1.0, tick_budget_s=3.0))
    assert c.states("hot") == {"gpu:n1:1": "resolved", "gpu:n2:0": "firing"}


def test_a_rule_that_matches_nothing_is_cut_too() -> None:
    c = _cluster()
    c.nodes["n1"].gpus[1]["temperature_celsius"] = 60.0
    c.run(1)
    timing = EvalTiming(timer=StepTimer(1.0), rule_budget_s=1.5, tick_budget_s=100.0)
    _timed(c, timing)
    assert "hot" in timing.cut


def test_a_skipped_rule_is_not_evaluated_and_keeps_its_state() -> None:
    c = _cluster()
    c.nodes["n2"].gpus[0]["temperature_celsius"] = 95.0
    timing = EvalTiming(
        timer=StepTimer(0.001), rule_budget_s=1.0, tick_budget_s=3.0, skip=frozenset({"hot"})
    )
    _timed(c, timing)
    assert "hot" not in timing.spent_s
    assert c.states("hot") == {"gpu:n1:1": "firing"}


def test_rules_after_the_tick_budget_wait_for_the_next_tick() -> None:
    c = _cluster()
    timing = EvalTiming(timer=StepTimer(1.0), rule_budget_s=10.0, tick_budget_s=2.0)
    _timed(c, timing)
    assert timing.deferred == ["slow_rank"]
    assert "slow_rank" not in timing.spent_s
    assert c.states("hot") == {"gpu:n1:1": "firing"}


def _cut(*names: str, spent_s: float = 0.9) -> EvalTiming:
    t = EvalTiming(timer=StepTimer(0.0), rule_budget_s=0.5, tick_budget_s=3.0)
    for name in ("hot", "slow_rank"):
        t.spent_s[name] = spent_s if name in names else 0.01
    t.cut.update(names)
    return t


def test_a_rule_overrunning_n_ticks_in_a_row_is_disabled_once() -> None:
    guard = OverrunGuard(overrun_ticks=3)
    assert guard.observe(_cut("hot"), now=1.0) == []
    assert guard.observe(_cut("hot"), now=2.0) == []
    (gone,) = guard.observe(_cut("hot"), now=3.0)
    assert (gone.rule, gone.at, gone.ticks, gone.budget_s) == ("hot", 3.0, 3, 0.5)
    assert guard.skip == frozenset({"hot"})
    assert guard.observe(_cut("hot"), now=4.0) == []  # already disabled


def test_a_tick_within_budget_starts_the_count_again() -> None:
    guard = OverrunGuard(overrun_ticks=2)
    guard.observe(_cut("hot"), now=1.0)
    guard.observe(_cut(), now=2.0)
    assert guard.observe(_cut("hot"), now=3.0) == []
    assert [d.rule for d in guard.observe(_cut("hot"), now=4.0)] == ["hot"]


def test_reset_enables_every_rule_and_names_those_it_enabled() -> None:
    guard = OverrunGuard(overrun_ticks=1)
    guard.observe(_cut("hot"), now=1.0)
    assert [d.rule for d in guard.reset()] == ["hot"]
    assert guard.skip == frozenset()
    assert guard.reset() == []


def test_the_disabled_rule_decision_is_about_the_controller_one_per_rule() -> None:
    guard = OverrunGuard(overrun_ticks=1)
    (gone,) = guard.observe(_cut("hot"), now=7.0)
    rules = Cluster(RULES).rules
    d = disabled_decision(gone, rule=rules.get("hot"))
    assert (d.rule, d.target, d.target.key, d.state) == (
        "hot",
        CONTROLLER_TARGET,
        "controller",
        "firing",
    )
    assert (d.severity, d.actions, d.since) == ("critical", ("notify",), 7.0)
    assert "rule hot disabled" in d.summary and "0.5 s budget" in d.summary
    info = disabled_decision(gone, rule=rules.get("slow_rank"))
    assert info.severity == "warning"  # at least a warning: detection is off
    assert disabled_decision(gone, rule=None, state="resolved").state == "resolved"


# --- in the controller's tick ----------------------------------------------------------------


def _gpu_report(c: Any, node: str, seq: int, temp: float) -> None:
    from trainguard.model import GpuSample  # noqa: PLC0415
    from trainguard.protocol import Report  # noqa: PLC0415

    gpu = GpuSample(
        index=0, uuid="GPU-0", pci_bus_id="0000:18:00.0", name="H100", temperature_celsius=temp
    )
    c.ingest_report(
        Report(node=node, instance="i1", seq=seq, sent_at=c.clock.now(), gpus=(gpu,)), actor="a"
    )


def test_the_tick_disables_an_overrunning_rule_opens_an_incident_and_reload_ends_it(
    make_core, core_clock, core_notifier
) -> None:
    # a budget no evaluation meets: every rule with a target overruns
    c = make_core(rule_budget={"eval_budget_s": 1e-9, "overrun_ticks": 2, "tick_budget_s": 1.0})
    _gpu_report(c, "n1", 1, 60.0)
    c.tick()
    assert c.list_incidents() == []
    core_clock.advance(1)
    _gpu_report(c, "n1", 2, 60.0)
    c.tick()
    incidents = c.list_incidents()
    disabled = {i.rule for i in incidents if i.target == "controller"}
    assert {"gpu_dbe", "gpu_hot"} <= disabled
    metrics = c.metrics.registry
    assert metrics.get_sample_value("trainguard_controller_rule_disabled", {"rule": "gpu_hot"}) == 1
    assert (
        metrics.get_sample_value("trainguard_controller_rule_overruns_total", {"rule": "gpu_hot"})
        == 2
    )
    c.run_actions()
    assert any("rule gpu_dbe disabled" in str(n) for n in core_notifier.sent)
    # still disabled on later ticks: one incident per rule, no more
    core_clock.advance(1)
    c.tick()
    again = [i for i in c.list_incidents() if i.target == "controller" and i.rule == "gpu_hot"]
    assert len(again) == 1
    # a reload enables it again and resolves its incident
    c.reload_rules(actor="op")
    assert metrics.get_sample_value("trainguard_controller_rule_disabled", {"rule": "gpu_hot"}) == 0
    hot = c.list_incidents()
    assert all(i.state == "resolved" for i in hot if i.target == "controller")
