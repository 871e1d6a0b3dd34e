"""The second-region replica without S3: its strict config (argument and environment), the lag
it reports and its retry schedule on a fake clock, and its thread over a gated stand-in store
(a commit never waits for a copy; a newer one supersedes a waiting one)."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from tests.helpers import wait_for
from trainguard.clock import FakeClock
from trainguard.kinds import TrainerEdge
from trainguard.trainer import ReplicaConfig, RetentionPolicy, S3Config
from trainguard.trainer.manifest import Manifest, write_manifest
from trainguard.trainer.replica import REPLICA_ENV, ReplicaLedger, Replicator, replica_from_env


def test_lag_counts_from_the_oldest_commit_not_yet_replicated_and_is_zero_when_caught_up() -> None:
    clock = FakeClock(start=1000.0)
    ledger = ReplicaLedger(config=ReplicaConfig(bucket="ckpts-dr"), clock=clock)
    assert ledger.status().step is None and ledger.lag_s() == 0.0
    ledger.submitted(step=10, committed_at=clock.now())
    clock.advance(5)
    ledger.submitted(step=20, committed_at=clock.now())
    clock.advance(3)
    assert ledger.lag_s() == 8.0
    assert ledger.succeeded(10) == 8.0
    assert (ledger.status().step, ledger.lag_s()) == (10, 3.0)  # step 20 waits since its commit
    assert ledger.succeeded(20) == 3.0
    assert (ledger.status().step, ledger.lag_s()) == (20, 0.0)
    ledger.submitted(step=20, committed_at=clock.now())  # an old step again: nothing waits
    assert ledger.lag_s() == 0.0


def test_a_newer_checkpoint_replicated_first_clears_the_older_ones_waiting() -> None:
    clock = FakeClock(start=1000.0)
    ledger = ReplicaLedger(config=ReplicaConfig(bucket="ckpts-dr"), clock=clock)
    for step in (2, 4, 6):
        ledger.submitted(step=step, committed_at=clock.now())
        clock.advance(1)
    ledger.succeeded(6)
    assert ledger.lag_s() == 0.0 and ledger.status().step == 6


def test_retries_back_off_doubling_up_to_the_cap_and_stop_after_max_attempts() -> None:
    config = ReplicaConfig(bucket="ckpts-dr", max_attempts=5, backoff_s=2.0, max_backoff_s=5.0)
    ledger = ReplicaLedger(config=config, clock=FakeClock())
    assert [ledger.failed(a) for a in range(1, 6)] == [2.0, 4.0, 5.0, 5.0, None]
    assert ledger.status().failures == 5
    ledger.succeeded(4)
    assert ledger.status().failures == 0


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param(
            {"bucket": "Bad_Bucket"}, "replica.bucket must be an S3 bucket name", id="bucket"
        ),
        pytest.param(
            {"bucket": "ok-bucket", "endpoint_url": "localhost:9000"}, "http://", id="url"
        ),
        pytest.param({"bucket": "ok-bucket", "region_name": "EU West"}, "region_name", id="region"),
        pytest.param(
            {"bucket": "ok-bucket", "max_attempts": 0}, "max_attempts must be in", id="att0"
        ),
        pytest.param({"bucket": "ok-bucket", "max_attempts": 2.5}, "an integer", id="att-float"),
        pytest.param(
            {"bucket": "ok-bucket", "backoff_s": 0}, "backoff_s must be in", id="backoff0"
        ),
        pytest.param(
            {"bucket": "ok-bucket", "backoff_s": 10, "max_backoff_s": 5},
            "max_backoff_s (5) must be at least",
            id="cap-below-first",
        ),
        pytest.param(
            {"bucket": "ok-bucket", "close_timeout_s": 86400}, "close_timeout_s", id="close"
        ),
    ],
)
def test_a_bad_replica_config_fails_at_construction_naming_the_field(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ReplicaConfig(**fields)  # type: ignore[arg-type]


def test_the_environment_variable_is_strict_and_named_in_every_error() -> None:
    env = {REPLICA_ENV: '{"bucket": "ckpts-dr", "region_name": "eu-west-1", "max_attempts": 3}'}
    config = replica_from_env(env)
    assert config == ReplicaConfig(bucket="ckpts-dr", region_name="eu-west-1", max_attempts=3)
    assert replica_from_env({}) is None and replica_from_env({REPLICA_ENV: " "}) is None
    with pytest.raises(ValueError, match=f"{REPLICA_ENV}: not a JSON object"):
        replica_from_env({REPLICA_ENV: "ckpts-dr"})
    with pytest.raises(ValueError, match=f"{REPLICA_ENV}.regoin: unknown key"):
        replica_from_env({REPLICA_ENV: '{"bucket": "ckpts-dr", "regoin": "eu-west-1"}'})
    with pytest.raises(ValueError, match=f"{REPLICA_ENV}.bucket: required key is missing"):
        replica_from_env({REPLICA_ENV: '{"region_name": "eu-west-1"}'})
    with pytest.raises(ValueError, match=f"{REPLICA_ENV}.max_attempts must be in"):
        replica_from_env({REPLICA_ENV: '{"bucket": "ckpts-dr", "max_attempts": 1000}'})


def test_a_replica_that_is_the_primary_itself_is_refused() -> None:
    primary = S3Config(bucket="ckpts", endpoint_url="http://s3.local")
    same = ReplicaConfig(bucket="ckpts", endpoint_url="http://s3.local")
    with pytest.raises(ValueError, match="replica is the primary itself"):
        same.check_apart_from(primary, job="demo")
    ReplicaConfig(bucket="ckpts", endpoint_url="http://s3.dr").check_apart_from(primary, job="a")
    ReplicaConfig(bucket="ckpts", prefix="dr/a", endpoint_url="http://s3.local").check_apart_from(
        primary, job="a"
    )
    same.check_apart_from(None, job="demo")


class GatedStore:
    """Stands in for the replica's S3Store in the thread's tests: each upload waits for the
    gate (a slow region), and `fail` makes it raise (a region down). Records what it did."""

    prefix = "trainguard/demo"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.fail = False
        self.uploaded: list[int] = []
        self.pruned: list[int] = []

    def upload(self, directory: Path) -> None:
        self.gate.wait(10)
        if self.fail:
            raise OSError("region down")
        self.uploaded.append(int(directory.name.removeprefix("step_")))

    def verify_remote(self, manifest: Manifest) -> None:
        assert manifest.step in self.uploaded

    def apply_retention(self, *, policy: RetentionPolicy, now: float, newest_step: int) -> None:
        self.pruned.append(newest_step)


def _checkpoint(root: Path, step: int) -> Path:
    directory = root / f"step_{step:06d}"
    directory.mkdir()
    (directory / "rank_00000.pt").write_bytes(b"x")
    write_manifest(
        directory,
        Manifest(
            step=step,
            world_size=1,
            format="tensors",
            files={"rank_00000.pt": {"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}},
            created_at=1000.0,
            loss_finite=True,
            trainguard_version="test",
        ),
    )
    return directory


def _replicator(store: GatedStore, **config: object) -> Replicator:
    return Replicator(
        store=store,  # type: ignore[arg-type]
        config=ReplicaConfig(bucket="ckpts-dr", **config),  # type: ignore[arg-type]
        policy=RetentionPolicy(recent_last=2),
        job="demo",
        clock=FakeClock(start=1000.0),
    )


def test_submit_never_waits_for_the_copy_and_a_newer_commit_supersedes_a_waiting_one(
    tmp_path: Path,
) -> None:
    store = GatedStore()
    rep = _replicator(store)
    rep.submit(step=2, directory=_checkpoint(tmp_path, 2), committed_at=1000.0)
    wait_for(lambda: rep.copying() == 2, timeout_s=10, what="the copy of step 2 to start")
    for step in (4, 6):  # the region is slow: the copy of 2 is held at the gate
        rep.submit(step=step, directory=_checkpoint(tmp_path, step), committed_at=1000.0)
    assert store.uploaded == [] and rep.status().lag_s == 0.0  # the fake clock stands still
    store.gate.set()
    assert rep.close(10)
    # 2 was in flight; 4 was replaced by 6 before its copy began
    assert store.uploaded == [2, 6] and store.pruned == [2, 6]
    assert rep.status().step == 6
    replicated = TrainerEdge.CHECKPOINT_REPLICATED
    assert [(e.kind, e.step) for e in rep.take_events()] == [(replicated, 2), (replicated, 6)]


def test_a_region_down_past_max_attempts_is_reported_once_per_attempt_and_close_is_bounded(
    tmp_path: Path,
) -> None:
    store = GatedStore()
    store.fail = True
    store.gate.set()
    rep = _replicator(store, max_attempts=2, backoff_s=0.01, max_backoff_s=0.01)
    rep.submit(step=2, directory=_checkpoint(tmp_path, 2), committed_at=990.0)
    assert rep.close(10)
    events = rep.take_events()
    failed = TrainerEdge.CHECKPOINT_REPLICATION_FAILED
    assert [(e.kind, e.attempt, e.retry_in_s) for e in events] == [
        (failed, 1, 0.01),
        (failed, 2, None),
    ]
    assert "region_down" in events[0].reason
    status = rep.status()
    assert (status.step, status.lag_s, status.failures) == (None, 10.0, 2)
    assert store.pruned == []  # nothing is pruned without a verified copy
