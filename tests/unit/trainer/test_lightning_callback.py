"""`TrainguardCallback` in one process: Lightning's checkpoints committed with their checksums
(periodic and requested, reported to the agent), `resume_path()` skipping a corrupt one, a
stop request ending `fit` through `should_stop`, and the SIGTERM handler from before `fit`
back in place after it."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.protocol import Control, encode_json
from trainguard.trainer import ResumableSampler
from trainguard.trainer.manifest import list_committed, verify_dir

pl = pytest.importorskip("lightning.pytorch")
from trainguard.trainer.integrations.lightning import CKPT_FILE, TrainguardCallback  # noqa: E402


class Tiny(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Linear(4, 2)
        self.on_step: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.on_step is not None:
            self.on_step(self.global_step)
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(ckpt: Path, *, steps: int, **kw: Any) -> None:
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    sampler = ResumableSampler(DistributedSampler(data, num_replicas=1, rank=0), batch_size=4)
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)
    cb = TrainguardCallback(ckpt_dir=ckpt, sampler=sampler, handle_sigterm=True, **kw)
    model = Tiny()
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, callbacks=[cb], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, loader)


def test_periodic_checkpoints_commit_with_checksums_and_resume_skips_a_corrupt_one(
    tmp_path: Path, agent: FakeAgent
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    ck = tmp_path / "ck"
    fit(ck, steps=6, checkpoint_every=2, keep_last=0)
    assert signal.getsignal(signal.SIGTERM) is before
    assert [s for s, _ in list_committed(ck)] == [6, 4, 2]
    assert verify_dir(ck / "step_000006").format == "lightning"
    committed = [h.event_data["step"] for h in agent.drain() if h.event == "checkpoint_committed"]
    assert committed == [2, 4, 6]

    newest = ck / "step_000006" / CKPT_FILE
    newest.write_bytes(newest.read_bytes()[:-10] + b"0123456789")  # same size, other bytes
    cb = TrainguardCallback(ckpt_dir=ck)
    assert cb.resume_path() == str(ck / "step_000004" / CKPT_FILE)


def test_a_request_then_a_stop_request_end_fit_after_the_save(
    tmp_path: Path, agent: FakeAgent
) -> None:
    sent: list[int] = []

    def send_at(step: int) -> None:
        # requests reach the control socket while a step runs, as the agent's would
        heartbeats = agent.heartbeats()
        control = next((h.control_socket for h in heartbeats if h.control_socket), None)
        if control is None or step in sent:
            return
        sent.append(step)
        action = {3: "checkpoint", 6: "checkpoint_stop"}.get(step)
        if action is not None:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(encode_json(Control(action=action, request_id=f"r{step}")), control)

    ck = tmp_path / "ck"
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g))
    sampler = ResumableSampler(DistributedSampler(data, num_replicas=1, rank=0), batch_size=4)
    cb = TrainguardCallback(ckpt_dir=ck, sampler=sampler)
    model = Tiny()
    model.on_step = send_at
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=50, callbacks=[cb], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(model, DataLoader(data, batch_size=4, sampler=sampler, drop_last=True))
    assert trainer.global_step == 7
    assert [s for s, _ in list_committed(ck)] == [7, 4]
    events = {
        h.event_data.get("request_id"): h.event_data["step"]
        for h in agent.drain()
        if h.event == "checkpoint_committed"
    }
    assert events == {"r3": 4, "r6": 7}
