"""`OwnCheckpointer`: a job's own save function called at the agreed step, its outcome reported
(checkpoint_committed / checkpoint_failed with the health counters), heartbeats per step,
stop requests and SIGTERM acted on after the save (single process; the agreement across
ranks is the same `StepAgreement` as `Trainguard`'s, exercised with 2 ranks by the
integration test of examples/train_own_ckpt.py)."""

from __future__ import annotations

import socket

import pytest

from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.protocol import Control, encode_json
from trainguard.trainer.integrations.own import OwnCheckpointer


class Saves:
    """The job's save function: records the steps, raises for the steps in `failing`."""

    def __init__(self, failing: tuple[int, ...] = ()) -> None:
        self.steps: list[int] = []
        self.failing = failing

    def __call__(self, step: int) -> None:
        self.steps.append(step)
        if step in self.failing:
            raise OSError(28, "No space left on device")


def send(own: OwnCheckpointer, action: str, request_id: str) -> None:
    assert own.channel.control_socket is not None
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(
            encode_json(Control(action=action, request_id=request_id)),  # type: ignore[arg-type]
            own.channel.control_socket,
        )


def guard(saves: Saves, **kw: object) -> OwnCheckpointer:
    return OwnCheckpointer(save=saves, handle_sigterm=False, **kw)  # type: ignore[arg-type]


def test_periodic_saves_call_the_job_and_report_the_commit(agent: FakeAgent) -> None:
    saves = Saves()
    own = guard(saves, checkpoint_every=3)
    for step in range(1, 8):
        assert not own.step(step, loss=1.0 / step, samples=4).stop
    own.close()
    assert saves.steps == [3, 6]
    hbs = agent.drain()
    committed = [h.event_data["step"] for h in hbs if h.event == "checkpoint_committed"]
    assert committed == [3, 6]
    train = [h for h in hbs if h.phase == "train"]
    assert [h.step for h in train] == list(range(1, 8))
    assert train[-1].ckpt_step == 6 and train[-1].loss == pytest.approx(1 / 7)
    assert all(h.samples_per_s for h in train[1:])


def test_a_checkpoint_request_is_served_by_the_jobs_save_with_its_request_id(
    agent: FakeAgent,
) -> None:
    saves = Saves()
    own = guard(saves)
    own.step(1, loss=1.0)
    send(own, "checkpoint", "req-1")
    action = own.step(2, loss=1.0)
    assert action.checkpoint_started and not action.stop and action.request_id == "req-1"
    send(own, "checkpoint", "req-1")  # delivered again: already handled
    own.step(3, loss=1.0)
    own.close()
    assert saves.steps == [2]
    (ev,) = [h for h in agent.drain() if h.event == "checkpoint_committed"]
    assert ev.event_data["step"] == 2 and ev.event_data["request_id"] == "req-1"
    assert ev.ckpt_request_id == "req-1"


def test_a_failing_save_reports_checkpoint_failed_and_counts_until_a_commit(
    agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    saves = Saves(failing=(2, 4))
    own = guard(saves, checkpoint_every=2)
    for step in range(1, 7):
        own.step(step, loss=1.0)
    own.close()
    hbs = agent.drain()
    failed = [h for h in hbs if h.event == "checkpoint_failed"]
    assert [h.event_data["step"] for h in failed] == [2, 4]
    assert [h.ckpt_failures for h in failed] == [1, 2]
    assert "No space left" in failed[0].event_data["reason"]
    assert hbs[-1].ckpt_step == 6 and hbs[-1].ckpt_failures == 0
    assert "event=checkpoint_failing" in caplog.text


def test_sigterm_saves_at_the_next_step_then_stops(agent: FakeAgent) -> None:
    saves = Saves()
    own = OwnCheckpointer(save=saves, sigterm_hard_exit=False)
    own.step(1, loss=1.0)
    own.signals.on_sigterm(15, None)  # as the handler would
    action = own.step(2, loss=1.0)
    own.close()
    assert action.stop and action.reason == "sigterm" and saves.steps == [2]
    stops = [h for h in agent.drain() if h.event == "stop"]
    assert stops[0].event_data["reason"] == "sigterm"


@pytest.mark.parametrize("action", ["stop", "checkpoint_stop"])
def test_a_stop_request_stops_after_a_save_only_when_asked(agent: FakeAgent, action: str) -> None:
    saves = Saves()
    own = guard(saves)
    own.step(1, loss=1.0)
    send(own, action, "r")
    assert own.step(2, loss=1.0).stop
    own.close()
    assert saves.steps == ([2] if action == "checkpoint_stop" else [])


def test_a_nonfinite_state_is_never_saved_and_nan_stop_stops(agent: FakeAgent) -> None:
    saves = Saves()
    own = guard(saves, checkpoint_every=1, nan_policy="stop")
    own.step(1, loss=1.0)
    action = own.step(2, loss=float("nan"))
    own.close()
    assert action.stop and action.reason == "nan" and saves.steps == [1]


def test_rollback_is_refused_naming_the_argument() -> None:
    with pytest.raises(ValueError, match="nan_policy"):
        guard(Saves(), nan_policy="rollback")


def test_resumed_reports_the_jobs_checkpoint_as_the_newest(agent: FakeAgent) -> None:
    own = guard(Saves())
    own.resumed(40)
    own.step(41, loss=1.0)
    own.close()
    assert agent.drain()[-1].ckpt_step == 40


def test_a_run_resumed_at_its_end_reports_the_resumed_step(agent: FakeAgent) -> None:
    own = guard(Saves())
    own.resumed(40)
    own.close()
    last = agent.drain()[-1]
    assert (last.phase, last.step, last.ckpt_step) == ("exit", 40, 40)
