"""Trainguard in one process: resume, heartbeats, requests, NaN policies, SIGTERM, failures.

Real files, real unix datagram sockets, a real (tiny) torch model; no mocks.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
from pathlib import Path

import pytest
import torch

from tests.unit.trainer.trainer_helpers import FakeAgent, TinyJob
from trainguard.protocol import Control, encode_json
from trainguard.trainer import ChaosSpecError, Trainguard
from trainguard.trainer.checkpoint import load_rank_file, read_tensor_file
from trainguard.trainer.manifest import find_latest_good, list_committed, read_manifest
from trainguard.trainer.state import fill_tensors


def send_control(tg: Trainguard, action: str, request_id: str) -> None:
    assert tg.channel.control_socket is not None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        s.sendto(
            encode_json(Control(action=action, request_id=request_id)),  # type: ignore[arg-type]
            tg.channel.control_socket,
        )
    finally:
        s.close()


def test_resume_reproduces_every_later_loss_bitwise(tmp_path: Path) -> None:
    straight = TinyJob()
    tg = straight.guard(tmp_path / "a", checkpoint_every=10)
    assert tg.resume(first_step=1) == 1
    expected = straight.run(tg, 1, 25)
    tg.close()

    interrupted = TinyJob()
    tg = interrupted.guard(tmp_path / "b", checkpoint_every=10)
    interrupted.run(tg, tg.resume(first_step=1), 14)
    tg.close()

    resumed = TinyJob(init_seed=99)  # other initial weights: everything must come from disk
    tg = resumed.guard(tmp_path / "b", checkpoint_every=10)
    start = tg.resume(first_step=1)
    assert start == 11
    got = resumed.run(tg, start, 25)
    tg.close()
    assert got == {s: expected[s] for s in range(11, 26)}


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=5)
    job.run(tg, 1, 10)
    tg.close()
    shard = tmp_path / "step_000010" / "rank_00000.pt"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    tg = TinyJob().guard(tmp_path, checkpoint_every=5)
    with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
        assert tg.resume() == 6
    tg.close()
    assert any(
        "checkpoint_skipped" in r.getMessage() and str(shard) in r.getMessage()
        for r in caplog.records
    )


def test_checkpoint_holds_full_state_loadable_with_weights_only(tmp_path: Path) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=5, extra={"counter": torch.nn.Linear(1, 1)})
    job.run(tg, 1, 5)
    tg.close()
    m = read_manifest(tmp_path / "step_000005")
    assert (m.step, m.world_size, m.format, m.loss_finite) == (5, 1, "tensors", True)
    assert set(m.files) == {"rank_00000.pt", "tensors_00000.bin"}
    state = load_rank_file(tmp_path / "step_000005" / "rank_00000.pt")
    assert set(state) >= {"skeleton", "tensor_index", "scheduler", "sampler", "rng", "extra"}
    full = load_full_state(tmp_path / "step_000005")
    assert set(full["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert len(full["optim"]["state"]) == 4
    assert state["sampler"]["epoch"] == 0 and state["sampler"]["batches_done"] == 5
    assert state["sampler"]["samples_done"] == 5 * 4  # the position in samples too
    assert state["scheduler"]["last_epoch"] == 5
    assert isinstance(state["rng"]["torch"], torch.Tensor)


def test_heartbeats_carry_steps_events_and_committed_checkpoint(
    tmp_path: Path, agent: FakeAgent
) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=5)
    job.run(tg, 1, 8, samples=4, tokens=40)
    tg.close()
    hbs = agent.drain()
    assert hbs[0].phase == "init"
    train = [h for h in hbs if h.phase == "train"]
    assert [h.step for h in train if h.event is None][:3] == [1, 2, 3]
    assert all(h.job == "unit" and h.rank == 0 and h.world_size == 1 for h in hbs)
    assert all(h.control_socket == tg.channel.control_socket for h in train)
    assert all(h.loss is not None and math.isfinite(h.loss) for h in train)
    assert any(h.samples_per_s and h.tokens_per_s for h in train)
    committed = [h for h in hbs if h.event == "checkpoint_committed"]
    assert len(committed) == 1
    assert committed[0].event_data["step"] == 5
    assert committed[0].event_data["path"].endswith("step_000005")
    last = hbs[-1]
    assert (last.event, last.phase, last.ckpt_step, last.step) == ("exit", "exit", 5, 8)
    assert not Path(str(tg.channel.control_socket)).exists()


def test_a_run_resumed_at_its_end_reports_the_checkpoints_step_not_0(
    tmp_path: Path, agent: FakeAgent
) -> None:
    # a restart that finds the job done (its last checkpoint at its last step) trains no
    # step: its exit heartbeat still names where the job stands (the controller's last_step)
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=8)
    job.run(tg, 1, 8)
    tg.close()
    again = TinyJob().guard(tmp_path, checkpoint_every=8)
    assert again.resume() == 9
    again.close()
    last = agent.drain()[-1]
    assert (last.event, last.step, last.ckpt_step) == ("exit", 8, 8)


def test_requested_checkpoint_commits_at_this_step_and_reports_its_id(
    tmp_path: Path, agent: FakeAgent
) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=0)
    batches = job.sampler.batches(job.loader)
    for step in range(1, 4):
        tg.step(step, loss=job.train_step(batches))
    send_control(tg, "checkpoint", "req-7")
    action = tg.step(4, loss=job.train_step(batches))
    assert action.checkpoint_started and action.request_id == "req-7" and not action.stop
    send_control(tg, "checkpoint", "req-7")  # a re-delivered request is not acted on twice
    assert not tg.step(5, loss=job.train_step(batches)).checkpoint_started
    tg.close()
    assert [s for s, _ in list_committed(tmp_path)] == [4]
    assert read_manifest(tmp_path / "step_000004").request_id == "req-7"
    assert agent.drain()[-1].ckpt_request_id == "req-7"


@pytest.mark.parametrize(
    ("action", "committed"),
    [("checkpoint_stop", [3]), ("stop", [])],
    ids=["checkpoint_stop", "stop"],
)
def test_stop_requests_stop_the_loop_after_their_checkpoint(
    tmp_path: Path, agent: FakeAgent, action: str, committed: list[int]
) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path)
    batches = job.sampler.batches(job.loader)
    tg.step(1, loss=job.train_step(batches))
    tg.step(2, loss=job.train_step(batches))
    send_control(tg, action, "req-s")
    got = tg.step(3, loss=job.train_step(batches))
    assert got.stop and got.reason == action
    # For checkpoint_stop the commit has happened before step() returned.
    assert tg.ckpt_step == (3 if committed else None)
    tg.close()
    assert [s for s, _ in list_committed(tmp_path)] == committed
    stops = agent.events("stop")
    assert len(stops) == 1 and stops[0].event_data["request_id"] == "req-s"


def load_full_state(path: Path) -> dict:
    state = load_rank_file(path / "rank_00000.pt")
    flat = read_tensor_file(path / "tensors_00000.bin", state["tensor_index"])
    return fill_tensors(state["skeleton"], flat)


def _all_finite(path: Path) -> bool:
    state = load_full_state(path)
    tensors = list(state["model"].values())
    for s in state["optim"]["state"].values():
        tensors += [t for t in s.values() if isinstance(t, torch.Tensor)]
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def test_nan_rollback_restores_the_last_good_state_and_skips_batches(
    tmp_path: Path, agent: FakeAgent
) -> None:
    job = TinyJob()
    tg = job.guard(
        tmp_path,
        checkpoint_every=5,
        keep_last=0,
        nan_policy="rollback",
        skip_batches=2,
        chaos="nan@step7",
    )
    job.run(tg, 1, 12)
    tg.close()
    nan_events = agent.events("nan_loss")
    assert [h.event_data["step"] for h in nan_events] == [7]
    rollbacks = agent.events("nan_rollback")
    assert [(h.event_data["to_step"], h.event_data["skip_batches"]) for h in rollbacks] == [(5, 2)]
    steps = [s for s, _ in list_committed(tmp_path)]
    assert steps == [10, 5]
    assert all(_all_finite(tmp_path / f"step_{s:06d}") for s in steps)
    # Position after step 10 = 10 steps + 2 skipped batches since the rollback.
    state = load_rank_file(tmp_path / "step_000010" / "rank_00000.pt")
    assert (state["sampler"]["epoch"], state["sampler"]["batches_done"]) == (0, 12)


def test_nan_continue_reports_and_never_commits_a_nonfinite_state(
    tmp_path: Path, agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=5, chaos="nan@step4")
    with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
        losses = job.run(tg, 1, 11)
    tg.close()
    assert math.isnan(losses[6])  # the poisoned weights really are non-finite
    assert list_committed(tmp_path) == []
    assert len(agent.events("nan_loss")) >= 2
    assert any("reason=nonfinite_state" in r.getMessage() for r in caplog.records)


def test_nan_stop_policy_stops_the_loop(tmp_path: Path) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, nan_policy="stop")
    batches = job.sampler.batches(job.loader)
    assert not tg.step(1, loss=job.train_step(batches)).stop
    action = tg.step(2, loss=float("inf"))
    assert action.stop and action.reason == "nan"
    tg.close()


def test_grad_norm_spike_is_reported_and_skips_the_checkpoint(
    tmp_path: Path, agent: FakeAgent
) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=10, grad_spike_factor=5.0)
    batches = job.sampler.batches(job.loader)
    for step in range(1, 10):
        tg.step(step, loss=job.train_step(batches), grad_norm=1.0 + step / 100)
    tg.step(10, loss=job.train_step(batches), grad_norm=50.0)
    tg.close()
    spikes = agent.events("grad_norm_spike")
    assert [h.event_data["step"] for h in spikes] == [10]
    assert list_committed(tmp_path) == []


def test_sigterm_takes_an_emergency_checkpoint_then_stops(tmp_path: Path, agent: FakeAgent) -> None:
    before = signal.getsignal(signal.SIGTERM)
    job = TinyJob()
    tg = job.guard(tmp_path, handle_sigterm=True, sigterm_hard_exit=False, sigterm_grace_s=60)
    batches = job.sampler.batches(job.loader)
    tg.step(1, loss=job.train_step(batches))
    os.kill(os.getpid(), signal.SIGTERM)
    action = tg.step(2, loss=job.train_step(batches))
    assert action.stop and action.reason == "sigterm"
    assert tg.ckpt_step == 2
    tg.close()
    assert signal.getsignal(signal.SIGTERM) == before, "the previous handler is restored"
    assert [s for s, _ in list_committed(tmp_path)] == [2]


def test_failed_background_write_is_reported_and_never_becomes_latest(
    tmp_path: Path, agent: FakeAgent
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "ckpt"
    link.symlink_to(real)
    job = TinyJob()
    tg = job.guard(link, checkpoint_every=5)
    batches = job.sampler.batches(job.loader)
    for step in range(1, 6):
        tg.step(step, loss=job.train_step(batches))
    assert tg.checkpoints.writer.wait(30)
    real.rename(tmp_path / "moved")  # the checkpoint directory vanishes under the job
    for step in range(6, 11):
        tg.step(step, loss=job.train_step(batches))
    tg.close()
    failed = agent.events("checkpoint_failed")
    assert [h.event_data["step"] for h in failed] == [10]
    assert failed[0].event_data["reason"]
    assert tg.ckpt_step == 5
    found = find_latest_good(tmp_path / "moved")
    assert found is not None and found[0] == 5


def test_unstorable_user_state_reports_a_failed_checkpoint_without_raising(
    tmp_path: Path, agent: FakeAgent
) -> None:
    class Odd:
        def state_dict(self) -> object:
            return {"when": object()}

        def load_state_dict(self, s: object) -> None:
            pass

    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=2, extra={"odd": Odd()})
    job.run(tg, 1, 2)
    tg.close()
    failed = agent.events("checkpoint_failed")
    assert failed and "extra.odd.when" in failed[0].event_data["reason"]
    assert list_committed(tmp_path) == []


def test_a_second_save_waits_for_the_first_and_never_runs_alongside_it(
    tmp_path: Path, agent: FakeAgent
) -> None:
    job = TinyJob()
    # The step-2 writer pauses forever mid-write; the step-4 save must not start beside it.
    tg = job.guard(
        tmp_path, checkpoint_every=2, chaos="pause_write@step2", checkpoint_timeout_s=0.2
    )
    job.run(tg, 1, 4)
    tg.close()
    failed = agent.events("checkpoint_failed")
    assert [(h.event_data["step"], h.event_data["reason"]) for h in failed] == [
        (4, "previous_save_still_running")
    ]
    assert list_committed(tmp_path) == []


def test_runs_normally_without_an_agent(tmp_path: Path) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=3)
    job.run(tg, 1, 6)
    tg.close()
    assert tg.channel.sent == 0 and tg.channel.dropped > 0
    assert [s for s, _ in list_committed(tmp_path)] == [6, 3]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"checkpoint_every": -1}, "checkpoint_every"),
        ({"keep_last": -2}, "keep_last"),
        ({"nan_policy": "ignore"}, "nan_policy"),
        ({"skip_batches": 3}, "skip_batches only applies"),
        ({"sync_every": 0}, "sync_every"),
        ({"grad_spike_factor": 0.5}, "grad_spike_factor"),
        ({"sigterm_grace_s": 0}, "sigterm_grace_s"),
    ],
    ids=[
        "negative-every",
        "negative-keep",
        "unknown-policy",
        "skip-without-rollback",
        "zero-sync",
        "spike-factor",
        "zero-grace",
    ],
)
def test_bad_arguments_fail_with_a_clear_error(tmp_path: Path, kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        TinyJob().guard(tmp_path, **kwargs)


def test_bad_chaos_spec_fails_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_CHAOS", "nan@stepX")
    with pytest.raises(ChaosSpecError, match="nan@stepX"):
        TinyJob().guard(tmp_path)


def test_request_agreed_during_a_nan_rollback_is_honoured_after_it(
    tmp_path: Path, agent: FakeAgent
) -> None:
    job = TinyJob()
    tg = job.guard(
        tmp_path, checkpoint_every=5, keep_last=0, nan_policy="rollback", chaos="nan@step7"
    )
    batches = job.sampler.batches(job.loader)
    for step in range(1, 7):
        tg.step(step, loss=job.train_step(batches))
    send_control(tg, "checkpoint", "req-during-nan")
    action = tg.step(7, loss=job.train_step(batches))
    assert action.rollback and action.next_step == 6
    batches = job.sampler.batches(job.loader)
    action = tg.step(6, loss=job.train_step(batches))
    assert action.checkpoint_started and action.request_id == "req-during-nan"
    tg.close()
    assert read_manifest(tmp_path / "step_000006").request_id == "req-during-nan"
    assert _all_finite(tmp_path / "step_000006")
