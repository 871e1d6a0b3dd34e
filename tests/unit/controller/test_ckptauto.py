"""`checkpoint.interval: auto` on the FakeClock sim (controller.ckptauto): the optimal interval
sent to the job's nodes within the spec's bounds, on the check cadence and only past the
hysteresis; a job without auto untouched; each decision stored before it is sent, so a
controller restarted in between sends the same one under the same ids; a restarted attempt
gets the newest decision; `describe job` shows the source and the changes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.controller.job_sim import Sim, running
from trainguard.controller.ckptauto import decide
from trainguard.controller.ckptspec import CheckpointSpec
from trainguard.controller.composition import Controller

KIND = "set_checkpoint_interval"
AUTO = {"interval": "auto", "min_every_steps": 10, "max_every_steps": 1_000_000}


@pytest.fixture
def sim(make_core: Callable[..., Controller], core_clock: Any, tmp_path: Any) -> Sim:
    """job_sim's cluster with a 60 s look at the advice (n1, n2 active, n3 spare)."""

    class _Sim(Sim):
        def new_controller(self) -> Controller:
            c = super().new_controller()
            c.auto_interval.config = type(c.auto_interval.config)(auto_interval_check_s=60.0)
            return c

    s = _Sim(make_core, core_clock, tmp_path)
    for name in ("n1", "n2"):
        s.add(name)
    s.add("n3", role="spare")
    return s


def _commit(sim: Sim, *, step: int, block_s: float) -> None:
    for rank, node in enumerate(("n1", "n2")):
        sim.agents[node].event(
            "checkpoint_committed", job="job", rank=rank, data={"step": step, "block_s": block_s}
        )


def _sent(sim: Sim, node: str = "n1") -> list[dict[str, Any]]:
    return sim.cmds(node, KIND)


@pytest.mark.parametrize(
    ("optimal", "current", "want"),
    [
        (None, 100, None),  # no advice yet
        (105, 100, None),  # within 10 %: kept
        (111, 100, 111),  # past it: sent
        (5, 100, 10),  # clamped to min_every_steps
        (9_999_999, 100, 5000),  # clamped to max_every_steps
        (4000, 5000, 4000),
        (50, 0, 50),  # the program's own interval (none known): sent
    ],
    ids=["no-advice", "within-hysteresis", "past-hysteresis", "min-bound", "max-bound",
         "down", "first"],
)  # fmt: skip
def test_decide_clamps_to_the_bounds_and_keeps_a_small_drift(
    optimal: int | None, current: int, want: int | None
) -> None:
    spec = CheckpointSpec(interval="auto", min_every_steps=10, max_every_steps=5000)
    got = decide(spec=spec, optimal_every_steps=optimal, current_every_steps=current, change=0.1)
    assert got == want


def test_an_auto_job_gets_the_optimal_interval_once_and_again_only_when_it_moves(sim: Sim) -> None:
    sim.submit(nodes=["n1", "n2"], checkpoint=AUTO)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    start = sim.cmds("n1", "start_job")[-1]
    assert start["env"]["TRAINGUARD_CHECKPOINT_INTERVAL"] == "auto:10"
    assert _sent(sim) == []  # no checkpoint committed: no measured cost, no advice
    _commit(sim, step=10, block_s=2.0)
    sim.second(61)  # the next look at the advice
    optimal = sim.c.get_job("job").checkpoint_interval
    assert optimal is not None and optimal.optimal_every_steps is not None
    sent = _sent(sim)
    assert len(sent) == 1 and _sent(sim, "n2") == sent
    assert sent[0]["every_steps"] == optimal.optimal_every_steps
    assert sent[0]["request_id"] == "ckpt-interval:job:1"
    # the advice moves by < 10 % (cost 2.0 -> mean 2.1: sqrt(1.05)): nothing is sent
    _commit(sim, step=20, block_s=2.2)
    sim.second(61)
    assert len(_sent(sim)) == 1
    # it moves by more (mean cost ~4.5: about x1.5): the new one is sent at the next look
    _commit(sim, step=30, block_s=9.3)
    sim.second(30)
    assert len(_sent(sim)) == 1  # not before the cadence
    sim.second(31)
    sent = _sent(sim)
    assert len(sent) == 2 and sent[1]["request_id"] == "ckpt-interval:job:2"
    advice = sim.c.get_job("job").checkpoint_interval
    assert advice is not None and sent[1]["every_steps"] == advice.optimal_every_steps
    view = sim.c.get_job("job")
    assert view.checkpoint_interval_source == "auto"
    assert view.checkpoint_every_steps == sent[1]["every_steps"]
    changes = view.checkpoint_interval_changes
    assert [c.data["every_steps"] for c in changes] == [s["every_steps"] for s in reversed(sent)]
    assert changes[-1].data["before"] == 10  # the first replaced the spec's start


def test_the_bounds_clamp_what_is_sent(sim: Sim) -> None:
    sim.submit(nodes=["n1", "n2"], checkpoint={**AUTO, "max_every_steps": 500})
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    _commit(sim, step=10, block_s=2.0)  # optimal: thousands of steps at 0.5 s a step
    sim.second(61)
    assert [s["every_steps"] for s in _sent(sim)] == [500]


@pytest.mark.parametrize(
    "checkpoint", [None, {"interval": 100}], ids=["no-checkpoint-block", "fixed-interval"]
)
def test_a_job_without_auto_is_left_alone(sim: Sim, checkpoint: dict[str, Any] | None) -> None:
    spec: dict[str, Any] = {"nodes": ["n1", "n2"]}
    if checkpoint is not None:
        spec["checkpoint"] = checkpoint
    sim.submit(**spec)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    _commit(sim, step=10, block_s=2.0)
    sim.second(130)
    assert _sent(sim) == [] and _sent(sim, "n2") == []
    view = sim.c.get_job("job")
    assert view.checkpoint_interval is not None  # advised, never applied
    assert view.checkpoint_interval_source == ("" if checkpoint is None else "fixed")
    assert view.checkpoint_interval_changes == ()
    env = sim.cmds("n1", "start_job")[-1]["env"]
    assert env.get("TRAINGUARD_CHECKPOINT_INTERVAL") == (None if checkpoint is None else "100")


def test_a_controller_killed_after_deciding_sends_that_decision_under_the_same_ids(
    sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim.submit(nodes=["n1", "n2"], checkpoint={**AUTO, "retention": {"daily_days": 7}})
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    env = sim.cmds("n1", "start_job")[-1]["env"]
    assert env["TRAINGUARD_RETENTION"] == '{"daily_days": 7}'
    _commit(sim, step=10, block_s=2.0)

    def killed(*_: Any, **__: Any) -> None:
        raise SystemExit("kill -9")  # the decision row is stored, nothing was sent

    monkeypatch.setattr(sim.c.auto_interval, "_send", killed)
    with pytest.raises(SystemExit):
        sim.second(61)
    decided = sim.c.store.actions.recent_of("checkpoint_interval", target="job", limit=5)
    assert len(decided) == 1
    every = decided[0].params["every_steps"]
    sim.c.stop()
    sim.c = sim.new_controller()  # the same store: what a restart after kill -9 finds
    _commit(sim, step=20, block_s=9.0)  # the advice moved meanwhile; the decision stands
    sim.second(3)
    sent = _sent(sim)
    assert [(s["every_steps"], s["request_id"]) for s in sent] == [(every, "ckpt-interval:job:1")]
    assert [c.id for c in sim.agents["n1"].commands if c.kind == KIND] == [
        "ckpt-interval:job:1:a1:n1"
    ]
    again = sim.c.store.actions.recent_of("checkpoint_interval", target="job", limit=5)
    assert len(again) == 1  # not decided twice


def test_a_restarted_attempt_gets_the_newest_decision(sim: Sim) -> None:
    sim.submit(nodes=["n1", "n2"], checkpoint=AUTO)
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    _commit(sim, step=10, block_s=2.0)
    sim.second(61)
    assert len(_sent(sim)) == 1
    sim.c.job_action("job", "restart", actor="ops")
    sim.until(running(sim, attempt=2), max_s=60, what="attempt 2 running")
    sim.second(2)
    ids = [c.id for c in sim.agents["n1"].commands if c.kind == KIND]
    assert ids == ["ckpt-interval:job:1:a1:n1", "ckpt-interval:job:1:a2:n1"]
    assert {s["request_id"] for s in _sent(sim)} == {"ckpt-interval:job:1"}
    every = _sent(sim)[0]["every_steps"]
    env = sim.cmds("n1", "start_job")[-1]["env"]
    assert env["TRAINGUARD_CHECKPOINT_INTERVAL"] == f"auto:{every}"  # starts at the decision
