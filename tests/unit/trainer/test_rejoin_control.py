"""In-process rejoin driven through the control socket: a rank's `rejoin` Control is kept until
the rank waits for it (the newest epoch wins; one not newer than the rank's is ignored, with a
log line), a rank 0 whose membership says `host_store` runs the new world's store itself (one
and two ranks, no store outside them), the heartbeats after a rejoin name the new epoch, a
renumbered rank reads its new rank's data, and with NCCL the old communicators are aborted
before the world is left (torch faked at its API edge: no GPU here)."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils.data import DistributedSampler, TensorDataset

from tests.helpers import free_port
from tests.unit.trainer.trainer_helpers import FakeAgent
from trainguard.membership import Membership
from trainguard.protocol import Control, encode_json
from trainguard.trainer import ResumableSampler, Trainguard
from trainguard.trainer.membership_inbox import MembershipInbox
from trainguard.trainer.rejoin import RejoinFailed, join_world, leave_world

REPO = Path(__file__).resolve().parents[3]


def membership(port: int = 29500, **kw: object) -> Membership:
    fields: dict[str, object] = {
        "rank": 0,
        "world_size": 1,
        "store_host": "127.0.0.1",
        "store_port": port,
        "epoch": 2,
        "timeout_s": 20.0,
    }
    fields.update(kw)
    return Membership(**fields)  # type: ignore[arg-type]


def rejoin(m: Membership, *, rid: str = "rejoin-1", job: str = "unit") -> Control:
    return Control(action="rejoin", request_id=rid, job=job, membership=m.to_json())


@pytest.fixture
def world() -> Iterator[None]:
    yield
    leave_world()


# --- the inbox ----------------------------------------------------------------------------


def test_a_rejoin_that_arrives_before_the_loss_is_kept_and_other_controls_pass_on() -> None:
    inbox = MembershipInbox(job="unit", rank=lambda: 1, epoch=lambda: 1)
    ckpt = Control(action="checkpoint", request_id="c-1")
    stop = Control(action="stop", request_id="s-1")
    assert inbox.sort([ckpt, rejoin(membership(epoch=2)), stop]) == [ckpt, stop]
    assert inbox.sort([]) == []  # later polls bring nothing: the membership is still here
    assert inbox.take() == membership(epoch=2)
    assert inbox.take() is None


def test_the_newest_epoch_wins_and_a_stale_one_is_ignored_with_a_log_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rank_epoch = [2]
    inbox = MembershipInbox(job="unit", rank=lambda: 0, epoch=lambda: rank_epoch[0])
    with caplog.at_level(logging.INFO, logger="trainguard.trainer"):
        inbox.sort([rejoin(membership(epoch=2), rid="same")])
        assert inbox.pending is None
        assert "request_id=same epoch=2 rank_epoch=2 reason=not_newer_than_rank" in caplog.text
        inbox.sort([rejoin(membership(epoch=4), rid="four"), rejoin(membership(epoch=3))])
        assert "epoch=3 rank_epoch=2 reason=older_than_pending" in caplog.text
        again = membership(epoch=4, rank=1, world_size=2)
        inbox.sort([rejoin(again, rid="four-again")])  # of one epoch, the last received
        assert "request_id=four epoch=4 rank_epoch=2 reason=superseded" in caplog.text
        assert inbox.pending == again
        rank_epoch[0] = 4  # the rank rejoined epoch 4 meanwhile (from elsewhere)
        assert inbox.take() is None
        assert "request_id=four-again epoch=4 rank_epoch=4 reason=not_newer_than_rank" in (
            caplog.text
        )


def test_an_unfenced_rank_takes_any_membership_and_another_jobs_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inbox = MembershipInbox(job="unit", rank=lambda: 0, epoch=lambda: None)
    with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
        inbox.sort([rejoin(membership(epoch=0), job="other")])
    assert inbox.pending is None
    assert "other_job=other action=rejoin" in caplog.text
    inbox.sort([rejoin(membership(epoch=0), job="")])  # no job named: this rank's
    assert inbox.take() == membership(epoch=0)


# --- a rank waits on its control socket ---------------------------------------------------


def send(path: str, control: Control) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(encode_json(control), path)


def build(tmp_path: Path, *, epoch: int | None) -> tuple[Trainguard, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tg = Trainguard(model=model, optimizer=opt, ckpt_dir=tmp_path / "ck", epoch=epoch,
                    handle_sigterm=False)  # fmt: skip
    return tg, model


def train(tg: Trainguard, model: torch.nn.Module, steps: range) -> None:
    opt = tg.state.optimizer
    assert opt is not None
    for step in steps:
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        tg.step(step)


def test_a_rank_0_that_hosts_the_store_rejoins_through_its_control_socket(
    tmp_path: Path, agent: FakeAgent, world: None
) -> None:
    # The only store of either world is this rank's own. The new world's is on another port:
    # once torch's compiler stack is imported (any optimizer does it) torch keeps the old
    # world's store alive in the process, still listening.
    old_port, port = free_port(), free_port()
    join_world(membership(old_port, epoch=1, host_store=True))
    tg, model = build(tmp_path, epoch=1)
    tg.resume()
    train(tg, model, range(3))
    socket_path = tg.channel.control_socket
    assert socket_path is not None
    send(socket_path, rejoin(membership(port, epoch=2, host_store=True)))
    train(tg, model, range(3, 4))  # polled at this step: before any loss, and kept
    assert tg.inbox.pending == membership(port, epoch=2, host_store=True)
    send(socket_path, Control(action="checkpoint", request_id="c-9"))  # read while waiting

    m = tg.wait_membership(timeout_s=10)
    assert (m.epoch, m.host_store) == (2, True)
    assert ("checkpoint", "c-9") in tg.agreement.pending  # kept for the new world
    weights = model.weight.detach().clone()
    assert tg.rejoin(m) == 4
    assert torch.equal(model.weight, weights)
    train(tg, model, range(4, 5))
    tg.close()
    beats = agent.drain()
    assert {h.epoch for h in beats if h.step <= 3} == {1}
    first = next(h for h in beats if h.step == 4 and h.phase == "train")
    assert (first.epoch, first.rank, first.world_size) == (2, 0, 1)
    assert any(h.event == "checkpoint_committed" and h.step == 4 for h in beats)


def test_no_rejoin_control_within_the_timeout_is_a_failed_rejoin(
    tmp_path: Path, agent: FakeAgent
) -> None:
    tg, _ = build(tmp_path, epoch=None)
    try:
        with pytest.raises(RejoinFailed, match=r"no rejoin Control on .* within 0 s"):
            tg.wait_membership(timeout_s=0.2)
    finally:
        tg.close()


def test_rank_0_of_a_two_rank_world_runs_its_store_with_none_outside(world: None) -> None:
    port = free_port()
    peer = membership(port, rank=1, world_size=2, epoch=5)
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.unit.trainer.rejoin_peer", peer.to_json()],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        join_world(membership(port, rank=0, world_size=2, epoch=5, host_store=True))
        t = torch.tensor([1.0])
        dist.all_reduce(t)
        assert t.item() == 3.0
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert child.returncode == 0, out.decode()
    assert "sum=3 rank=1 world_size=2" in out.decode()


# --- a renumbered rank --------------------------------------------------------------------


def test_a_renumbered_rank_reads_its_new_ranks_data_from_the_same_position() -> None:
    ds = TensorDataset(torch.arange(40.0))

    def sampler(rank: int, world_size: int) -> ResumableSampler:
        inner = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=3)
        return ResumableSampler(inner, batch_size=2)

    survivor, reference = sampler(1, 2), sampler(0, 2)
    for s in (survivor, reference):
        s.mark_step(3)
    survivor.set_world(rank=0, world_size=2)
    assert list(survivor) == list(reference)
    alone = sampler(1, 2)
    alone.mark_step(3)
    alone.set_world(rank=0, world_size=1)  # no replacement: the epoch's rest, on one rank
    assert alone.samples_done == 12
    order = torch.randperm(40, generator=torch.Generator().manual_seed(3)).tolist()
    assert list(alone) == order[12:]


# --- NCCL: the communicators are aborted before the world is left --------------------------


class FakeWorld:
    """torch.distributed as a rank of an NCCL world sees it, at the functions leave_world
    calls; records what was called."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, backend: str = "nccl") -> None:
        self.calls: list[str] = []
        self.initialized = True
        self.release = threading.Event()
        self.release.set()
        monkeypatch.setattr(dist, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
        monkeypatch.setattr(dist, "destroy_process_group", self.destroy)
        monkeypatch.setattr(c10d, "_abort_process_group", self.abort)

    def abort(self, group: object = None) -> None:
        self.calls.append("abort")
        self.release.wait(30)
        self.initialized = False  # torch forgets the world after aborting it

    def destroy(self, group: object = None) -> None:
        self.calls.append("destroy")
        self.initialized = False


def test_with_nccl_the_communicators_are_aborted_before_the_world_is_left(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeWorld(monkeypatch)
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu128")
    with caplog.at_level(logging.INFO, logger="trainguard.trainer"):
        leave_world(abort_timeout_s=10)
    assert fake.calls == ["abort"]
    assert "event=world_aborted backend=nccl api=abort_process_group" in caplog.text


def test_gloo_is_destroyed_without_an_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeWorld(monkeypatch, backend="gloo")
    leave_world(abort_timeout_s=10)
    assert fake.calls == ["destroy"]


def test_an_abort_that_hangs_is_a_failed_rejoin_within_its_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeWorld(monkeypatch)
    fake.release.clear()
    try:
        with pytest.raises(RejoinFailed, match="aborting the NCCL communicators took over"):
            leave_world(abort_timeout_s=0.2)
    finally:
        fake.release.set()
    assert fake.calls == ["abort"]


def test_an_older_torch_shuts_each_nccl_backend_down_then_destroys_the_world(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeWorld(monkeypatch)
    monkeypatch.setattr(torch, "__version__", "2.5.1")

    class FakeNccl:
        def _shutdown(self) -> None:
            fake.calls.append("shutdown")

    class Group:
        def __init__(self, backend: FakeNccl | None) -> None:
            self.backend = backend

        def _get_backend(self, device: torch.device) -> FakeNccl:
            assert device.type == "cuda"
            if self.backend is None:
                raise RuntimeError("no backend for device cuda")  # a gloo-only group
            return self.backend

    class World:
        pg_names = {Group(FakeNccl()): "0", Group(None): "1"}

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNccl, raising=False)
    monkeypatch.setattr(c10d, "_world", World())
    leave_world(abort_timeout_s=10)
    assert fake.calls == ["shutdown", "destroy"]
