"""RNG capture/restore, tensor split/fill, host snapshots, and the storable-state check."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from trainguard.trainer.state import (
    SnapshotPool,
    capture_rng,
    check_storable,
    fill_tensors,
    restore_rng,
    split_tensors,
)


def draw() -> tuple[float, float, float, float]:
    return random.random(), random.gauss(0, 1), float(np.random.rand()), float(torch.rand(1))


def test_restored_rng_replays_every_generator() -> None:
    random.gauss(0, 1)  # leaves a cached gauss value in the python state
    np.random.standard_normal()
    state = capture_rng()
    first = [draw() for _ in range(3)]
    restore_rng(state)
    assert [draw() for _ in range(3)] == first


def test_rng_state_survives_weights_only_load() -> None:
    state = capture_rng()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    first = draw()
    restore_rng(loaded)
    assert draw() == first


def test_split_and_fill_round_trip() -> None:
    obj = {
        "model": {"w": torch.ones(2)},
        "optim": {
            "state": {0: {"step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
    }
    flat, skeleton = split_tensors(obj)
    assert set(flat) == {"/model/w", "/optim/state/0/step"}
    back = fill_tensors(skeleton, flat)
    assert back["optim"]["param_groups"] == [{"lr": 0.1, "params": [0]}]
    assert back["model"]["w"] is flat["/model/w"]


def test_snapshot_is_a_copy_and_reuses_buffers() -> None:
    pool = SnapshotPool()
    t = torch.arange(4.0)
    s1 = pool.snapshot({"a": t, "n": 3})
    t.add_(1)
    assert s1["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and s1["n"] == 3
    s2 = pool.snapshot({"a": t, "n": 3})
    assert s2["a"].data_ptr() == s1["a"].data_ptr(), "buffers are reused between snapshots"
    assert s2["a"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert pool.bytes == 16


def test_unstorable_state_is_named() -> None:
    check_storable({"a": [1, 2.0, "x", None, torch.zeros(1)]})
    with pytest.raises(TypeError, match=r"extra\.thing\[1\]: object cannot be checkpointed"):
        check_storable({"extra": {"thing": [1, object()]}})
