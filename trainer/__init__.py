"""trainguard trainer library: heartbeats, verified async checkpoints, coordinated requests.

The only part of trainguard that imports torch; `import agent` never imports this package.
`Trainguard` (core) is a facade over parts with one job each, usable alone (docs/trainer.md,
"Parts"): checkpoint_manager (capture, write, verify, load, retention, S3), agreement (the
step every rank acts at: requests, stops, NaN), signals (SIGTERM and its grace), telemetry
(heartbeats and events to the agent), compute_timer, nan_guard (the NaN policy).

    from trainguard.trainer import Trainguard
    tg = Trainguard(model=model, optimizer=opt, ckpt_dir="ckpt", checkpoint_every=100)
    start = tg.resume()
    for step in range(start, total):
        ...
        if tg.step(step, loss=loss).stop:
            break
    tg.close()
"""

from trainguard.membership import Membership
from trainguard.trainer.chaos import ChaosError, ChaosSpecError
from trainguard.trainer.checkpoint_manager import CheckpointMismatch, Stateful
from trainguard.trainer.core import StepAction, Trainguard
from trainguard.trainer.exiting import exit_finished
from trainguard.trainer.fence import LaunchLocked, StaleAttempt
from trainguard.trainer.launch import LaunchMismatch
from trainguard.trainer.loader import resumable_loader
from trainguard.trainer.manifest import (
    CheckpointInvalid,
    ForeignCheckpoint,
    Manifest,
    find_latest_good,
    verify_dir,
)
from trainguard.trainer.nan_guard import NanPolicy
from trainguard.trainer.rejoin import PeerLost, RejoinFailed, settle_ddp_buckets
from trainguard.trainer.replica import ReplicaConfig
from trainguard.trainer.retention import RetentionPolicy
from trainguard.trainer.s3 import S3Config
from trainguard.trainer.sampler import ResumableSampler
from trainguard.trainer.workers import WorkerInit, guard_workers, worker_init_fn

__all__ = [
    "ChaosError",
    "ChaosSpecError",
    "CheckpointInvalid",
    "CheckpointMismatch",
    "ForeignCheckpoint",
    "LaunchLocked",
    "LaunchMismatch",
    "Manifest",
    "Membership",
    "NanPolicy",
    "PeerLost",
    "RejoinFailed",
    "ReplicaConfig",
    "ResumableSampler",
    "RetentionPolicy",
    "S3Config",
    "StaleAttempt",
    "Stateful",
    "StepAction",
    "Trainguard",
    "WorkerInit",
    "exit_finished",
    "find_latest_good",
    "guard_workers",
    "resumable_loader",
    "settle_ddp_buckets",
    "verify_dir",
    "worker_init_fn",
]
