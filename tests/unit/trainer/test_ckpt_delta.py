"""Incremental checkpoints: the delta encoding round-trips bit for bit, a chain of deltas
resumes to the exact state, a corrupt or missing base is passed over for the newest intact
checkpoint, and retention keeps every base a kept delta needs."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.unit.trainer.trainer_helpers import FakeAgent, TinyJob
from trainguard.trainer.checkpoint import SaveResult
from trainguard.trainer.checkpoint_manager import (
    CheckpointManager,
    CheckpointSettings,
    TrainState,
)
from trainguard.trainer.delta import DeltaStats, decode_tensor, encode_tensor
from trainguard.trainer.manifest import (
    delta_link,
    find_latest_good,
    list_committed,
    read_manifest,
    step_dir_name,
)
from trainguard.trainer.retention import CheckpointInfo, RetentionPolicy, Tier, select
from trainguard.trainer.s3 import S3Config
from trainguard.trainer.sync import LocalCoordinator


def _roundtrip(new: torch.Tensor, base: torch.Tensor | None) -> tuple[torch.Tensor, DeltaStats]:
    out = bytearray()

    def emit(data: bytes | memoryview) -> int:
        start = len(out)
        out.extend(data)
        return start

    nb = new.reshape(-1).view(torch.uint8).numpy()
    bb = base.reshape(-1).view(torch.uint8).numpy() if base is not None else None
    stats = DeltaStats()
    blocks = encode_tensor(nb, bb, itemsize=new.element_size(), emit=emit, stats=stats)
    got = torch.empty_like(new)
    decode_tensor(
        blocks,
        data=memoryview(bytes(out)),
        base=bb,
        nbytes=nb.size,
        itemsize=new.element_size(),
        out=got.reshape(-1).view(torch.uint8).numpy(),
    )
    stats.encoded_bytes = len(out)
    return got, stats


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.uint8], ids=str
)
def test_the_delta_encoding_reproduces_every_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    base = (torch.randn(3, 1_000_003, generator=g) * 100).to(dtype)  # > one 4 MiB chunk
    new = base.clone()
    new.view(-1)[::7] += torch.ones((), dtype=dtype)
    new.view(-1)[5] = base.view(-1)[6]
    got, _ = _roundtrip(new, base)
    assert torch.equal(got.view(torch.uint8), new.view(torch.uint8))
    got, _ = _roundtrip(new, None)  # no counterpart in the base: stored whole
    assert torch.equal(got.view(torch.uint8), new.view(torch.uint8))


def test_an_unchanged_tensor_encodes_to_almost_nothing() -> None:
    base = torch.randn(1 << 20)
    got, stats = _roundtrip(base.clone(), base)
    assert torch.equal(got, base)
    assert stats.encoded_bytes < stats.raw_bytes / 100


def test_a_truncated_block_list_is_refused() -> None:
    base = torch.randn(1000)
    out = bytearray()
    blocks = encode_tensor(
        (base + 1).view(torch.uint8).numpy(),
        base.view(torch.uint8).numpy(),
        itemsize=4,
        emit=lambda d: (out.extend(d), len(out) - len(d))[1],
        stats=DeltaStats(),
    )
    with pytest.raises(ValueError, match="fewer blocks"):
        decode_tensor(
            blocks[:-1],
            data=memoryview(bytes(out)),
            base=base.view(torch.uint8).numpy(),
            nbytes=4000,
            itemsize=4,
            out=np.empty(4000, dtype=np.uint8),
        )


# --- the manager: chains on disk ---------------------------------------------------------------


def manager(job: TinyJob, ckpt: Path, **settings: Any) -> tuple[CheckpointManager, list[Any]]:
    results: list[SaveResult] = []
    m = CheckpointManager(
        state=TrainState(model=job.model, optimizer=job.opt, scheduler=job.sched),
        settings=CheckpointSettings(ckpt_dir=ckpt, **settings),
        coordinator=LocalCoordinator(),
        job="unit",
        on_result=results.append,
    )
    return m, results


def train_and_save(job: TinyJob, m: CheckpointManager, steps: range) -> dict[int, Any]:
    """Train, saving after every step; returns each step's exact state."""
    batches = job.sampler.batches(job.loader)
    states: dict[int, Any] = {}
    for step in steps:
        job.train_step(batches)
        assert m.save(step)
        assert m.wait()
        m.collect()
        states[step] = copy.deepcopy((job.model.state_dict(), job.opt.state_dict()))
    return states


def assert_same_state(job: TinyJob, state: Any) -> None:
    model_sd, opt_sd = state
    for k, v in job.model.state_dict().items():
        assert torch.equal(v.view(torch.uint8), model_sd[k].view(torch.uint8)), k
    for pid, s in job.opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(opt_sd["state"][pid][k]))


def formats(ckpt: Path) -> dict[int, str]:
    return {step: read_manifest(path).format for step, path in list_committed(ckpt)}


def test_a_chain_resumes_every_checkpoint_bitwise(tmp_path: Path) -> None:
    job = TinyJob()
    m, results = manager(job, tmp_path, full_every=3, keep_last=0)
    states = train_and_save(job, m, range(1, 8))
    m.close()
    assert all(r.ok for r in results)
    assert [r.base_step for r in results] == [None, 1, 1, None, 4, 4, None]
    assert formats(tmp_path) == {
        1: "tensors", 2: "delta", 3: "delta", 4: "tensors", 5: "delta", 6: "delta", 7: "tensors"
    }  # fmt: skip
    link = delta_link(read_manifest(tmp_path / step_dir_name(6)))
    assert link is not None and (link.base_step, link.parent_step, link.index) == (4, 4, 2)
    for step in (2, 3, 5, 6):
        other = TinyJob(init_seed=99)
        loader, _ = manager(other, tmp_path, keep_last=0)
        loader.load(step, read_manifest(tmp_path / step_dir_name(step)))
        assert_same_state(other, states[step])
        loader.close()


def test_a_resumed_run_goes_on_with_the_chain_it_loaded(tmp_path: Path) -> None:
    job = TinyJob()
    m, _ = manager(job, tmp_path, full_every=3, keep_last=0)
    train_and_save(job, m, range(1, 3))  # 1 full, 2 delta
    m.close()
    m2, results = manager(job, tmp_path, full_every=3, keep_last=0)
    assert m2.restore_latest() is not None
    train_and_save(job, m2, range(3, 5))
    m2.close()
    assert [r.base_step for r in results] == [1, None]  # 3: the base's last delta, 4: full


def test_incremental_is_off_by_default(tmp_path: Path) -> None:
    job = TinyJob()
    m, _ = manager(job, tmp_path)
    train_and_save(job, m, range(1, 4))
    m.close()
    assert set(formats(tmp_path).values()) == {"tensors"}


def _corrupt(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_bad_base_falls_back_to_the_newest_intact_checkpoint(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    job = TinyJob()
    m, _ = manager(job, tmp_path, full_every=3, keep_last=0)
    states = train_and_save(job, m, range(1, 6))  # 1 full, 2-3 deltas, 4 full, 5 delta
    m.close()
    base = tmp_path / step_dir_name(4)
    if damage == "corrupt":
        _corrupt(base / "tensors_00000.bin")
    else:
        import shutil  # noqa: PLC0415 (test-local)

        shutil.rmtree(base)
    other = TinyJob(init_seed=7)
    loader, _ = manager(other, tmp_path, full_every=3, keep_last=0)
    with caplog.at_level(logging.INFO, logger="trainguard.trainer"):
        found = loader.restore_latest()
    assert found is not None and found[0] == 3  # the previous chain's newest delta
    assert_same_state(other, states[3])
    skipped = [s for s, _ in loader.skipped]
    assert skipped == ([5, 4] if damage == "corrupt" else [5])
    assert "base step 4" in loader.skipped[0][1].reason or "base" in loader.skipped[0][1].file
    assert any("event=checkpoint_fallback" in r.getMessage() for r in caplog.records)
    loader.close()


def test_a_corrupt_delta_loses_only_itself(tmp_path: Path) -> None:
    job = TinyJob()
    m, _ = manager(job, tmp_path, full_every=4, keep_last=0)
    states = train_and_save(job, m, range(1, 4))
    m.close()
    _corrupt(tmp_path / step_dir_name(3) / "delta_00000.bin")
    found = find_latest_good(tmp_path)
    assert found is not None and found[0] == 2
    other = TinyJob(init_seed=5)
    loader, _ = manager(other, tmp_path)
    loader.restore_latest()
    assert_same_state(other, states[2])
    loader.close()


def test_a_delta_whose_base_went_bad_is_written_full(tmp_path: Path) -> None:
    job = TinyJob()
    m, results = manager(job, tmp_path, full_every=5, keep_last=0)
    train_and_save(job, m, range(1, 3))
    _corrupt(tmp_path / step_dir_name(1) / "tensors_00000.bin")
    train_and_save(job, m, range(3, 5))
    m.close()
    assert [r.base_step for r in results] == [None, 1, None, 3]
    assert formats(tmp_path)[3] == "tensors"


def test_retention_keeps_the_base_of_every_kept_delta(tmp_path: Path) -> None:
    job = TinyJob()
    m, _ = manager(job, tmp_path, full_every=3, keep_last=1)
    train_and_save(job, m, range(1, 7))  # 4 full, 5 and 6 deltas of it
    m.close()
    assert sorted(formats(tmp_path)) == [4, 6]
    found = find_latest_good(tmp_path)
    assert found is not None and found[0] == 6


def test_select_holds_a_base_for_its_delta_and_nothing_else() -> None:
    infos = [
        CheckpointInfo(step=10, created_at=10.0),
        CheckpointInfo(step=20, created_at=20.0, base_step=10),
        CheckpointInfo(step=30, created_at=30.0),
        CheckpointInfo(step=40, created_at=40.0, base_step=30),
    ]
    tiers = select(
        policy=RetentionPolicy(recent_last=1), checkpoints=infos, now=50.0, newest_good_step=40
    )
    assert tiers == {40: (Tier.NEWEST, Tier.RECENT), 30: (Tier.BASE,), 20: (), 10: ()}


def test_settings_refuse_a_negative_full_every(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="full_every"):
        CheckpointSettings(ckpt_dir=tmp_path, full_every=-1)


def test_resume_past_a_bad_base_sends_a_fallback_event(tmp_path: Path, agent: FakeAgent) -> None:
    job = TinyJob()
    m, _ = manager(job, tmp_path / "ck", full_every=3, keep_last=0)
    train_and_save(job, m, range(1, 3))
    m.close()
    _corrupt(tmp_path / "ck" / step_dir_name(1) / "tensors_00000.bin")
    tg = TinyJob().guard(tmp_path / "ck")
    assert tg.resume(first_step=1) == 1
    tg.step(1, loss=torch.tensor(1.0))
    tg.close()
    events = agent.events("checkpoint_fallback")
    assert events and events[0].event_data["skipped_steps"] == [2, 1]


def test_a_delta_resumed_from_the_bucket_brings_its_base(tmp_path: Path, endpoint: str) -> None:
    s3 = S3Config(bucket="ckpts", prefix="jobs/delta", endpoint_url=endpoint)
    job = TinyJob()
    m, _ = manager(job, tmp_path / "a", full_every=3, keep_last=0, s3=s3)
    states = train_and_save(job, m, range(1, 3))  # 1 full, 2 a delta of it: both uploaded
    m.close()
    other = TinyJob(init_seed=3)
    loader, _ = manager(other, tmp_path / "b", s3=s3)  # an empty local directory
    found = loader.restore_latest()
    assert found is not None and found[0] == 2 and found[1].format == "delta"
    assert_same_state(other, states[2])
    assert sorted(s for s, _ in list_committed(tmp_path / "b")) == [1, 2]
    loader.close()
