"""The engine's tick: pending -> firing after `for:`, resolved exactly once, state held on
stale nodes, and no mutation of its inputs."""

from __future__ import annotations

from tests.unit.controller.rules.scenario import Cluster, make_node
from trainguard.controller.rules.engine import EngineMemory, evaluate
from trainguard.controller.rules.loader import RuleSet, parse_rules

RULES = """
rules:
  - name: hot
    scope: gpu
    condition: temperature_celsius > 80
    for: 30s
    severity: warning
    actions: [notify, drain]
    cooldown: 10m
    summary: GPU hot
    labels: {team: infra}
  - name: slow_rank
    scope: rank
    condition: step_time_s > 1
    severity: info
    summary: slow rank
"""


def _cluster() -> Cluster:
    c = Cluster(RULES)
    c.add(make_node("n1"))
    c.add(make_node("n2"))
    c.run(2)
    return c


def test_pending_until_for_then_firing_every_tick_then_resolved_once() -> None:
    c = _cluster()
    c.nodes["n1"].gpus[1]["temperature_celsius"] = 91.0
    c.run(1)
    started = c.clock.now()
    states = [c.states("hot")["gpu:n1:1"]]
    for _ in range(35):
        c.second()
        states.append(c.states("hot")["gpu:n1:1"])
    assert states[:30] == ["pending"] * 30
    assert states[30:] == ["firing"] * 6
    (d,) = [d for d in c.last if d.rule == "hot"]
    assert d.since == started
    assert d.value == 91.0
    assert d.summary == "n1 gpu 1: GPU hot (value 91)"
    assert d.labels == {"team": "infra"}
    assert (d.severity, d.actions, d.cooldown_s) == ("warning", ("notify", "drain"), 600.0)
    c.nodes["n1"].gpus[1]["temperature_celsius"] = 60.0
    c.run(1)
    assert c.states("hot") == {"gpu:n1:1": "resolved"}
    c.run(5)
    assert c.states("hot") == {}
    assert len(c.ever("hot", "resolved")) == 1


def test_condition_that_clears_before_for_restarts_the_clock() -> None:
    c = _cluster()
    gpu = c.nodes["n1"].gpus[0]
    gpu["temperature_celsius"] = 91.0
    c.run(20)
    gpu["temperature_celsius"] = 60.0
    c.run(1)
    assert c.states("hot") == {"gpu:n1:0": "resolved"}
    gpu["temperature_celsius"] = 91.0
    c.run(30)  # true at ticks T .. T+29: for: 30s not yet elapsed
    assert c.states("hot") == {"gpu:n1:0": "pending"}
    c.run(1)
    assert c.states("hot") == {"gpu:n1:0": "firing"}


def test_pending_on_a_silent_node_neither_fires_nor_resolves() -> None:
    c = _cluster()
    c.nodes["n1"].gpus[0]["temperature_celsius"] = 91.0
    c.run(5)
    c.nodes["n1"].silent = True
    c.run(120)
    assert c.states("hot") == {"gpu:n1:0": "pending"}
    c.nodes["n1"].silent = False
    c.run(1)
    assert c.states("hot") == {"gpu:n1:0": "firing"}, "since was kept: for: has long elapsed"


def test_target_that_disappears_from_a_fresh_node_resolves() -> None:
    c = _cluster()
    c.nodes["n2"].gpus[1]["temperature_celsius"] = 91.0
    c.run(40)
    assert c.states("hot") == {"gpu:n2:1": "firing"}
    c.nodes["n2"].gpus.pop()
    c.nodes["n2"].links.pop()
    c.run(1)
    assert c.states("hot") == {"gpu:n2:1": "resolved"}


def test_forgotten_node_resolves_its_incidents_even_though_it_is_silent() -> None:
    c = _cluster()
    c.nodes["n2"].gpus[0]["temperature_celsius"] = 91.0
    c.run(40)
    del c.nodes["n2"]
    c.signals.forget_node("n2")
    c.run(1)
    assert c.states("hot") == {"gpu:n2:0": "resolved"}


def test_rule_removed_on_reload_resolves_its_targets() -> None:
    c = _cluster()
    c.nodes["n1"].gpus[0]["temperature_celsius"] = 91.0
    c.run(40)
    c.rules = RuleSet(rules=(c.rules.get("slow_rank"),), sources=("<reload>",))  # type: ignore[arg-type]
    c.run(1)
    assert c.states("hot") == {"gpu:n1:0": "resolved"}
    c.run(1)
    assert c.states("hot") == {}


def test_rank_that_moves_to_another_node_keeps_its_incident() -> None:
    c = _cluster()
    c.add_job("j", nodes=["n1"], ranks_per_node=1)
    c.rank("j", 0).step_time_s = 2.0
    c.run(3)
    since = next(d.since for d in c.last if d.rule == "slow_rank")
    moved = c.nodes["n1"].ranks.pop()
    c.nodes["n2"].ranks.append(moved)
    c.run(1)
    (d,) = [d for d in c.last if d.rule == "slow_rank"]
    assert (d.state, d.target.node, d.since) == ("firing", "n2", since)


def test_evaluate_does_not_mutate_its_inputs_and_is_deterministic() -> None:
    c = _cluster()
    c.nodes["n1"].gpus[0]["temperature_celsius"] = 91.0
    c.run(3)
    memory = c.memory
    entries_before = dict(memory.entries)
    points_before = c.signals.series_points()
    seen_before = c.signals.last_report_at("n1")
    now = c.clock.now() + 100
    first = evaluate(rules=c.rules, signals=c.signals, now=now, memory=memory)
    second = evaluate(rules=c.rules, signals=c.signals, now=now, memory=memory)
    assert first[0] == second[0]
    assert dict(memory.entries) == entries_before
    assert c.signals.series_points() == points_before
    assert c.signals.last_report_at("n1") == seen_before


def test_empty_memory_and_no_rules_give_no_decisions() -> None:
    c = _cluster()
    decisions, memory = evaluate(
        rules=RuleSet(rules=(), sources=()),
        signals=c.signals,
        now=c.clock.now(),
        memory=EngineMemory(),
    )
    assert decisions == [] and len(memory) == 0


def test_seeded_firing_memory_resolves_when_condition_is_false() -> None:
    """The controller seeds memory from open incidents after a restart."""
    c = _cluster()
    c.nodes["n1"].gpus[0]["temperature_celsius"] = 91.0
    c.run(40)
    seeded = EngineMemory(dict(c.memory.entries))
    c.nodes["n1"].gpus[0]["temperature_celsius"] = 50.0
    c.run(1)
    decisions, _ = evaluate(rules=c.rules, signals=c.signals, now=c.clock.now(), memory=seeded)
    assert [(d.rule, d.state) for d in decisions] == [("hot", "resolved")]


def test_rules_parse_from_text_for_tests() -> None:
    assert [r.name for r in parse_rules(RULES)] == ["hot", "slow_rank"]


MEMO_RULES = """
rules:
  - name: hot_recently
    scope: gpu
    condition: max_over_time(temperature_celsius[5m]) > 80
    severity: warning
    summary: hot in the last 5m
  - name: counter_missing
    scope: ib_port
    condition: not present(symbol_error)
    severity: info
    summary: symbol_error unreadable
"""


def test_quiet_target_memo_never_hides_a_change() -> None:
    """Identical quiet GPUs/ports are skipped after one False evaluation; any change to what
    the condition reads must still be seen."""
    c = Cluster(MEMO_RULES)
    c.add(make_node("n1", gpus=4))
    c.add(make_node("n2", gpus=4))
    c.run(3)
    assert c.rules_seen() == set()
    c.nodes["n2"].gpus[3]["temperature_celsius"] = 85.0
    c.run(1)
    assert c.states("hot_recently") == {"gpu:n2:3": "firing"}
    c.nodes["n2"].gpus[3]["temperature_celsius"] = 55.0
    c.run(2)
    assert c.states("hot_recently") == {"gpu:n2:3": "firing"}, "still hot within the window"
    del c.nodes["n1"].ib["mlx5_0", 1]["counters"]["symbol_error"]
    c.run(1)
    assert c.states("counter_missing") == {"ib_port:n1:mlx5_0:1": "firing"}


REPLICA_RULES = """
rules:
  - name: replica_lagging
    scope: job
    condition: ckpt_replica_lag_s > 3600
    for: 1m
    severity: warning
    summary: the second-region copy is over an hour behind
"""


def test_a_job_rule_sees_the_replication_lag_rank_0_reports() -> None:
    c = Cluster(REPLICA_RULES)
    c.add(make_node("n1"))
    c.add_job("job-a", nodes=["n1"], ranks_per_node=2)
    c.rank("job-a", 0).ckpt_replica_step = 400
    c.rank("job-a", 0).ckpt_replica_lag_s = 30.0
    c.run(70)
    assert c.states("replica_lagging") == {}
    c.rank("job-a", 0).ckpt_replica_lag_s = 4000.0  # the replica's region is down
    c.run(70)
    assert c.states("replica_lagging") == {"job:job-a": "firing"}
    c.rank("job-a", 0).ckpt_replica_lag_s = 0.0  # caught up
    c.run(3)
    assert c.states("replica_lagging") == {}
