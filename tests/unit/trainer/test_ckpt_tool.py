"""trainguard-ckpt on checkpoints the trainer itself wrote: a one-process job (raw tensor
files), a two-rank FSDP2 job (DCP shards, gloo on CPU) and a bucket (moto)."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from torch import nn

from tests.unit.trainer.trainer_helpers import TinyJob
from trainguard.clock import FakeClock
from trainguard.trainer import RetentionPolicy, S3Config
from trainguard.trainer.ckpttool.cli import main
from trainguard.trainer.ckpttool.export import ExportError, _dcp_metadata
from trainguard.trainer.manifest import list_committed

HOUR = 3600.0
START = 1_699_833_600.0  # Monday 2023-11-13 00:00 UTC


def run_job(ckpt: Path, *, steps: int = 4, **kw: Any) -> TinyJob:
    """A real job: one checkpoint per step, an hour apart on a fake clock."""
    clock = kw.pop("clock", FakeClock(start=START))
    job = TinyJob()
    if "retention" not in kw:
        kw.setdefault("keep_last", 0)  # keep all: every test sees the four
    tg = job.guard(ckpt, clock=clock, job=kw.pop("job", "demo"), **kw)
    batches = job.sampler.batches(job.loader)
    for step in range(1, steps + 1):
        job.train_step(batches)
        if step == 2:
            tg.mark_milestone("best-val")
        assert tg.save(step, wait=True)
        clock.advance(HOUR)
    tg.close()
    return job


def tool(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv), clock=FakeClock(start=START + 5 * HOUR))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    run_job(d)
    return d


def test_ls_lists_every_checkpoint_verified_with_its_tier(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = tool(capsys, "ls", str(ckpt), "-o", "json")
    assert rc == 0
    data = json.loads(out)
    rows = {r["step"]: r for r in data["checkpoints"]}
    assert list(rows) == [4, 3, 2, 1]
    assert all(r["verified"] and r["job"] == "demo" and r["world_size"] == 1 for r in rows.values())
    assert rows[1]["created_at"] == START
    assert rows[2]["milestones"] == ["best-val"]
    # the job's recorded policy (keep_last=0: keep all) unless flags say otherwise
    assert data["policy"]["recent_last"] == 0 and rows[1]["tiers"] == ["all"]
    rc, out, _ = tool(capsys, "ls", str(ckpt), "--keep-last", "1")
    lines = out.splitlines()
    assert lines[0].split() == [
        "STEP", "CREATED", "SIZE", "WORLD", "KIND", "JOB", "VERIFIED", "TIER"
    ]  # fmt: skip
    by_step = {line.split()[0]: line for line in lines[1:]}
    assert by_step["4"].endswith("newest,recent")
    assert by_step["2"].endswith("milestone:best-val")
    assert by_step["3"].endswith("(prune)")
    assert "2023-11-13T00:00:00Z" in by_step["1"]


def test_verify_names_the_corrupt_file_and_exits_2(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert tool(capsys, "verify", str(ckpt))[0] == 0
    bad = ckpt / "step_000003" / "tensors_00000.bin"
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 0xFF
    bad.write_bytes(bytes(raw))
    rc, out, err = tool(capsys, "verify", str(ckpt), "-o", "json")
    assert rc == 2
    assert {r["step"]: r["ok"] for r in json.loads(out)["checkpoints"]} == {
        4: True,
        3: False,
        2: True,
        1: True,
    }
    assert f"{bad}: sha256 mismatch" in err
    assert tool(capsys, "verify", str(ckpt), "4", "2")[0] == 0
    rc, out, _ = tool(capsys, "ls", str(ckpt))
    assert "sha256 mismatch" in out and " NO " in out


@pytest.mark.parametrize("what", ["partial", "foreign-job", "not-a-checkpoint", "no-such-step"])
def test_a_partial_foreign_or_missing_checkpoint_is_a_clear_error(
    ckpt: Path, capsys: pytest.CaptureFixture[str], what: str, tmp_path: Path
) -> None:
    if what == "partial":
        (ckpt / "step_000004" / "manifest.json").unlink()
        rc, _, err = tool(capsys, "show", str(ckpt), "4")
        assert "step_000004/manifest.json: manifest missing" in err
    elif what == "foreign-job":
        rc, _, err = tool(capsys, "verify", str(ckpt), "--job", "other")
        assert "checkpoint of job 'demo'" in err
    elif what == "not-a-checkpoint":
        rc, _, err = tool(capsys, "ls", str(tmp_path / "nowhere"))
        assert "no such checkpoint directory" in err
    else:
        rc, _, err = tool(capsys, "show", str(ckpt), "7")
        assert "no checkpoint of step 7" in err
    assert rc == 2


def test_show_prints_the_manifest_size_world_size_job_and_tier(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = tool(capsys, "show", str(ckpt), "2", "-o", "json")
    assert rc == 0
    data = json.loads(out)
    assert data["manifest"]["step"] == 2 and data["manifest"]["format"] == "tensors"
    assert data["world_size"] == 1 and data["job"] == "demo"
    assert data["size_bytes"] == sum(f["size"] for f in data["manifest"]["files"].values())
    assert data["tiers"] == ["all"]
    rc, out, _ = tool(capsys, "show", str(ckpt), "2", "--keep-last", "1")
    assert "tier:        milestone:best-val" in out and "world size:  1" in out


def test_prune_dry_run_deletes_nothing_and_prune_never_takes_the_newest_verified(
    ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = tool(capsys, "prune", str(ckpt), "--keep-last", "1", "--dry-run", "-o", "json")
    assert rc == 0
    assert json.loads(out)["deleted"] == [3, 1]
    assert [s for s, _ in list_committed(ckpt)] == [4, 3, 2, 1]
    # the newest is corrupt: the newest verified (3) stays, and so does the newer one
    (ckpt / "step_000004" / "rank_00000.pt").write_bytes(b"torn")
    rc, out, _ = tool(capsys, "prune", str(ckpt), "--keep-last", "1")
    assert rc == 0 and "newest verified: step 3" in out
    assert [s for s, _ in list_committed(ckpt)] == [4, 3, 2]


def test_prune_refuses_a_bad_flag_naming_it(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = tool(capsys, "prune", str(ckpt), "--keep-daily", "-1")
    assert rc == 2 and "--keep-daily must be in [0, 3660]" in err


def test_export_writes_the_model_weights_as_safetensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = run_job(tmp_path / "ckpt")
    out_file = tmp_path / "model.safetensors"
    rc, out, _ = tool(
        capsys, "export", str(tmp_path / "ckpt"), "--out", str(out_file), "-o", "json"
    )
    assert rc == 0 and json.loads(out)["step"] == 4
    got = load_file(str(out_file))
    want = job.model.state_dict()
    assert set(got) == set(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name


class _Evil:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.getcwd, ())


def test_dcp_metadata_naming_anything_but_dcp_classes_is_refused(tmp_path: Path) -> None:
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(ExportError, match=r"refers to posix\.getcwd, not DCP metadata"):
        _dcp_metadata(path)


# --- FSDP2: DCP shards of two ranks --------------------------------------------------------


def _fsdp_rank(rank: int, world: int, root: str) -> None:
    # Deferred: only the spawned ranks build a device mesh.
    import torch.distributed as dist  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions,
        get_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    from trainguard.trainer import Trainguard  # noqa: PLC0415

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    mesh = init_device_mesh("cpu", (world,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tg = Trainguard(model=model, optimizer=opt, ckpt_dir=f"{root}/ckpt", job="fsdp",
                    handle_sigterm=False)  # fmt: skip
    torch.manual_seed(rank)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    assert tg.save(1, wait=True)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, f"{root}/want.safetensors")
    tg.close()
    dist.destroy_process_group()


@pytest.mark.slow
def test_export_consolidates_fsdp2_dcp_shards_of_two_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    mp.spawn(_fsdp_rank, args=(2, str(tmp_path)), nprocs=2, join=True)
    rc, out, _ = tool(capsys, "show", str(tmp_path / "ckpt"), "1", "-o", "json")
    assert json.loads(out)["manifest"]["format"] == "dcp"
    assert json.loads(out)["world_size"] == 2
    out_file = tmp_path / "model.safetensors"
    rc, _, err = tool(capsys, "export", str(tmp_path / "ckpt"), "--out", str(out_file))
    assert rc == 0, err
    got, want = load_file(str(out_file)), load_file(str(tmp_path / "want.safetensors"))
    assert set(got) == set(want) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, t in want.items():
        assert torch.equal(got[name], t), name


# --- S3 --------------------------------------------------------------------------------------


def test_the_tool_reads_verifies_exports_and_prunes_a_bucket(
    tmp_path: Path, endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    s3 = S3Config(bucket="ckpts", prefix="jobs/demo", endpoint_url=endpoint)
    policy = RetentionPolicy(recent_last=1)
    run_job(tmp_path / "ckpt", steps=4, retention=policy, s3=s3)
    url = "s3://ckpts/jobs/demo"
    # the job's own retention ran on the bucket too: newest and the milestone are left
    rc, out, _ = tool(capsys, "ls", url, "--endpoint-url", endpoint, "-o", "json")
    assert rc == 0
    rows = {r["step"]: r for r in json.loads(out)["checkpoints"]}
    assert {s: r["tiers"] for s, r in rows.items()} == {4: ["newest", "recent"], 2: ["milestone"]}
    assert rows[4]["verified"] is None  # S3: not downloaded unless --verify
    assert tool(capsys, "verify", url, "--endpoint-url", endpoint)[0] == 0
    out_file = tmp_path / "m.safetensors"
    assert tool(capsys, "export", url, "--endpoint-url", endpoint, "--out", str(out_file))[0] == 0
    assert set(load_file(str(out_file))) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    rc, out, _ = tool(capsys, "prune", url, "--endpoint-url", endpoint, "--keep-last", "1",
                      "--dry-run", "-o", "json")  # fmt: skip
    assert rc == 0 and json.loads(out)["deleted"] == []


def test_the_tool_shows_and_verifies_every_link_of_a_delta_chain(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    run_job(ckpt, full_every=3)  # 1 full, 2 and 3 deltas of it, 4 full
    rc, out, _ = tool(capsys, "ls", str(ckpt), "-o", "json")
    assert rc == 0
    rows = {r["step"]: r for r in json.loads(out)["checkpoints"]}
    assert {s: (r["format"], r["base_step"]) for s, r in rows.items()} == {
        4: ("tensors", None), 3: ("delta", 1), 2: ("delta", 1), 1: ("tensors", None)
    }  # fmt: skip
    rc, out, _ = tool(capsys, "ls", str(ckpt))
    assert "delta of 1" in out
    rc, out, _ = tool(capsys, "show", str(ckpt), "3")
    assert "chain:       delta 2 of base step 1 (parent step 1" in out
    out_file = tmp_path / "m.safetensors"
    assert tool(capsys, "export", str(ckpt), "--step", "3", "--out", str(out_file))[0] == 0
    assert set(load_file(str(out_file))) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    bad = ckpt / "step_000001" / "tensors_00000.bin"
    raw = bytearray(bad.read_bytes())
    raw[100] ^= 0xFF
    bad.write_bytes(bytes(raw))
    rc, out, err = tool(capsys, "verify", str(ckpt), "-o", "json")
    assert rc == 2
    assert {r["step"]: r["ok"] for r in json.loads(out)["checkpoints"]} == {
        4: True, 3: False, 2: False, 1: False
    }  # fmt: skip
    assert "base step 1: sha256 mismatch" in err


def test_bucket_retention_keeps_the_bases_of_kept_deltas(
    tmp_path: Path, endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    s3 = S3Config(bucket="ckpts", prefix="jobs/delta", endpoint_url=endpoint)
    run_job(
        tmp_path / "ckpt", steps=6, retention=RetentionPolicy(recent_last=1), s3=s3, full_every=3
    )  # 1 and 4 full; the milestone 2 is a delta of 1, the newest 6 a delta of 4
    url = "s3://ckpts/jobs/delta"
    rc, out, _ = tool(capsys, "ls", url, "--endpoint-url", endpoint, "-o", "json")
    assert rc == 0
    rows = {r["step"]: r["tiers"] for r in json.loads(out)["checkpoints"]}
    assert rows == {6: ["newest", "recent"], 4: ["base"], 2: ["milestone"], 1: ["base"]}
    assert sorted(s for s, _ in list_committed(tmp_path / "ckpt")) == [1, 2, 4, 6]
    assert tool(capsys, "verify", url, "6", "--endpoint-url", endpoint)[0] == 0
    out_file = tmp_path / "m.safetensors"
    assert tool(capsys, "export", url, "--endpoint-url", endpoint, "--out", str(out_file))[0] == 0
