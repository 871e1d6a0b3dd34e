"""S3 copies belong to one job: retention applies to the bucket, the default prefix names the
job, and a checkpoint of another job is never loaded (real local S3 server: moto)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import boto3
import pytest

from tests.unit.trainer.trainer_helpers import TinyJob
from trainguard.trainer import ForeignCheckpoint, S3Config
from trainguard.trainer.manifest import Manifest, check_job, list_committed


def remote_steps(endpoint: str, prefix: str) -> dict[int, set[str]]:
    client = boto3.client("s3", endpoint_url=endpoint)
    out: dict[int, set[str]] = {}
    for o in client.list_objects_v2(Bucket="ckpts", Prefix=prefix + "/").get("Contents", []):
        step_dir, name = o["Key"][len(prefix) + 1 :].split("/", 1)
        out.setdefault(int(step_dir.removeprefix("step_")), set()).add(name)
    return out


def test_keep_last_applies_to_the_bucket_after_each_upload(tmp_path: Path, endpoint: str) -> None:
    job = TinyJob()
    s3 = S3Config(bucket="ckpts", prefix="jobs/demo", endpoint_url=endpoint)
    tg = job.guard(tmp_path, checkpoint_every=2, keep_last=3, s3=s3, job="demo")
    job.run(tg, 1, 24)
    tg.close()
    assert [s for s, _ in list_committed(tmp_path)] == [24, 22, 20]
    remote = remote_steps(endpoint, "jobs/demo")
    assert sorted(remote) == [20, 22, 24]
    assert all("manifest.json" in files for files in remote.values())


def test_an_unfinished_older_upload_is_removed_with_the_old_checkpoints(
    tmp_path: Path, endpoint: str
) -> None:
    client = boto3.client("s3", endpoint_url=endpoint)
    client.put_object(Bucket="ckpts", Key="jobs/demo/step_000001/rank_00000.pt", Body=b"half")
    job = TinyJob()
    s3 = S3Config(bucket="ckpts", prefix="jobs/demo", endpoint_url=endpoint)
    tg = job.guard(tmp_path, checkpoint_every=2, keep_last=2, s3=s3, job="demo")
    job.run(tg, 1, 6)
    tg.close()
    assert sorted(remote_steps(endpoint, "jobs/demo")) == [4, 6]


def test_default_prefix_is_the_jobs_own(tmp_path: Path, endpoint: str) -> None:
    job = TinyJob()
    tg = job.guard(
        tmp_path,
        checkpoint_every=4,
        s3=S3Config(bucket="ckpts", endpoint_url=endpoint),
        job="lm-7b",
    )
    job.run(tg, 1, 4)
    tg.close()
    assert remote_steps(endpoint, "trainguard/lm-7b") == {
        4: {"manifest.json", "rank_00000.pt", "tensors_00000.bin"}
    }


def test_another_jobs_checkpoint_in_a_shared_prefix_is_refused_naming_both_jobs(
    tmp_path: Path, endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    shared = S3Config(bucket="ckpts", prefix="team/shared", endpoint_url=endpoint)
    a = TinyJob()
    tg = a.guard(tmp_path / "a", checkpoint_every=4, s3=shared, job="job-a")
    a.run(tg, 1, 8)
    tg.close()
    # Job b: a fresh directory on another node, the same explicit prefix.
    b = TinyJob(init_seed=5)
    tg = b.guard(tmp_path / "b", checkpoint_every=4, s3=shared, job="job-b")
    with (
        caplog.at_level(logging.ERROR, logger="trainguard.trainer"),
        pytest.raises(ForeignCheckpoint, match=r"'job-a'.*'job-b'"),
    ):
        tg.resume(first_step=1)
    tg.close()
    assert list_committed(tmp_path / "b") == [], "nothing of job a was committed locally"
    assert not any((tmp_path / "b").glob("*.tmp-*")), "nor left half-downloaded"
    assert any("event=checkpoint_refused" in r.getMessage() for r in caplog.records)


def test_another_jobs_checkpoint_in_the_local_directory_is_refused(tmp_path: Path) -> None:
    a = TinyJob()
    tg = a.guard(tmp_path, checkpoint_every=4, job="job-a")
    a.run(tg, 1, 4)
    tg.close()
    b = TinyJob()
    tg = b.guard(tmp_path, job="job-b")
    with pytest.raises(ForeignCheckpoint, match="job 'job-a', this run is job 'job-b'"):
        tg.resume(first_step=1)
    tg.close()


def test_the_same_job_resumes_from_its_bucket_on_a_fresh_node(
    tmp_path: Path, endpoint: str
) -> None:
    s3 = S3Config(bucket="ckpts", endpoint_url=endpoint)
    job = TinyJob()
    tg = job.guard(tmp_path / "a", checkpoint_every=4, s3=s3, job="lm")
    job.run(tg, 1, 12)
    tg.close()
    shutil.rmtree(tmp_path / "a")
    resumed = TinyJob(init_seed=5)
    tg = resumed.guard(tmp_path / "b", checkpoint_every=4, s3=s3, job="lm")
    start = tg.resume(first_step=1)
    assert start == 13
    got = resumed.run(tg, start, 14)
    tg.close()
    straight = TinyJob()
    tg = straight.guard(tmp_path / "c", job="lm")
    assert got == {s: v for s, v in straight.run(tg, 1, 14).items() if s >= 13}
    tg.close()


@pytest.mark.parametrize(
    ("theirs", "ours", "refused"),
    [
        ("lm", "lm", False),
        ("", "lm", False),
        ("0b5e6a1c-3f1d-4c8e-9a2b-7d6e5f4a3b2c", "9d8c7b6a-5f4e-4d3c-8b2a-1f0e9d8c7b6a", False),
        ("lm", "0b5e6a1c-3f1d-4c8e-9a2b-7d6e5f4a3b2c", False),
        ("lm", "lm-2", True),
    ],
    ids=["same-job", "unnamed-old-manifest", "standalone-launches", "standalone-resume", "other"],
)
def test_check_job(theirs: str, ours: str, refused: bool) -> None:
    m = Manifest(
        step=1, world_size=1, format="tensors", files={}, created_at=0.0,
        loss_finite=True, trainguard_version="0", job=theirs,
    )  # fmt: skip
    if refused:
        with pytest.raises(ForeignCheckpoint):
            check_job(m, job=ours, where="here")
    else:
        check_job(m, job=ours, where="here")
