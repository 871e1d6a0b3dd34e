"""A tiny deterministic training job and a fake agent socket for trainer-library tests."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.helpers import wait_for
from trainguard.protocol import Heartbeat, decode_json
from trainguard.trainer import ResumableSampler, Trainguard


class TinyJob:
    """MLP with dropout on a shuffled, resumable sampler; `run()` returns {step: loss}."""

    def __init__(self, seed: int = 0, *, init_seed: int | None = None) -> None:
        torch.manual_seed(seed if init_seed is None else init_seed)
        random.seed(seed)
        np.random.seed(seed)
        self.model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.2), nn.Linear(16, 3))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.9)
        g = torch.Generator().manual_seed(123)
        data = TensorDataset(
            torch.randn(64, 4, generator=g), torch.randint(0, 3, (64,), generator=g)
        )
        inner = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=seed)
        self.sampler = ResumableSampler(inner, batch_size=4)
        self.loader = DataLoader(
            data,
            batch_size=4,
            sampler=self.sampler,
            drop_last=True,
            generator=torch.Generator().manual_seed(0),
        )

    def guard(self, ckpt_dir: Path, **kw: Any) -> Trainguard:
        kw.setdefault("handle_sigterm", False)
        return Trainguard(
            model=self.model,
            optimizer=self.opt,
            scheduler=self.sched,
            sampler=self.sampler,
            ckpt_dir=ckpt_dir,
            **kw,
        )

    def train_step(self, batches: Iterator[Any]) -> torch.Tensor:
        x, y = next(batches)
        self.opt.zero_grad()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.sched.step()
        return loss

    def run(self, tg: Trainguard, start: int, end: int, **step_kw: Any) -> dict[int, float]:
        losses: dict[int, float] = {}
        batches = self.sampler.batches(self.loader)
        step = start
        while step <= end:
            loss = self.train_step(batches)
            losses[step] = loss.item()
            action = tg.step(step, loss=loss, **step_kw)
            if action.stop:
                break
            if action.rollback:
                assert action.next_step is not None
                step = action.next_step
                batches = self.sampler.batches(self.loader)
                continue
            step += 1
        return losses


class FakeAgent:
    """A real unix datagram socket where the trainer sends heartbeats.

    A thread drains it continuously, as the real agent does: an unread unix datagram queue
    holds only ~10 messages, after which the (non-blocking) sender drops.
    """

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "hb.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.05)
        self.received: list[Heartbeat] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                raw = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            hb = decode_json(Heartbeat, raw)
            with self._lock:
                self.received.append(hb)

    def heartbeats(self) -> list[Heartbeat]:
        """Everything received so far."""
        with self._lock:
            return list(self.received)

    def drain(self) -> list[Heartbeat]:
        """Everything received, once the trainer's final "exit" heartbeat is in (AssertionError
        if it has not come within 10 s)."""

        def exited() -> bool:
            with self._lock:
                return any(h.event == "exit" for h in self.received)

        wait_for(exited, timeout_s=10, what='the trainer\'s "exit" heartbeat', interval_s=0.01)
        with self._lock:
            return list(self.received)

    def events(self, name: str) -> list[Heartbeat]:
        return [h for h in self.drain() if h.event == name]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
