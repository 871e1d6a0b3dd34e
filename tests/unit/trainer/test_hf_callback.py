"""`TrainguardCallback` (trainer/integrations/hf.py) driven by hand, one process: the Trainer's
events with real TrainerState/TrainerControl, a fake agent socket, no training."""

from __future__ import annotations

import json
import logging
import math
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import TrainerControl, TrainerState

from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.protocol import Control, encode_json
from trainguard.trainer.integrations.hf import (
    CHECKSUMS_NAME,
    TrainguardCallback,
    newest_verified_checkpoint,
    verify_checkpoint,
)


def make_args(output_dir: Path) -> Any:
    return SimpleNamespace(
        output_dir=str(output_dir),
        save_steps=100,
        save_strategy="steps",
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )


class Driver:
    """Plays the Trainer's part: the events of one step, in the Trainer's order."""

    def __init__(self, output_dir: Path, **kw: Any) -> None:
        kw.setdefault("handle_sigterm", False)
        kw.setdefault("sigterm_hard_exit", False)
        kw.setdefault("dump_stacks_on_sigusr1", False)
        self.cb = TrainguardCallback(**kw)
        self.args = make_args(output_dir)
        self.state = TrainerState()
        self.control = TrainerControl()
        self.model = torch.nn.Linear(2, 2)
        self.cb.on_train_begin(self.args, self.state, self.control, model=self.model)

    def step(
        self, *, loss: float = 1.0, log: bool = True, periodic_save: bool = False
    ) -> TrainerControl:
        """One optimizer step: begin, forward, end, log, save if asked."""
        self.control = TrainerControl()
        self.cb.on_step_begin(self.args, self.state, self.control)
        self.model(torch.zeros(1, 2))
        self.state.global_step += 1
        self.control.should_log = log
        self.control.should_save = periodic_save
        self.cb.on_step_end(self.args, self.state, self.control)
        if log:
            self.cb.on_log(
                self.args, self.state, self.control, logs={"loss": loss, "grad_norm": 0.5}
            )
        if self.control.should_save:
            self.save()
        return self.control

    def save(self) -> Path:
        d = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"weights" * 10)
        (d / "trainer_state.json").write_text("{}")
        self.cb.on_save(self.args, self.state, self.control)
        return d

    def end(self) -> None:
        self.cb.on_train_end(self.args, self.state, self.control)

    def send(self, action: str, request_id: str) -> None:
        path = self.cb.channel.control_socket
        assert path is not None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            s.sendto(encode_json(Control(action=action, request_id=request_id)), path)  # type: ignore[arg-type]
        finally:
            s.close()


@pytest.fixture
def driver(agent: FakeAgent, tmp_path: Path) -> Iterator[Driver]:
    d = Driver(tmp_path / "out")
    yield d
    d.end()


def test_each_step_sends_a_heartbeat_with_its_loss_throughput_and_compute_time(
    driver: Driver, agent: FakeAgent
) -> None:
    for _ in range(3):
        driver.step(loss=2.5)
    driver.step(log=False)
    driver.end()
    train = [h for h in agent.drain() if h.phase == "train"]
    assert [h.step for h in train] == [1, 2, 3, 4]
    assert [h.loss for h in train] == [2.5, 2.5, 2.5, None]
    assert train[1].grad_norm == 0.5
    assert train[0].step_time_s is None and train[1].step_time_s is not None
    assert train[1].samples_per_s is not None and train[1].samples_per_s > 0  # 4 x 2 per step
    assert all(h.compute_time_s is not None and h.compute_time_s >= 0 for h in train)
    assert all(h.job == "unit" and h.rank == 0 for h in train)


def test_a_checkpoint_request_is_served_by_the_trainers_save_and_its_commit_reported(
    driver: Driver, agent: FakeAgent
) -> None:
    driver.step()
    driver.send("checkpoint", "req-1")
    control = driver.step()
    assert control.should_save and not control.should_training_stop
    driver.step()  # the request is not served twice
    driver.end()
    committed = [h for h in agent.drain() if h.event == "checkpoint_committed"]
    assert len(committed) == 1
    assert committed[0].event_data["step"] == 2
    assert committed[0].event_data["request_id"] == "req-1"
    assert committed[0].ckpt_step == 2 and committed[0].ckpt_request_id == "req-1"
    out = Path(driver.args.output_dir)
    assert newest_verified_checkpoint(out) == str(out / "checkpoint-2")


def test_a_periodic_save_is_committed_without_a_request_id(
    driver: Driver, agent: FakeAgent
) -> None:
    driver.step(periodic_save=True)
    driver.end()
    committed = [h for h in agent.drain() if h.event == "checkpoint_committed"]
    assert [(h.event_data["step"], h.event_data["request_id"]) for h in committed] == [(1, None)]


@pytest.mark.parametrize(
    ("action", "saves"),
    [("stop", False), ("checkpoint_stop", True)],
    ids=["stop-without-save", "checkpoint-then-stop"],
)
def test_a_stop_request_stops_training_after_the_save_it_asks_for(
    driver: Driver, agent: FakeAgent, action: str, saves: bool
) -> None:
    driver.send(action, "req-stop")
    control = driver.step()
    assert control.should_training_stop
    driver.end()
    hbs = agent.drain()
    stops = [h for h in hbs if h.event == "stop"]
    assert [(h.event_data["reason"], h.step) for h in stops] == [(action, 1)]
    assert stops[0].phase == "stopping"
    assert bool([h for h in hbs if h.event == "checkpoint_committed"]) is saves


def test_sigterm_saves_then_stops_at_the_next_step(driver: Driver, agent: FakeAgent) -> None:
    driver.step()
    driver.cb.signals.on_sigterm(signal.SIGTERM, None)
    saves: list[bool] = []
    original = driver.save

    def save() -> Path:
        saves.append(True)
        return original()

    driver.save = save  # type: ignore[method-assign]
    control = driver.step()
    assert control.should_training_stop and saves == [True]
    driver.end()
    hbs = agent.drain()
    assert [h.event_data["reason"] for h in hbs if h.event == "stop"] == ["sigterm"]
    committed = [h for h in hbs if h.event == "checkpoint_committed"]
    assert [(h.event_data["step"], h.event_data["request_id"]) for h in committed] == [(2, None)]


def test_nan_policy_stop_stops_every_rank_at_the_step_without_saving_it(
    agent: FakeAgent, tmp_path: Path
) -> None:
    d = Driver(tmp_path / "out", nan_policy="stop")
    d.step()
    d.send("checkpoint", "req-nan")
    control = d.step(loss=math.nan)
    assert control.should_training_stop and not control.should_save
    d.end()
    hbs = agent.drain()
    assert [h.step for h in hbs if h.event == "nan_loss"] == [2]
    assert [h.event_data["reason"] for h in hbs if h.event == "stop"] == ["nan"]
    failed = [h for h in hbs if h.event == "checkpoint_failed"]
    assert [(h.event_data["reason"], h.event_data["request_id"]) for h in failed] == [
        ("nonfinite_state", "req-nan")
    ]
    assert not [h for h in hbs if h.event == "checkpoint_committed"]


def test_nan_policy_continue_reports_and_trains_on_but_never_saves_a_nonfinite_state(
    driver: Driver, agent: FakeAgent
) -> None:
    control = driver.step(loss=math.inf, periodic_save=True)
    assert not control.should_training_stop and not control.should_save
    control = driver.step()
    assert not control.should_training_stop
    driver.end()
    hbs = agent.drain()
    assert [h.step for h in hbs if h.event == "nan_loss"] == [1]
    assert not [h for h in hbs if h.event in ("checkpoint_committed", "stop")]


def test_rollback_is_refused_naming_the_restart_that_replaces_it() -> None:
    with pytest.raises(ValueError, match="newest_verified_checkpoint"):
        TrainguardCallback(nan_policy="rollback")  # type: ignore[arg-type]


def test_a_resumed_run_reports_the_checkpoint_it_continues_from(
    agent: FakeAgent, tmp_path: Path
) -> None:
    d = Driver(tmp_path / "out")
    d.state.global_step = 20  # the Trainer loaded checkpoint-20
    d.step()
    d.end()
    train = [h for h in agent.drain() if h.phase == "train"]
    assert train[0].step == 21 and train[0].ckpt_step == 20


def test_the_newest_checkpoint_that_verifies_is_chosen_and_a_corrupt_one_skipped(
    driver: Driver, caplog: pytest.LogCaptureFixture
) -> None:
    for _ in range(3):
        driver.send("checkpoint", f"req-{driver.state.global_step}")
        driver.step()
    out = Path(driver.args.output_dir)
    newest = out / "checkpoint-3"
    data = bytearray((newest / "model.safetensors").read_bytes())
    data[3] ^= 0xFF
    (newest / "model.safetensors").write_bytes(bytes(data))
    (out / "checkpoint-2" / CHECKSUMS_NAME).unlink()  # a save that never finished
    (out / "checkpoint-9").mkdir()  # no files at all
    with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
        assert newest_verified_checkpoint(out) == str(out / "checkpoint-1")
    skipped = [r.getMessage() for r in caplog.records if "checkpoint_skipped" in r.getMessage()]
    assert len(skipped) == 3
    assert "sha256_mismatch" in skipped[1] and "model.safetensors" in skipped[1]
    assert verify_checkpoint(out / "checkpoint-1") is None
    recorded = json.loads((out / "checkpoint-1" / CHECKSUMS_NAME).read_text())
    assert sorted(recorded["files"]) == ["model.safetensors", "trainer_state.json"]


def test_no_checkpoint_means_a_fresh_start(tmp_path: Path) -> None:
    assert newest_verified_checkpoint(tmp_path / "missing") is None
    assert newest_verified_checkpoint(tmp_path) is None
