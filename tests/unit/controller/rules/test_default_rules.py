"""Every rule in rules/default.yaml on a FakeClock-driven simulated cluster: silent while
healthy, fires on its fault on the right target, honours `for:`, resolves once the condition
clears (windowed rules: once the window has passed)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.unit.controller.rules.scenario import Cluster, make_node
from trainguard.controller.rules.loader import default_rules_path, load_rules
from trainguard.controller.signals import SIGNALS

DEFAULT_RULES = load_rules([default_rules_path()])


def healthy_cluster() -> Cluster:
    c = Cluster(DEFAULT_RULES)
    c.add(make_node("n1"))
    c.add(make_node("n2"))
    c.add(make_node("n3"), role="spare")
    c.add_job("job-a", nodes=["n1", "n2"], ranks_per_node=2)
    return c


Action = Callable[[Cluster], None]


def _every_second(fn: Action) -> Action:
    def install(c: Cluster) -> None:
        c.hooks.append(fn)

    return install


def _stop_hooks(c: Cluster) -> None:
    c.hooks.clear()


def _gpu(node: str, gpu: int, **fields: object) -> Action:
    def act(c: Cluster) -> None:
        c.nodes[node].gpus[gpu].update(fields)

    return act


def _link(node: str, gpu: int, link: int, **fields: object) -> Action:
    def act(c: Cluster) -> None:
        c.nodes[node].links[gpu][link].update(fields)

    return act


def _ib_up(node: str, up: bool) -> Action:
    def act(c: Cluster) -> None:
        c.nodes[node].ib["mlx5_0", 1]["up"] = up

    return act


def _ib_bump(counter: str, by: int) -> Action:
    def act(c: Cluster) -> None:
        counters = c.nodes["n1"].ib["mlx5_0", 1]["counters"]
        counters[counter] += by

    return act


def _ranks(job: str, ranks: list[int] | None = None, **fields: object) -> Action:
    def act(c: Cluster) -> None:
        for r in c.ranks(job):
            if ranks is None or r.rank in ranks:
                for k, v in fields.items():
                    setattr(r, k, v)

    return act


def _both(*acts: Action) -> Action:
    def act(c: Cluster) -> None:
        for a in acts:
            a(c)

    return act


def _nothing(c: Cluster) -> None:
    return None


def _flap(c: Cluster) -> None:
    # ACTIVE <-> DOWN every 3 s: too short for ib_link_down's 30 s, long enough to count
    port = c.nodes["n1"].ib["mlx5_0", 1]
    if int(c.clock.now()) % 3 == 0:
        port["up"] = not port["up"]


def _counter_rate(per_s: int) -> Action:
    def hook(c: Cluster) -> None:
        c.nodes["n1"].gpus[0]["ecc_corrected_volatile_total"] += per_s

    return hook


@dataclass(frozen=True)
class Case:
    rule: str
    fault: Action
    target: str
    clear: Action
    fire_within_s: int = 5  # from fault until firing, beyond `for:`
    resolve_within_s: int = 5  # from clear until resolved


CASES = [
    Case(
        "gpu_uncorrectable_ecc",
        _gpu("n1", 1, ecc_uncorrected_volatile_total=1),
        "gpu:n1:1",
        _nothing,  # a counter never goes back: the 10m window has to pass
        resolve_within_s=620,
    ),
    Case(
        "gpu_correctable_ecc_rate",
        _every_second(_counter_rate(3)),  # > 300 in 5m after ~100 s
        "gpu:n1:0",
        _stop_hooks,
        fire_within_s=130,
        resolve_within_s=310,
    ),
    Case(
        "gpu_remap_pending",
        _gpu("n2", 0, remapped_rows_pending=True),
        "gpu:n2:0",
        _gpu("n2", 0, remapped_rows_pending=False),
    ),
    Case(
        "gpu_remap_failed",
        _gpu("n2", 1, remapped_rows_failure=True),
        "gpu:n2:1",
        _gpu("n2", 1, remapped_rows_failure=False),
    ),
    Case(
        "gpu_fatal_xid",
        lambda c: c.nodes["n1"].event("xid", gpu=0, code=79, message="fallen off the bus"),
        "gpu:n1:0",
        _nothing,
        resolve_within_s=320,
    ),
    Case(
        "gpu_lost",
        _both(
            _gpu("n2", 1, lost=True),
            lambda c: c.nodes["n2"].event("gpu_lost", gpu=1),
        ),
        "gpu:n2:1",
        _gpu("n2", 1, lost=False),
        resolve_within_s=620,
    ),
    Case(
        "gpu_thermal_slowdown",
        _gpu("n1", 0, throttle_hw_thermal=True),
        "gpu:n1:0",
        _gpu("n1", 0, throttle_hw_thermal=False),
    ),
    Case(
        "nvlink_down",
        _link("n1", 1, 0, up=False),
        "nvlink:n1:1:0",
        _link("n1", 1, 0, up=True),
    ),
    Case(
        "nvlink_error_rate",
        _link("n2", 0, 1, recovery_errors_total=1),
        "nvlink:n2:0:1",
        _nothing,
        resolve_within_s=320,
    ),
    Case("ib_link_down", _ib_up("n1", False), "ib_port:n1:mlx5_0:1", _ib_up("n1", True)),
    Case(
        "ib_link_flapping",
        _every_second(_flap),
        "ib_port:n1:mlx5_0:1",
        _both(_stop_hooks, _ib_up("n1", True)),
        fire_within_s=20,
        resolve_within_s=620,
    ),
    Case(
        "ib_error_rate",
        _every_second(_ib_bump("symbol_error", 2)),  # > 300 in 5m after ~150 s
        "ib_port:n1:mlx5_0:1",
        _stop_hooks,
        fire_within_s=170,
        resolve_within_s=310,
    ),
    Case(
        "node_silent",
        lambda c: setattr(c.nodes["n2"], "silent", True),
        "node:n2",
        lambda c: setattr(c.nodes["n2"], "silent", False),
        fire_within_s=7,
    ),
    Case(
        "spare_silent",
        lambda c: setattr(c.nodes["n3"], "silent", True),
        "node:n3",
        lambda c: setattr(c.nodes["n3"], "silent", False),
        fire_within_s=7,
    ),
    Case(
        "rank_silent",
        _ranks("job-a", [2], heartbeat_age_s=31.0),
        "rank:job-a:2",
        _ranks("job-a", [2], heartbeat_age_s=0.2),
    ),
    Case(
        "training_stall",
        _ranks("job-a", step_age_s=125.0),
        "job:job-a",
        _ranks("job-a", step_age_s=0.2),
    ),
    Case(
        "straggler",
        # 20% over the 0.4 s median in compute; step times stay equal, as in a synchronous job
        _ranks("job-a", [3], compute_time_s=0.48),
        "rank:job-a:3",
        _ranks("job-a", [3], compute_time_s=0.4),
    ),
    Case(
        "nan_loss",
        _both(
            _ranks("job-a", [1], loss=math.nan),
            lambda c: c.nodes["n1"].event("nan_loss", job="job-a", rank=1),
        ),
        "rank:job-a:1",
        _ranks("job-a", [1], loss=2.4),
        resolve_within_s=320,
    ),
    Case(
        "checkpoint_failing",
        # one rank's saves failed three times in a row (the others' commits do not help)
        _ranks("job-a", [2], ckpt_failures=3),
        "job:job-a",
        _ranks("job-a", [2], ckpt_failures=0),
    ),
    Case(
        "job_process_failed",
        lambda c: c.signals.set_job_meta("job-a", nodes=["n1", "n2"], state="crashed"),
        "job:job-a",
        lambda c: c.signals.set_job_meta("job-a", nodes=["n1", "n2"], state="restarting"),
    ),
    Case(
        "agent_source_stale",
        lambda c: c.nodes["n1"].health.update(sources_stale=1.0),
        "node:n1",
        lambda c: c.nodes["n1"].health.update(sources_stale=0.0),
    ),
    Case(
        "preemption_notice",
        lambda c: c.nodes["n1"].event("preemption_notice"),
        "node:n1",
        _nothing,
        resolve_within_s=620,
    ),
    Case(
        "throughput_drop",
        _ranks("job-a", samples_per_s=40.0),  # 160/256 = 62% of the peak
        "job:job-a",
        _ranks("job-a", samples_per_s=64.0),
    ),
]


def test_every_default_rule_has_a_scenario() -> None:
    assert sorted(c.rule for c in CASES) == sorted(DEFAULT_RULES.names())


def test_healthy_cluster_fires_nothing() -> None:
    c = healthy_cluster()
    c.run(120)
    assert c.rules_seen() == set(), [d for _, d in c.log][:5]


@pytest.mark.parametrize("case", CASES, ids=[c.rule for c in CASES])
def test_default_rule_fires_respects_for_and_resolves(case: Case) -> None:
    rule = DEFAULT_RULES.get(case.rule)
    assert rule is not None
    c = healthy_cluster()
    c.run(30)
    assert case.rule not in c.rules_seen(), "fired while healthy"

    case.fault(c)
    fault_at = c.clock.now()
    deadline = int(rule.for_s) + case.fire_within_s
    for _ in range(deadline):
        c.second()
        if c.states(case.rule).get(case.target) == "firing":
            break
    else:
        pytest.fail(f"{case.rule} did not fire on {case.target} within {deadline}s of the fault")

    firing = c.ever(case.rule, "firing")
    pending = c.ever(case.rule, "pending")
    first_true = min(t for t, _ in pending + firing)
    first_firing = min(t for t, _ in firing)
    assert first_firing - first_true >= rule.for_s, "fired before for: elapsed"
    assert first_firing - first_true <= rule.for_s + 1.0, "firing came late after for:"
    if rule.for_s > 0:
        assert pending, "a rule with for: must be pending first"
    assert {d.target.key for _, d in firing} == {case.target}, "fired on the wrong target"
    decision = next(d for _, d in firing)
    assert decision.severity == rule.severity
    assert decision.actions == rule.actions
    assert decision.cooldown_s == rule.cooldown_s
    assert decision.since is not None and decision.since >= fault_at
    assert decision.summary.startswith(decision.target.describe())

    case.clear(c)
    for _ in range(case.resolve_within_s):
        c.second()
        if c.states(case.rule).get(case.target) == "resolved":
            break
    else:
        pytest.fail(f"{case.rule} did not resolve within {case.resolve_within_s}s of clearing")
    c.run(3)
    assert case.target not in c.states(case.rule), "still reported after resolving"
    assert len(c.ever(case.rule, "resolved")) == 1, "resolved must be emitted exactly once"


def test_non_fatal_xid_does_not_open_the_fatal_xid_rule() -> None:
    c = healthy_cluster()
    c.nodes["n1"].event("xid", gpu=0, code=13, message="graphics engine exception")
    c.run(5)
    assert "gpu_fatal_xid" not in c.rules_seen()


def test_node_silent_ignores_drained_nodes() -> None:
    c = healthy_cluster()
    c.signals.set_node_meta("n2", role="active", state="drained", job=None)
    c.nodes["n2"].silent = True
    c.run(30)
    assert "node_silent" not in c.rules_seen()


def test_straggler_needs_three_ranks_to_compare() -> None:
    c = Cluster(DEFAULT_RULES)
    c.add(make_node("n1"))
    c.add_job("small", nodes=["n1"], ranks_per_node=2)
    c.rank("small", 1).compute_time_s = 2.0
    c.run(90)
    assert "straggler" not in c.rules_seen()


def test_a_straggler_is_told_by_compute_time_not_by_the_shared_step_time() -> None:
    """In a synchronous job every rank waits for the slowest at the all-reduce: equal step
    times, one slow compute time. A rank whose step alone is long (it waited) is no
    straggler; ranks that send no compute time are not compared."""
    c = healthy_cluster()
    _ranks("job-a", [2], step_time_s=0.9)(c)
    c.run(120)
    assert "straggler" not in c.rules_seen()
    _ranks("job-a", compute_time_s=None)(c)
    _ranks("job-a", [2], compute_time_s=2.0)(c)
    c.run(120)
    assert "straggler" not in c.rules_seen()


def test_checkpoint_failing_when_no_commit_for_three_intervals() -> None:
    rule = DEFAULT_RULES.get("checkpoint_failing")
    assert rule is not None
    c = healthy_cluster()
    c.run(30)
    _ranks("job-a", [1], ckpt_age_s=149.0)(c)  # under 3 x 50 s: a slow write, not a failure
    c.run(int(rule.for_s) + 5)
    assert "checkpoint_failing" not in c.rules_seen()
    _ranks("job-a", [1], ckpt_age_s=151.0)(c)
    c.run(int(rule.for_s) + 2)
    assert c.states("checkpoint_failing") == {"job:job-a": "firing"}
    _ranks("job-a", [1], ckpt_age_s=3.0)(c)  # a commit
    c.run(3)
    assert c.states("checkpoint_failing") == {}
    assert len(c.ever("checkpoint_failing", "resolved")) == 1


def test_checkpoint_failing_spares_a_job_without_periodic_checkpoints() -> None:
    c = healthy_cluster()
    # no interval: an old (or no) checkpoint is the job's choice, and one or two failed
    # requested saves are not yet a broken checkpoint path
    _ranks("job-a", ckpt_interval_s=None, ckpt_age_s=86400.0, ckpt_failures=2)(c)
    c.run(180)
    assert "checkpoint_failing" not in c.rules_seen()


def test_stall_needs_fresh_heartbeats() -> None:
    """No progress and no heartbeats is a silent rank (or node), not a stall."""
    c = healthy_cluster()
    _ranks("job-a", step_age_s=200.0, heartbeat_age_s=200.0)(c)
    c.run(5)
    assert "training_stall" not in c.rules_seen()
    assert "rank_silent" in c.rules_seen()


def test_silent_node_holds_its_hardware_and_rank_rules() -> None:
    """No action on stale data: while n1 is silent its GPU incident neither resolves (even
    after the 10m window) nor do its ranks start firing from the growing report age."""
    c = healthy_cluster()
    c.run(10)
    _gpu("n1", 0, ecc_uncorrected_volatile_total=2)(c)
    c.run(2)
    assert c.states("gpu_uncorrectable_ecc") == {"gpu:n1:0": "firing"}
    c.nodes["n1"].silent = True
    c.run(700)
    assert c.states("gpu_uncorrectable_ecc") == {"gpu:n1:0": "firing"}, "held while silent"
    assert not c.ever("gpu_uncorrectable_ecc", "resolved")
    assert c.states("node_silent") == {"node:n1": "firing"}
    assert "rank_silent" not in c.rules_seen(), "ranks on a silent node must not fire"
    # back: fresh data shows the window has passed, so the incident resolves
    c.nodes["n1"].silent = False
    c.run(1)
    assert c.states("gpu_uncorrectable_ecc") == {"gpu:n1:0": "resolved"}
    assert c.states("node_silent") == {"node:n1": "resolved"}


def test_docs_list_every_signal_and_every_default_rule() -> None:
    docs = (Path(__file__).resolve().parents[4] / "docs" / "rules.md").read_text()
    for scope, names in SIGNALS.items():
        assert f"### `{scope}`" in docs, scope
        for name in names:
            assert f"| `{name}` |" in docs, f"{scope}.{name} missing from docs/rules.md"
    for rule in DEFAULT_RULES.rules:
        assert f"| `{rule.name}` | {rule.scope} |" in docs, f"{rule.name} missing from docs"
