"""`CheckpointManager`: a job's checkpoints, from the state in memory to a verified directory.

It owns the orchestration around the formats and the writer (trainer/checkpoint.py,
manifest.py, state.py, s3.py): fencing the directory at start (launch lock, attempt epoch,
stale temporary directories), capturing the state into reusable host buffers and handing it
to the background writer (at most one save in flight), choosing full or delta saves
(`full_every`), collecting the writer's results, and on resume or rollback agreeing on the
newest good checkpoint (verified, a delta with its base; from S3 when none is good locally)
and loading it into the live objects. Every method that touches the directory
is a collective in a distributed job: every rank calls it at the same point.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from trainguard import __version__
from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.trainer.checkpoint import (
    CheckpointWriter,
    SaveResult,
    load_rank_file,
    rank_file_name,
    read_tensor_file,
    tensor_file_name,
)
from trainguard.trainer.delta_files import delta_file_name, read_base, read_delta_file
from trainguard.trainer.fence import LaunchLock, LaunchLocked, StaleAttempt, raise_epoch
from trainguard.trainer.hooks import StepHook
from trainguard.trainer.manifest import (
    DELTA_FORMAT,
    CheckpointInvalid,
    ForeignCheckpoint,
    Manifest,
    check_job,
    clean_stale,
    commit_dir,
    delta_link,
    find_latest_good,
    manifest_sha256,
    read_manifest,
    step_dir_name,
    verify_dir,
    verify_link,
)
from trainguard.trainer.replica import ReplicaConfig, Replicator
from trainguard.trainer.retention import RetentionPolicy, check_milestone_name
from trainguard.trainer.s3 import S3Config, S3Store
from trainguard.trainer.state import (
    SnapshotPool,
    capture_rng,
    check_storable,
    derive_rng,
    fill_tensors,
    restore_rng,
    split_tensors,
)
from trainguard.trainer.sync import Coordinator

__all__ = [
    "CheckpointManager",
    "CheckpointMismatch",
    "CheckpointSettings",
    "Stateful",
    "TrainState",
]

log = logging.getLogger("trainguard.trainer")

_DEFAULT_KEEP_LAST = 3
_FOREIGN = -2  # broadcast by rank 0 when the newest checkpoint belongs to another job


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class CheckpointMismatch(RuntimeError):
    """A good checkpoint exists but cannot be loaded into this run (e.g. a checkpoint written
    without a process group, resumed at another world size)."""


@dataclass(frozen=True)
class TrainState:
    """The live objects a checkpoint holds (the `Trainguard` arguments of the same names).
    Model and optimizer go through the DCP state-dict helpers in a distributed run; the
    others through `state_dict()` / `load_state_dict()`, per rank."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Stateful | None = None
    scaler: Stateful | None = None
    sampler: Stateful | None = None
    extra: Mapping[str, Stateful] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckpointSettings:
    """Where checkpoints go and how they are kept (the `Trainguard` arguments of the same
    names; `epoch` already resolved: None means no fencing)."""

    # Shared by all ranks; made absolute, so paths in events and logs mean the same file to
    # whoever reads them, whatever their working directory.
    ckpt_dir: Path
    # A periodic checkpoint every K steps (0: only on request, SIGTERM or save()).
    checkpoint_every: int = 0
    # Committed checkpoints kept (0: all); older ones go only after a newer one committed.
    keep_last: int = 3
    s3: S3Config | None = None
    # The second-region copy (trainer/replica.py); None: no replica.
    replica: ReplicaConfig | None = None
    # Tiered retention (trainer/retention.py); None: the newest `keep_last` (its recent tier).
    retention: RetentionPolicy | None = None
    # How long a new save, a stop or close() waits for the save in flight.
    checkpoint_timeout_s: float = 600.0
    # This launch's attempt epoch (trainer/fence.py); None: no fencing.
    epoch: int | None = None
    # With an epoch: how long rank 0 waits at start for its attempt's launch lock.
    launch_lock_timeout_s: float = 60.0
    # Incremental checkpoints: a full checkpoint every N commits and deltas against it between
    # (0 or 1: every checkpoint full, the default: a delta costs CPU and a read of its base,
    # and pays only where the state changes little; see docs/trainer.md). Without a process
    # group only: DTensor/DCP state always writes full checkpoints.
    full_every: int = 0

    @property
    def policy(self) -> RetentionPolicy:
        """The retention policy in force: `retention`, or the newest `keep_last`."""
        if self.retention is not None:
            return self.retention
        return RetentionPolicy(recent_last=self.keep_last)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ckpt_dir", Path(self.ckpt_dir).absolute())
        if self.checkpoint_every < 0:
            raise ValueError(
                f"checkpoint_every must be >= 0 (0 = off), got {self.checkpoint_every}"
            )
        if self.keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 = keep all), got {self.keep_last}")
        if self.retention is not None and self.keep_last != _DEFAULT_KEEP_LAST:
            raise ValueError(
                "keep_last and retention are both given: set retention.recent_last instead "
                "(retention replaces keep_last)"
            )
        if self.checkpoint_timeout_s <= 0:
            raise ValueError(
                f"checkpoint_timeout_s must be positive, got {self.checkpoint_timeout_s}"
            )
        if self.epoch is not None and self.epoch < 0:
            raise ValueError(f"epoch must be >= 0 or None (TRAINGUARD_ATTEMPT), got {self.epoch}")
        if self.full_every < 0:
            raise ValueError(
                f"full_every must be >= 0 (0 = every checkpoint full), got {self.full_every}"
            )
        if self.launch_lock_timeout_s < 0:
            raise ValueError(
                f"launch_lock_timeout_s must be >= 0, got {self.launch_lock_timeout_s}"
            )


def _ignore_result(result: SaveResult) -> None:
    return None


class CheckpointManager:
    """Saves and loads `state` under `settings.ckpt_dir`.

    Constructing it fences the directory (rank 0; every rank raises `StaleAttempt` or
    `LaunchLocked` when refused), so every rank constructs it at the same point. Each save's
    outcome, and each save that could not start, goes to `on_result` (from the calling thread,
    in `collect()` or `save()`)."""

    def __init__(
        self,
        *,
        state: TrainState,
        settings: CheckpointSettings,
        coordinator: Coordinator,
        job: str,
        hooks: tuple[StepHook, ...] = (),
        on_result: Callable[[SaveResult], None] = _ignore_result,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.state = state
        self.settings = settings
        self.coord = coordinator
        self.rank = coordinator.rank
        self.world_size = coordinator.world_size
        self.job = job
        self.clock = clock
        self.ckpt_dir = settings.ckpt_dir
        self.epoch = settings.epoch
        self._on_result = on_result
        self.launch_lock: LaunchLock | None = None
        self.stale = False  # a commit was refused: a newer attempt owns the directory
        self.snapshot_prepared = False
        if settings.replica is not None:
            settings.replica.check_apart_from(settings.s3, job=job)
        run_nonce = self._open_directory()
        self.s3 = S3Store(settings.s3, job=job) if settings.s3 is not None else None
        self.replica = (
            S3Store(settings.replica.location, job=job) if settings.replica is not None else None
        )
        # Rank 0 commits, so rank 0 alone copies to the replica.
        self.replicator = (
            Replicator(
                store=self.replica,
                config=settings.replica,
                policy=settings.policy,
                job=job,
                clock=clock,
            )
            if self.replica is not None and settings.replica is not None and self.rank == 0
            else None
        )
        # Where the checkpoint `latest()` found came from: "local", "s3" or "replica" (rank 0).
        self.restore_source: str | None = None
        self.writer = CheckpointWriter(
            ckpt_dir=self.ckpt_dir,
            coordinator=coordinator,
            retention=settings.policy,
            job=job,
            version=__version__,
            run_nonce=run_nonce,
            epoch=self.epoch,
            s3=self.s3,
            replicator=self.replicator,
            hooks=hooks,
            clock=clock,
        )
        self.pool = SnapshotPool(clock=clock)
        # Milestone names for the next checkpoint that starts (mark_milestone).
        self._milestones: set[str] = set()
        self._milestones_in_flight: tuple[str, ...] = ()
        self._block_s: dict[int, float] = {}  # step -> how long its save() held the loop
        # Incremental checkpoints: the full checkpoint deltas go against, and how many deltas
        # of it committed since (None: the next save is full).
        self._base: tuple[int, int] | None = None
        # What the last `latest()` passed over (rank 0): (step, why), newest first.
        self.skipped: list[tuple[int, CheckpointInvalid]] = []
        if settings.full_every > 1 and coordinator.distributed:
            log.info(
                "event=incremental_off job=%s rank=%d reason=dcp: with a process group every "
                "checkpoint is a full DCP checkpoint",
                job,
                self.rank,
            )

    # --- saving -----------------------------------------------------------------------------

    def mark_milestone(self, name: str) -> None:
        """Name the next checkpoint a milestone (e.g. "best-val"): retention keeps the newest
        checkpoint of each name forever. A save that fails passes the name on to the next."""
        self._milestones.add(check_milestone_name(name))

    def set_checkpoint_every(self, every_steps: int) -> None:
        """A new periodic interval (the controller's `auto`), from the next step on; every
        rank sets it at the same agreed step."""
        self.settings = dataclasses.replace(self.settings, checkpoint_every=every_steps)

    def is_periodic(self, step: int) -> bool:
        every = self.settings.checkpoint_every
        return every > 0 and step > 0 and step % every == 0

    def save(
        self, step: int, *, request_id: str | None = None, deadline: float | None = None
    ) -> bool:
        """Start the checkpoint of `step` (the state after it): snapshot now, write in the
        background. Waits for the save in flight first, until `deadline` (monotonic) or for
        `checkpoint_timeout_s`. False when not started (the previous save still running, the
        state not capturable, or this attempt stale)."""
        t0 = self.clock.monotonic()
        timeout_s = self.settings.checkpoint_timeout_s
        if deadline is not None:
            timeout_s = max(0.0, deadline - self.clock.monotonic())
        # At most one save in flight: wait for the previous one (identically on every rank,
        # so every rank starts this save's collectives together).
        if not self.writer.wait(timeout_s):
            log.error(
                "event=checkpoint_failed job=%s rank=%d step=%d reason=previous_save_still_running",
                self.job,
                self.rank,
                step,
            )
            self._failed(step, request_id, "previous_save_still_running")
            return False
        self.collect()
        if self.stale:
            return False  # the previous save was refused: every rank learnt it from its outcome
        try:
            rank_state, tensors = self._capture(step)
            snap = self.pool.snapshot({"rank": rank_state, "tensors": tensors})
        except Exception as e:
            # Must not diverge across ranks: a capture error is a programming error that
            # every rank hits identically (same model, same state types).
            log.error(
                "event=checkpoint_failed job=%s rank=%d step=%d reason=%s",
                self.job,
                self.rank,
                step,
                str(e).replace(" ", "_"),
            )
            self._failed(step, request_id, str(e))
            return False
        self._milestones_in_flight = tuple(sorted(self._milestones))
        self._milestones.clear()
        delta_base, delta_index = self._delta_plan()
        self.writer.start(
            step=step,
            request_id=request_id,
            rank_state=snap["rank"],
            tensors=snap["tensors"],
            snapshot_bytes=self.pool.bytes,
            milestones=self._milestones_in_flight,
            delta_base=delta_base,
            delta_index=delta_index,
        )
        self._block_s[step] = self.clock.monotonic() - t0
        return True

    def _delta_plan(self) -> tuple[int | None, int]:
        """(base step, index) for a delta save, or (None, 0) for a full one."""
        every = self.settings.full_every
        if every <= 1 or self.coord.distributed or self._base is None:
            return None, 0
        base_step, deltas = self._base
        if deltas + 1 >= every:
            return None, 0
        return base_step, deltas + 1

    def _track_base(self, *, step: int, base_step: int | None, index: int) -> None:
        """A checkpoint committed or loaded: a full one becomes the base, a delta counts."""
        self._base = (step, 0) if base_step is None else (base_step, index)

    def prepare_snapshot(self, step: int) -> None:
        """Once, after the first step (the state is complete only then: Adam creates its
        moments in its first step): have the pool allocate and pre-fault the host buffers in
        the background, so the first save only copies, like every later one."""
        if self.snapshot_prepared:
            return
        self.snapshot_prepared = True
        try:
            rank_state, tensors = self._capture(step)
            self.pool.prepare({"rank": rank_state, "tensors": tensors})
        except Exception as e:  # a save reports it; here it only costs the head start
            log.warning(
                "event=snapshot_prepare_failed job=%s rank=%d reason=%s",
                self.job,
                self.rank,
                str(e).replace(" ", "_"),
            )

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the save in flight (default: `checkpoint_timeout_s`); True when none is
        left in flight. Its result is reported by the next `collect()`."""
        return self.writer.wait(
            self.settings.checkpoint_timeout_s if timeout_s is None else timeout_s
        )

    def collect(self) -> None:
        """Report the outcomes of finished saves to `on_result`."""
        for r in self.writer.take_results():
            self.stale = self.stale or r.stale
            if not r.ok:
                self._milestones.update(self._milestones_in_flight)
            self._milestones_in_flight = ()
            if r.ok:
                index = self._base[1] + 1 if self._base is not None else 0
                self._track_base(step=r.step, base_step=r.base_step, index=index)
            block_s = self._block_s.pop(r.step, None)
            self._on_result(r if block_s is None else dataclasses.replace(r, block_s=block_s))

    def close(self, timeout_s: float | None = None) -> None:
        """Wait (bounded) for the save in flight, report, release the buffers and the launch
        lock."""
        if not self.wait(timeout_s):
            log.error(
                "event=checkpoint_abandoned job=%s rank=%d reason=timeout", self.job, self.rank
            )
        self.collect()
        if self.replicator is not None and self.settings.replica is not None:
            # Under a SIGTERM's grace (`timeout_s`), the copy gets no more than what is left.
            replica_s = self.settings.replica.close_timeout_s
            self.replicator.close(replica_s if timeout_s is None else min(replica_s, timeout_s))
        self.pool.close()
        if self.launch_lock is not None:
            self.launch_lock.release()

    def _failed(self, step: int, request_id: str | None, reason: str) -> None:
        self._on_result(
            SaveResult(
                step=step, request_id=request_id, ok=False, duration_s=0.0, path="", reason=reason
            )
        )

    def _capture(self, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        s = self.state
        msd, osd = self._model_optim_state()
        rank_state: dict[str, Any] = {
            "format_version": 1,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "rng": capture_rng(),
            "sampler": s.sampler.state_dict() if s.sampler is not None else None,
            "scheduler": s.scheduler.state_dict() if s.scheduler is not None else None,
            "scaler": s.scaler.state_dict() if s.scaler is not None else None,
            "extra": {name: obj.state_dict() for name, obj in s.extra.items()},
        }
        # Model and optimizer tensors go to the bulk writer (DCP shards, or one raw tensor
        # file per rank); their structure and every other value stay in the rank file.
        tensors, rank_state["skeleton"] = split_tensors({"model": msd, "optim": osd})
        check_storable(rank_state)
        return rank_state, tensors

    def _model_optim_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model, optimizer = self.state.model, self.state.optimizer
        if self.coord.distributed:
            # Deferred heavy dependency: torch.distributed.checkpoint adds ~700 modules (~0.6 s)
            # to torch's import and only distributed runs use it (capture sharded state for a save).
            from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
                get_model_state_dict,
                get_state_dict,
            )

            if optimizer is None:
                return dict(get_model_state_dict(model)), {}
            msd, osd = get_state_dict(model, optimizer)
            return dict(msd), dict(osd)
        osd = optimizer.state_dict() if optimizer is not None else {}
        return model.state_dict(), osd

    # --- loading ----------------------------------------------------------------------------

    def restore_latest(self) -> tuple[int, Manifest] | None:
        """Agree on the newest good checkpoint and load it; None when there is none."""
        found = self.latest()
        if found is not None:
            self.load(*found)
        return found

    def latest(self) -> tuple[int, Manifest] | None:
        """Rank 0 verifies and picks; every rank loads the step it broadcasts (shared FS).
        A checkpoint of another job makes every rank raise `ForeignCheckpoint`."""
        step = -1
        foreign: ForeignCheckpoint | None = None
        self.skipped = []
        if self.rank == 0:
            try:
                found = find_latest_good(self.ckpt_dir, skipped=self.skipped)
                if found is not None:
                    check_job(found[2], job=self.job, where=str(found[1]))
                    self.restore_source = "local"
                elif self.s3 is not None or self.replica is not None:
                    found = self._fetch_remote()
            except ForeignCheckpoint as e:
                found, foreign = None, e
            if self.skipped:
                log.error(
                    "event=checkpoint_fallback job=%s rank=%d skipped_steps=%s step=%s "
                    "file=%s reason=%s",
                    self.job,
                    self.rank,
                    ",".join(str(s) for s, _ in self.skipped),
                    found[0] if found is not None else "none",
                    self.skipped[0][1].file,
                    self.skipped[0][1].reason.replace(" ", "_"),
                )
            if found is not None:
                step = found[0]
            elif foreign is not None:
                step = _FOREIGN
        step = self.coord.broadcast_int(step)
        if step == _FOREIGN:
            where, _, theirs = self.coord.broadcast_str(
                f"{foreign.where}\0{foreign.theirs}" if foreign is not None else ""
            ).partition("\0")
            log.error(
                "event=checkpoint_refused job=%s rank=%d other_job=%s where=%s",
                self.job,
                self.rank,
                theirs,
                where,
            )
            raise ForeignCheckpoint(where, theirs=theirs, ours=self.job)
        if step < 0:
            return None
        return step, read_manifest(self.ckpt_dir / step_dir_name(step))

    def load(self, step: int, manifest: Manifest) -> None:
        """Load the checkpoint of `step` into the live objects (every rank)."""
        s = self.state
        path = self.ckpt_dir / step_dir_name(step)
        same_world = manifest.world_size == self.world_size
        if not same_world and not (manifest.format == "dcp" and self.coord.distributed):
            raise CheckpointMismatch(
                f"{path}: written by world size {manifest.world_size} in format "
                f"{manifest.format!r}, this run has world size {self.world_size} "
                f"{'with' if self.coord.distributed else 'without'} a process group; only a "
                "checkpoint written with a process group (format 'dcp') loads at another world "
                "size, and only into a run with one (torchrun --nproc-per-node 1 for one rank)"
            )
        # At another world size the saved ranks are not this run's ranks: rank 0's file gives
        # the structure of the state and the values every rank shares (scheduler, scaler,
        # data position in samples, extras), and DCP reshards the tensors.
        rs = load_rank_file(path / rank_file_name(self.rank if same_world else 0))
        if manifest.format == "dcp":
            self._load_dcp(path, rs)
        elif manifest.format in ("tensors", DELTA_FORMAT):
            flat = self._read_tensors(path, manifest, rs)
            full = fill_tensors(rs["skeleton"], flat)
            s.model.load_state_dict(full["model"])
            if s.optimizer is not None:
                s.optimizer.load_state_dict(full["optim"])
        else:
            raise CheckpointMismatch(f"{path}: unknown checkpoint format {manifest.format!r}")
        if s.scheduler is not None and rs.get("scheduler") is not None:
            s.scheduler.load_state_dict(rs["scheduler"])
        if s.scaler is not None and rs.get("scaler") is not None:
            s.scaler.load_state_dict(rs["scaler"])
        if s.sampler is not None and rs.get("sampler") is not None:
            s.sampler.load_state_dict(rs["sampler"])
        for name, obj in s.extra.items():
            if name not in rs["extra"]:
                raise CheckpointMismatch(f"{path}: no state for extra {name!r}")
            obj.load_state_dict(rs["extra"][name])
        link = delta_link(manifest, where=str(path))
        self._track_base(
            step=step,
            base_step=link.base_step if link is not None else None,
            index=link.index if link is not None else 0,
        )
        if manifest.format == "dcp":
            self._base = None
        if same_world:
            restore_rng(rs["rng"])
            return
        seed = derive_rng(rs["rng"], step=step, rank=self.rank, world_size=self.world_size)
        log.info(
            "event=resumed_at_other_world_size job=%s rank=%d step=%d saved_world_size=%d "
            "world_size=%d rng_seed=%d",
            self.job,
            self.rank,
            step,
            manifest.world_size,
            self.world_size,
            seed,
        )

    def _read_tensors(
        self, path: Path, manifest: Manifest, rs: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        """A full checkpoint's tensor file, or a delta decoded against its base. The link is
        checked again (the base's manifest is the one the delta was written on, the base's
        files hash to it): a base replaced since `latest()` is never decoded against."""
        if manifest.format == "tensors":
            return read_tensor_file(path / tensor_file_name(self.rank), rs["tensor_index"])
        link = delta_link(manifest, where=str(path))
        assert link is not None  # format "delta"
        base_dir = self.ckpt_dir / step_dir_name(link.base_step)
        if manifest_sha256(base_dir) != link.base_manifest_sha256:
            raise CheckpointInvalid(str(base_dir), "base manifest differs from the delta's link")
        base = read_base(base_dir, step=link.base_step, rank=self.rank)
        return read_delta_file(path / delta_file_name(self.rank), rs["delta_index"], base=base)

    def _load_dcp(self, path: Path, rs: dict[str, Any]) -> None:
        # Deferred heavy dependency: torch.distributed.checkpoint adds ~700 modules (~0.6 s)
        # to torch's import and only distributed runs use it (load a DCP checkpoint).
        from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415
        from torch.distributed.checkpoint import load as dcp_load  # noqa: PLC0415
        from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
            set_model_state_dict,
            set_state_dict,
        )

        model, optimizer = self.state.model, self.state.optimizer
        msd, osd = self._model_optim_state()
        target, _ = split_tensors({"model": msd, "optim": osd})
        dcp_load(
            target,
            storage_reader=FileSystemReader(str(path / "dcp")),
            process_group=getattr(self.coord, "sync_group", None),
        )
        full = fill_tensors(rs["skeleton"], target)
        if optimizer is None:
            set_model_state_dict(model, full["model"])
        else:
            set_state_dict(
                model,
                optimizer,
                model_state_dict=full["model"],
                optim_state_dict=full["optim"],
            )

    def _remote_steps(self, source: str, store: S3Store | None) -> list[int]:
        """The steps with a manifest in one remote; [] when it is absent or unreachable."""
        if store is None:
            return []
        try:
            return store.remote_steps()
        except Exception as e:  # a missing bucket, an unreachable endpoint, no credentials
            log.error(
                "event=s3_list_failed job=%s source=%s bucket=%s reason=%s",
                self.job,
                source,
                store.config.bucket,
                str(e).replace(" ", "_"),
            )
            return []

    def _fetch_remote(self) -> tuple[int, Path, Manifest] | None:
        """The newest checkpoint that verifies in the primary bucket or, when the primary is
        gone there (no bucket, no endpoint, a corrupt copy), in the replica: newest step first,
        the primary first for each step."""
        listed = {
            source: set(self._remote_steps(source, store))
            for source, store in (("s3", self.s3), ("replica", self.replica))
        }
        for step in sorted(listed["s3"] | listed["replica"], reverse=True):
            for source, store in (("s3", self.s3), ("replica", self.replica)):
                if store is None or step not in listed[source]:
                    continue
                found = self._fetch_one(source, store, step)
                if found is not None:
                    return found
        return None

    def _fetch_one(
        self, source: str, store: S3Store, step: int
    ) -> tuple[int, Path, Manifest] | None:
        tmp = self.ckpt_dir / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
        try:
            store.download(step, tmp)
            manifest = verify_dir(tmp, expected_step=step)
        except ForeignCheckpoint:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        except (CheckpointInvalid, Exception) as e:
            log.warning(
                "event=checkpoint_skipped source=%s step=%d reason=%s",
                source,
                step,
                str(e).replace(" ", "_"),
            )
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        if not self._fetch_base(source, store, manifest):
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        final = self.ckpt_dir / step_dir_name(step)
        commit_dir(tmp, final)
        self.restore_source = source
        log.log(
            logging.WARNING if source == "replica" else logging.INFO,
            "event=checkpoint_restored job=%s step=%d source=%s bucket=%s",
            self.job,
            step,
            source,
            store.config.bucket,
        )
        return step, final, manifest

    def _fetch_base(self, source: str, s3: S3Store, manifest: Manifest) -> bool:
        """For a delta fetched from a bucket (`source`: s3 or replica): its base verifies
        locally, or is fetched from that bucket (and verified) too. False (with a log line)
        when no good base is to be had: skip the delta."""
        link = delta_link(manifest)
        if link is None:
            return True
        with contextlib.suppress(CheckpointInvalid):
            verify_link(self.ckpt_dir, manifest)
            return True
        tmp = self.ckpt_dir / f"{step_dir_name(link.base_step)}.tmp-{secrets.token_hex(4)}"
        try:
            s3.download(link.base_step, tmp)
            verify_dir(tmp, expected_step=link.base_step)
            commit_dir(tmp, self.ckpt_dir / step_dir_name(link.base_step))
            verify_link(self.ckpt_dir, manifest)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning(
                "event=checkpoint_skipped source=%s step=%d base_step=%d reason=%s",
                source,
                manifest.step,
                link.base_step,
                str(e).replace(" ", "_"),
            )
            return False
        return True

    # --- the directory at start -------------------------------------------------------------

    def _open_directory(self) -> str:
        """Rank 0 creates the directory, fences it and removes stale temporary directories;
        the broadcast of the outcome is also a barrier: no rank starts writing before that.
        A refusal travels in place of the run nonce, so every rank raises it. Returns this
        run's nonce (names its temporary directories)."""
        refusal = ""
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            refusal = self._fence()
            if not refusal:
                clean_stale(self.ckpt_dir)
        run_nonce = self.coord.broadcast_str(refusal or f"ok:{secrets.token_hex(4)}")
        if run_nonce.startswith("ok:"):
            return run_nonce.removeprefix("ok:")
        if self.launch_lock is not None:
            self.launch_lock.release()
        kind, _, detail = run_nonce.partition(":")
        log.error(
            "event=launch_refused job=%s rank=%d epoch=%s reason=%s",
            self.job,
            self.rank,
            self.epoch,
            detail.replace(" ", "_"),
        )
        if kind == "stale":
            mine, _, current = detail.partition(":")
            raise StaleAttempt(epoch=int(mine), current=int(current))
        raise LaunchLocked(detail)

    def _fence(self) -> str:
        """Rank 0, at start: take the launch lock and raise the directory's epoch to ours.
        Returns "" or the refusal every rank raises ("stale:<ours>:<theirs>", "locked:<why>")."""
        if self.epoch is None:
            return ""
        lock = LaunchLock(self.ckpt_dir, epoch=self.epoch, clock=self.clock)
        try:
            lock.acquire(timeout_s=self.settings.launch_lock_timeout_s)
        except LaunchLocked as e:
            return f"locked:{e}"
        self.launch_lock = lock
        try:
            previous = raise_epoch(self.ckpt_dir, self.epoch)
        except StaleAttempt as e:
            return f"stale:{e.epoch}:{e.current}"
        if previous != self.epoch:
            log.info(
                "event=epoch_raised job=%s dir=%s epoch=%d previous=%s",
                self.job,
                self.ckpt_dir,
                self.epoch,
                "-" if previous is None else previous,
            )
        return ""
