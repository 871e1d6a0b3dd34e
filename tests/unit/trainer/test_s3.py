"""S3 copies of checkpoints against a real local S3 server (moto, threaded, free port)."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.unit.trainer.trainer_helpers import TinyJob
from trainguard.trainer import S3Config
from trainguard.trainer.manifest import list_committed


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Config]:
    # Credentials for the local server only; boto3 reads them from the environment.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="ckpts")
    yield S3Config(bucket="ckpts", prefix="jobs/demo", endpoint_url=endpoint)
    server.stop()


def keys(cfg: S3Config) -> list[str]:
    client = boto3.client("s3", endpoint_url=cfg.endpoint_url)
    return sorted(o["Key"] for o in client.list_objects_v2(Bucket=cfg.bucket).get("Contents", []))


def test_committed_checkpoints_are_uploaded_with_their_manifest(
    tmp_path: Path, s3: S3Config
) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path, checkpoint_every=4, s3=s3)
    job.run(tg, 1, 8)
    tg.close()
    assert keys(s3) == [
        "jobs/demo/step_000004/manifest.json",
        "jobs/demo/step_000004/rank_00000.pt",
        "jobs/demo/step_000004/tensors_00000.bin",
        "jobs/demo/step_000008/manifest.json",
        "jobs/demo/step_000008/rank_00000.pt",
        "jobs/demo/step_000008/tensors_00000.bin",
    ]


def test_resume_falls_back_to_s3_when_no_local_checkpoint_is_good(
    tmp_path: Path, s3: S3Config, caplog: pytest.LogCaptureFixture
) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path / "a", checkpoint_every=4, s3=s3)
    expected = job.run(tg, 1, 12)
    tg.close()
    # A new node: the local directory is gone; its newest remote copy is corrupt.
    shutil.rmtree(tmp_path / "a")
    client = boto3.client("s3", endpoint_url=s3.endpoint_url)
    client.put_object(Bucket="ckpts", Key="jobs/demo/step_000012/rank_00000.pt", Body=b"junk")
    resumed = TinyJob(init_seed=5)
    tg = resumed.guard(tmp_path / "b", checkpoint_every=4, s3=s3)
    with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
        start = tg.resume(first_step=1)
    assert start == 9
    assert any("source=s3 step=12" in r.getMessage() for r in caplog.records)
    assert [s for s, _ in list_committed(tmp_path / "b")] == [8]
    got = resumed.run(tg, start, 12)
    tg.close()
    assert got == {s: expected[s] for s in range(9, 13)}


def test_upload_failure_is_logged_and_leaves_the_local_checkpoint_good(
    tmp_path: Path, s3: S3Config, caplog: pytest.LogCaptureFixture
) -> None:
    job = TinyJob()
    tg = job.guard(
        tmp_path,
        checkpoint_every=2,
        s3=S3Config(bucket="no-such-bucket", endpoint_url=s3.endpoint_url),
    )
    with caplog.at_level(logging.ERROR, logger="trainguard.trainer"):
        job.run(tg, 1, 2)
        tg.close()
    assert [s for s, _ in list_committed(tmp_path)] == [2]
    assert any("checkpoint_upload_failed" in r.getMessage() for r in caplog.records)
