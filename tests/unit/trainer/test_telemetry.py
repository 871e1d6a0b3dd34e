"""`Telemetry` alone, on a real agent socket: one heartbeat per send, each queued event in a
datagram of its own, and the newest committed checkpoint in every later heartbeat."""

from __future__ import annotations

import logging

import pytest

from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.clock import FakeClock
from trainguard.trainer.channel import AgentChannel
from trainguard.trainer.checkpoint import SaveResult
from trainguard.trainer.telemetry import Telemetry


def telemetry(agent: FakeAgent) -> Telemetry:
    return Telemetry(
        channel=AgentChannel(agent_socket=agent.path, control_socket=None),
        job="unit",
        rank=2,
        local_rank=0,
        world_size=4,
        pid=1234,
        clock=FakeClock(),
    )


def test_a_send_without_events_is_one_heartbeat_with_the_rates_of_this_rank(
    agent: FakeAgent,
) -> None:
    t = telemetry(agent)
    t.send(step=5, phase="train", loss=1.5, step_time_s=0.5, samples=32, tokens=64)
    t.event("exit", {})
    t.send(step=5, phase="exit")
    t.channel.close()
    first, last = agent.drain()
    assert (first.job, first.rank, first.world_size, first.pid) == ("unit", 2, 4, 1234)
    assert first.step == 5 and first.loss == 1.5 and first.event is None
    assert first.samples_per_s == 64.0 and first.tokens_per_s == 128.0
    assert last.phase == "exit" and last.event == "exit"


def test_each_queued_event_travels_alone_with_the_level_fields_repeated(
    agent: FakeAgent,
) -> None:
    t = telemetry(agent)
    t.event("nan_loss", {"step": 3, "loss": None, "grad_norm": None})
    t.event("stop", {"step": 3, "reason": "nan"})
    t.send(step=3, phase="stopping", loss=2.0)
    t.event("exit", {})
    t.send(step=3, phase="exit")
    t.channel.close()
    hbs = agent.drain()
    assert [h.event for h in hbs] == ["nan_loss", "stop", "exit"]
    assert [h.loss for h in hbs[:2]] == [2.0, 2.0]
    assert hbs[1].event_data == {"step": 3, "reason": "nan"}


def test_results_set_the_checkpoint_every_later_heartbeat_carries(agent: FakeAgent) -> None:
    t = telemetry(agent)
    t.checkpoint_loaded(step=10, request_id=None)
    assert (t.ckpt_step, t.ckpt_request_id) == (10, None)
    t.report(
        SaveResult(
            step=20, request_id="r1", ok=True, duration_s=0.25, path="/c/step_20", block_s=0.01
        )
    )
    t.report(SaveResult(step=30, request_id=None, ok=False, duration_s=0.0, path="", reason="x"))
    assert (t.ckpt_step, t.ckpt_request_id) == (20, "r1")  # a failure changes neither
    t.send(step=30, phase="train")
    t.event("exit", {})
    t.send(step=30, phase="exit")
    t.channel.close()
    committed, failed, _ = agent.drain()
    assert committed.event == "checkpoint_committed"
    assert committed.event_data == {
        "step": 20,
        "request_id": "r1",
        "duration_s": 0.25,
        "block_s": 0.01,  # what the save cost the loop (the controller's checkpoint cost)
        "path": "/c/step_20",
    }
    assert failed.event == "checkpoint_failed"
    assert failed.event_data == {"step": 30, "request_id": None, "reason": "x"}
    assert committed.ckpt_step == 20 and committed.ckpt_request_id == "r1"


def _fail(step: int) -> SaveResult:
    return SaveResult(step=step, request_id=None, ok=False, duration_s=0.0, path="", reason="x y")


def test_checkpoint_health_counts_failures_in_a_row_and_the_age_of_the_newest_commit(
    agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    t = Telemetry(
        channel=AgentChannel(agent_socket=agent.path, control_socket=None),
        job="unit",
        rank=2,
        local_rank=0,
        world_size=4,
        pid=1234,
        checkpoint_every=10,
        clock=clock,
    )
    caplog.set_level(logging.INFO, logger="trainguard.trainer")
    t.send(step=0, phase="init")  # no step timed yet: no interval
    clock.advance(5.0)
    t.send(step=1, phase="train", step_time_s=2.0)
    clock.advance(4.0)
    t.send(step=2, phase="train", step_time_s=2.0)
    clock.advance(20.0)
    t.report(SaveResult(step=10, request_id=None, ok=True, duration_s=0.1, path="/c/step_10"))
    clock.advance(3.0)
    t.report(_fail(20))
    t.report(_fail(30))
    t.send(step=30, phase="train", step_time_s=1.0)
    t.report(SaveResult(step=40, request_id=None, ok=True, duration_s=0.1, path="/c/step_40"))
    t.send(step=40, phase="train", step_time_s=1.0)
    t.event("exit", {})
    t.send(step=40, phase="exit")
    t.channel.close()
    hbs = agent.drain()
    init, first, second = hbs[0], hbs[1], hbs[2]
    assert (init.ckpt_failures, init.ckpt_age_s, init.ckpt_interval_s) == (0, 0.0, None)
    # before any commit the age counts from the end of the run's first step (a slow first
    # step is no time without a checkpoint); interval = every x the mean step time
    assert (first.ckpt_age_s, first.ckpt_interval_s) == (0.0, 20.0)
    assert (second.ckpt_age_s, second.ckpt_interval_s) == (4.0, 20.0)
    failing = [h for h in hbs if h.step == 30]
    assert {h.ckpt_failures for h in failing} == {2}
    assert {h.ckpt_age_s for h in failing} == {3.0}  # the commit of step 10, 3 s ago
    assert failing[0].ckpt_interval_s == 10 * (2.0 + 0.1 * (1.0 - 2.0))
    last = hbs[-2]
    assert (last.ckpt_failures, last.ckpt_age_s) == (0, 0.0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one WARNING per run of failures"
    assert "event=checkpoint_failing" in warnings[0].getMessage()
    assert "step=20" in warnings[0].getMessage() and "reason=x_y" in warnings[0].getMessage()
    recovered = [r.getMessage() for r in caplog.records if "checkpoint_recovered" in r.getMessage()]
    assert len(recovered) == 1 and "failures=2" in recovered[0]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.levelno != logging.WARNING)


def test_without_periodic_checkpoints_there_is_no_interval(agent: FakeAgent) -> None:
    t = telemetry(agent)
    t.send(step=1, phase="train", step_time_s=0.5)
    t.event("exit", {})
    t.send(step=1, phase="exit")
    t.channel.close()
    hb, _ = agent.drain()
    assert hb.ckpt_interval_s is None and hb.ckpt_failures == 0


def test_every_heartbeat_names_the_epoch_of_the_ranks_world(agent: FakeAgent) -> None:
    t = telemetry(agent)
    t.send(step=1, phase="train")
    t.epoch = 3  # a rank that rejoined under epoch 3 (Trainguard._bind sets it)
    t.event("exit", {})
    t.send(step=2, phase="exit")
    t.channel.close()
    before, after = agent.drain()
    assert (before.epoch, after.epoch) == (None, 3)
