"""In-process rejoin, the parts one process can show: the membership's strict form, which
errors mean a lost peer, the guard that turns them into `PeerLost`, the membership handed
over a real TCPStore, and a one-rank world re-formed under the next epoch (the directory's
epoch follows; with no peer holding state, the checkpoint is loaded)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import free_port
from trainguard.membership import Membership
from trainguard.trainer import Trainguard
from trainguard.trainer.fence import StaleAttempt, check_epoch, read_epoch
from trainguard.trainer.rejoin import (
    PeerLossGuard,
    PeerLost,
    RejoinFailed,
    is_collective_failure,
    join_world,
    leave_world,
    publish_membership,
    wait_membership,
)

GLOO_RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:19374: "
    "Connection reset by peer. This is typically caused by a remote worker hanging"
)


def membership(port: int, **kw: object) -> Membership:
    fields: dict[str, object] = {
        "rank": 0,
        "world_size": 1,
        "store_host": "127.0.0.1",
        "store_port": port,
        "epoch": 1,
        "timeout_s": 20.0,
    }
    fields.update(kw)
    return Membership(**fields)  # type: ignore[arg-type]


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore(
        "127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=20),
        wait_for_workers=False,
    )  # fmt: skip
    yield server
    leave_world()


def test_membership_round_trips_through_json_and_refuses_unknown_keys() -> None:
    m = membership(29500, rank=1, world_size=3, epoch=7)
    assert Membership.from_json(m.to_json()) == m
    with pytest.raises(ValueError, match=r"unknown keys \['rnak'\]"):
        Membership.from_json(m.to_json().replace('"rank"', '"rnak"'))
    with pytest.raises(ValueError, match="not JSON"):
        Membership.from_json("{")
    with pytest.raises(ValueError, match="longer than 1024"):
        Membership.from_json(" " * 1025)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"rank": 2, "world_size": 2}, "rank must be in"),
        ({"epoch": -1}, r"epoch must be in \[0, "),
        ({"timeout_s": 0.0}, r"timeout_s must be in \(0, "),
        ({"timeout_s": float("nan")}, r"timeout_s must be in \(0, "),
        ({"backend": "mpi"}, "backend must be"),
        ({"rank": True}, "rank must be an integer"),
        ({"world_size": "2"}, "world_size must be an integer"),
        ({"store_host": ""}, "store_host must be"),
        ({"rank": 1, "world_size": 2, "host_store": True}, "host_store is for rank 0 only"),
    ],
    ids=[
        "rank-outside-world",
        "negative-epoch",
        "zero-timeout",
        "nan-timeout",
        "unknown-backend",
        "bool-rank",
        "string-world-size",
        "empty-host",
        "store-on-rank-1",
    ],
)
def test_membership_refuses_a_broken_invariant(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        membership(29500, **kw)


@pytest.mark.parametrize(
    ("exc", "lost"),
    [
        (RuntimeError(GLOO_RESET), True),
        (RuntimeError("Connection closed by peer [127.0.0.1]:5534"), True),
        (dist.DistBackendError("NCCL error"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (ValueError("Connection reset by peer"), False),
    ],
    ids=["gloo-reset", "gloo-closed", "dist-error", "shape-bug", "not-a-runtime-error"],
)
def test_only_a_broken_collective_counts_as_a_lost_peer(exc: BaseException, lost: bool) -> None:
    assert is_collective_failure(exc) is lost


def test_guard_turns_a_broken_collective_into_peer_lost_with_the_last_completed_step() -> None:
    completed = {"step": 11}
    held = torch.nn.Linear(2, 2)
    ref = weakref.ref(held)

    def failing_step(model: torch.nn.Module) -> None:
        completed["step"] = 12  # the step completed inside the guarded block
        raise RuntimeError(GLOO_RESET)

    with pytest.raises(PeerLost) as e:
        with PeerLossGuard(lambda: completed["step"]):
            failing_step(held)
    assert e.value.last_step == 12
    assert "Connection reset by peer" in e.value.cause
    # The old exception's frames are gone: they would keep the old world's objects alive.
    del held
    gc.collect()
    assert ref() is None


def test_guard_lets_a_bug_of_the_job_through() -> None:
    with pytest.raises(ValueError, match="shapes"):
        with PeerLossGuard(lambda: 3):
            raise ValueError("shapes")


def test_membership_is_handed_to_the_waiting_process_over_the_store(
    store: dist.TCPStore,
) -> None:
    m = membership(store.port, rank=1, world_size=2, epoch=4)
    publish_membership(store, job="j", pid=1234, membership=m)
    got = wait_membership(store_host="127.0.0.1", store_port=store.port, job="j", pid=1234,
                          timeout_s=10)  # fmt: skip
    assert got == m


def test_no_membership_within_the_timeout_is_a_failed_rejoin(store: dist.TCPStore) -> None:
    with pytest.raises(RejoinFailed, match="no membership"):
        wait_membership(store_host="127.0.0.1", store_port=store.port, job="j", pid=1,
                        timeout_s=0.2)  # fmt: skip


def build(tmp_path: Path, epoch: int) -> tuple[Trainguard, torch.nn.Module]:
    torch.manual_seed(epoch)  # each process has its own initial weights
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tg = Trainguard(model=model, optimizer=opt, ckpt_dir=tmp_path, epoch=epoch,
                    handle_sigterm=False, job="rejoin")  # fmt: skip
    return tg, model


def train(tg: Trainguard, model: torch.nn.Module, steps: range) -> None:
    opt = tg.state.optimizer
    assert opt is not None
    for step in steps:
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        tg.step(step)


def test_a_rank_rejoins_under_the_next_epoch_and_keeps_its_state(
    tmp_path: Path, store: dist.TCPStore
) -> None:
    join_world(membership(store.port, epoch=1))
    tg, model = build(tmp_path, epoch=1)
    assert tg.resume() == 0
    train(tg, model, range(3))
    weights = model.weight.detach().clone()
    with pytest.raises(ValueError, match="must be newer"):
        tg.rejoin(membership(store.port, epoch=1))
    assert tg.rejoin(membership(store.port, epoch=2)) == 3
    assert read_epoch(tmp_path) == 2
    with pytest.raises(StaleAttempt):  # what a commit of epoch 1 checks: refused
        check_epoch(tmp_path, 1)
    assert tg.epoch == 2
    assert torch.equal(model.weight, weights)
    train(tg, model, range(3, 4))
    assert tg.save(3, wait=True)
    tg.close()


def test_with_no_peer_holding_state_the_replacement_loads_the_checkpoint(
    tmp_path: Path, store: dist.TCPStore
) -> None:
    join_world(membership(store.port, epoch=1))
    tg, model = build(tmp_path, epoch=1)
    tg.resume()
    train(tg, model, range(3))
    assert tg.save(2, wait=True)
    saved = model.weight.detach().clone()
    tg.close()
    leave_world()

    join_world(membership(store.port, epoch=2))
    fresh, fresh_model = build(tmp_path, epoch=2)
    assert not torch.equal(fresh_model.weight, saved)
    assert fresh.join_from_peer() == 3
    assert torch.equal(fresh_model.weight, saved)
    fresh.close()
