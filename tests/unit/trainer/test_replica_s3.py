"""The second-region replica against real local S3 (moto): two endpoints, two regions. Each
commit is copied and read back; a failed copy is retried and reported and never touches the
primary; the replica keeps the job's retention; resume falls back to it when the primary is
gone; and the restore drill of docs/trainer.md restores from it."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from moto.server import ThreadedMotoServer

from tests.unit.trainer.trainer_helpers import FakeAgent, TinyJob
from trainguard.trainer import ReplicaConfig, S3Config, Trainguard
from trainguard.trainer.ckpttool.cli import main as ckpt_main
from trainguard.trainer.manifest import list_committed, read_manifest

DR_REGION = "eu-west-1"


@dataclass(frozen=True)
class Regions:
    primary: S3Config  # region us-east-1 on the `endpoint` server
    replica: ReplicaConfig  # region eu-west-1 on a second server
    server: ThreadedMotoServer  # the primary's: stop it and the primary is unreachable


@pytest.fixture
def regions(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Regions]:
    # One try per call: an unreachable endpoint fails in milliseconds, not after boto3's retries.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    dr = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    dr.start()
    host, port = dr.get_host_and_port()
    dr_url = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=dr_url, region_name=DR_REGION).create_bucket(
        Bucket="ckpts-dr", CreateBucketConfiguration={"LocationConstraint": DR_REGION}
    )
    primary_server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    primary_server.start()
    host, port = primary_server.get_host_and_port()
    yield Regions(
        primary=S3Config(bucket="ckpts", endpoint_url=f"http://{host}:{port}"),
        replica=ReplicaConfig(
            bucket="ckpts-dr",
            endpoint_url=dr_url,
            region_name=DR_REGION,
            backoff_s=0.05,
            max_backoff_s=0.1,
        ),
        server=primary_server,
    )
    primary_server.stop()
    dr.stop()


def objects(endpoint: str | None, bucket: str, region: str = "us-east-1") -> dict[str, str]:
    client = boto3.client("s3", endpoint_url=endpoint, region_name=region)
    listed = client.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: o["ETag"] for o in listed}


def steps(keys: dict[str, str]) -> list[int]:
    return sorted({int(k.split("/")[2].removeprefix("step_")) for k in keys})


def test_each_commit_is_copied_to_the_replica_verified_and_reported(
    tmp_path: Path, regions: Regions, agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    job = TinyJob()
    tg = job.guard(
        tmp_path, checkpoint_every=2, keep_last=2, s3=regions.primary, replica=regions.replica
    )
    with caplog.at_level(logging.INFO, logger="trainguard.trainer"):
        job.run(tg, 1, 8)
        tg.close()
    primary = objects(regions.primary.endpoint_url, "ckpts")
    replica = objects(regions.replica.endpoint_url, "ckpts-dr", DR_REGION)
    # the job's retention on both sides; the same objects, byte for byte, in both regions
    assert steps(primary) == steps(replica) == [6, 8]
    assert replica == primary
    assert any(
        "event=checkpoint_replicated" in r.getMessage() and "step=8" in r.getMessage()
        for r in caplog.records
    )
    beats = agent.drain()
    assert beats[-1].ckpt_replica_step == 8 and beats[-1].ckpt_replica_lag_s == 0.0
    replicated = [h.event_data["step"] for h in beats if h.event == "checkpoint_replicated"]
    assert 8 in replicated and replicated == sorted(replicated)


def test_a_failed_copy_is_retried_with_backoff_reported_and_the_primary_left_whole(
    tmp_path: Path, regions: Regions, agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    job = TinyJob()
    missing = ReplicaConfig(
        bucket="ckpts-nowhere",
        endpoint_url=regions.replica.endpoint_url,
        region_name=DR_REGION,
        max_attempts=3,
        backoff_s=0.05,
        max_backoff_s=0.1,
    )
    tg = job.guard(tmp_path, checkpoint_every=4, s3=regions.primary, replica=missing)
    with caplog.at_level(logging.WARNING, logger="trainguard.trainer"):
        job.run(tg, 1, 4)
        tg.close()
    failed = [r for r in caplog.records if "event=checkpoint_replication_failed" in r.getMessage()]
    assert [r.levelno for r in failed] == [logging.WARNING, logging.WARNING, logging.ERROR]
    assert "attempt=3 max_attempts=3 retry_in_s=-" in failed[-1].getMessage()
    assert steps(objects(regions.primary.endpoint_url, "ckpts")) == [4]
    assert [s for s, _ in list_committed(tmp_path)] == [4]
    beats = agent.drain()
    events = [h.event_data for h in beats if h.event == "checkpoint_replication_failed"]
    assert [(e["step"], e["attempt"]) for e in events] == [(4, 1), (4, 2), (4, 3)]
    assert events[0]["retry_in_s"] == 0.05 and events[-1]["retry_in_s"] is None
    assert beats[-1].ckpt_replica_step is None
    assert beats[-1].ckpt_replica_lag_s is not None and beats[-1].ckpt_replica_lag_s > 0


def _train_and_lose_the_node(tmp_path: Path, regions: Regions) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path / "a", checkpoint_every=4, s3=regions.primary, replica=regions.replica)
    job.run(tg, 1, 12)
    tg.close()
    shutil.rmtree(tmp_path / "a")  # a new node: nothing local


def _uninterrupted(tmp_path: Path, end: int) -> dict[int, float]:
    job = TinyJob()
    tg = job.guard(tmp_path / "reference")
    losses = job.run(tg, 1, end)
    tg.close()
    return losses


def _resume(
    tmp_path: Path, regions: Regions, caplog: pytest.LogCaptureFixture
) -> tuple[int, TinyJob, Trainguard]:
    resumed = TinyJob(init_seed=5)
    tg = resumed.guard(
        tmp_path / "b", checkpoint_every=4, s3=regions.primary, replica=regions.replica
    )
    with caplog.at_level(logging.INFO, logger="trainguard.trainer"):
        start = tg.resume(first_step=1)
    return start, resumed, tg


def _assert_restored_from_replica(step: int, caplog: pytest.LogCaptureFixture) -> None:
    lines = [r for r in caplog.records if "event=checkpoint_restored" in r.getMessage()]
    assert [r.getMessage().split(" job=")[1] for r in lines] == [
        f"unit step={step} source=replica bucket=ckpts-dr"
    ]
    assert lines[0].levelno == logging.WARNING


def test_resume_falls_back_to_the_replica_when_the_primary_bucket_is_gone(
    tmp_path: Path, regions: Regions, agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    _train_and_lose_the_node(tmp_path, regions)
    client = boto3.client("s3", endpoint_url=regions.primary.endpoint_url)
    for key in objects(regions.primary.endpoint_url, "ckpts"):
        client.delete_object(Bucket="ckpts", Key=key)
    client.delete_bucket(Bucket="ckpts")
    start, resumed, tg = _resume(tmp_path, regions, caplog)
    assert start == 13
    _assert_restored_from_replica(12, caplog)
    assert any("event=s3_list_failed" in r.getMessage() for r in caplog.records)
    got = resumed.run(tg, start, 14)
    tg.close()
    reference = _uninterrupted(tmp_path, 14)
    assert got == {s: reference[s] for s in (13, 14)}  # the replica's state, bit for bit
    restored = [h.event_data for h in agent.drain() if h.event == "checkpoint_restored"]
    assert restored == [{"step": 12, "source": "replica"}]


def test_resume_falls_back_to_the_replica_when_the_primary_endpoint_is_unreachable(
    tmp_path: Path, regions: Regions, agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    _train_and_lose_the_node(tmp_path, regions)
    regions.server.stop()
    start, _, tg = _resume(tmp_path, regions, caplog)
    tg.close()
    assert start == 13
    _assert_restored_from_replica(12, caplog)


def test_a_checkpoint_corrupt_on_the_primary_is_taken_whole_from_the_replica(
    tmp_path: Path, regions: Regions, agent: FakeAgent, caplog: pytest.LogCaptureFixture
) -> None:
    _train_and_lose_the_node(tmp_path, regions)
    client = boto3.client("s3", endpoint_url=regions.primary.endpoint_url)
    client.put_object(Bucket="ckpts", Key="trainguard/unit/step_000012/rank_00000.pt", Body=b"x")
    start, _, tg = _resume(tmp_path, regions, caplog)
    assert start == 13  # the same step from the replica, not the primary's older step 8
    assert any(
        "event=checkpoint_skipped source=s3 step=12" in r.getMessage() for r in caplog.records
    )
    _assert_restored_from_replica(12, caplog)
    tg.close()


def test_the_restore_drill_of_the_docs_restores_the_replica_into_a_job_that_resumes(
    tmp_path: Path,
    regions: Regions,
    agent: FakeAgent,
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = TinyJob()
    tg = job.guard(tmp_path / "a", checkpoint_every=4, s3=regions.primary, replica=regions.replica)
    expected = job.run(tg, 1, 12)
    tg.close()
    flags = ["--endpoint-url", str(regions.replica.endpoint_url), "--region", DR_REGION]
    src = "s3://ckpts-dr/trainguard/unit"
    # docs/trainer.md, "Restore drill", steps 1-3
    assert ckpt_main(["ls", src, *flags]) == 0
    assert "12" in capsys.readouterr().out
    assert ckpt_main(["verify", src, *flags]) == 0
    capsys.readouterr()
    drill_dir = tmp_path / "drill"
    drill = ["drill", src, "--into", str(drill_dir), "--job", "unit", "--max-age-s", "3600"]
    assert ckpt_main([*drill, *flags]) == 0
    out = capsys.readouterr().out
    assert "restored:    step 12 from s3://ckpts-dr/trainguard/unit" in out
    assert "tensors:     4 model tensors decoded" in out
    assert read_manifest(drill_dir / "step_000012").step == 12
    # step 4: a job resumes from the restored directory and trains on exactly as the original
    resumed = TinyJob(init_seed=5)
    tg = resumed.guard(drill_dir, checkpoint_every=0)
    start = tg.resume(first_step=1)
    assert start == 13
    job2 = resumed.run(tg, 13, 14)
    tg.close()
    reference = _uninterrupted(tmp_path, 14)
    assert job2 == {s: reference[s] for s in (13, 14)} and expected[12] == reference[12]
    # a drill into the same place again refuses to overwrite; a foreign job is refused
    assert ckpt_main([*drill, *flags]) == 2
    assert "already exists" in capsys.readouterr().err
    assert ckpt_main(["drill", src, "--into", str(tmp_path / "x"), "--job", "other", *flags]) == 2
