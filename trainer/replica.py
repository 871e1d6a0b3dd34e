"""The second-region copy of committed checkpoints: its config, its bookkeeping and its thread.

After a commit (and its primary upload) rank 0 hands the checkpoint to the `Replicator`, whose
own thread copies it to a second bucket (another endpoint or region), reads every file back
against the manifest's sizes and checksums, and only then counts it replicated and applies the
job's retention to the replica (never the newest verified replicated checkpoint). A failed copy
is retried with exponential backoff, at most `max_attempts` times, and reported; a newer commit
supersedes a checkpoint still waiting. Nothing here ever deletes from the primary, and the
training step never waits for a copy. `ReplicaLedger` is the pure part (what is replicated, the
lag, when to retry), on an injected clock.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.kinds import TrainerEdge
from trainguard.trainer.manifest import read_manifest
from trainguard.trainer.retention import RetentionPolicy
from trainguard.trainer.s3 import S3Config, S3Store, default_prefix

__all__ = [
    "REPLICA_ENV",
    "ReplicaConfig",
    "ReplicaEvent",
    "ReplicaLedger",
    "ReplicaStatus",
    "Replicator",
    "replica_from_env",
]

log = logging.getLogger("trainguard.trainer")

# A job spec sets the replica without code:
# `env: {TRAINGUARD_REPLICA: '{"bucket": "ckpts-dr", "region_name": "eu-west-1"}'}`.
REPLICA_ENV = "TRAINGUARD_REPLICA"

# S3's bucket naming rules (3-63 lowercase letters, digits, dots, hyphens; a letter or digit
# at each end): a typo fails at start rather than at the first copy, minutes later.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_REGION = re.compile(r"^[a-z0-9-]{1,32}$")
_MAX_ATTEMPTS = 100
_MAX_BACKOFF_S = 3600.0
# Checkpoints submitted but not yet replicated, remembered for the lag (the oldest is what
# counts); beyond this many, middle entries go (a replica down for days).
_MAX_WAITING = 1024


@dataclass(frozen=True)
class ReplicaConfig:
    """Where the second copy goes and how hard to try. Credentials come from the usual boto3
    chain, as for the primary (`S3Config`); they are never part of this config."""

    bucket: str
    prefix: str | None = None  # None: trainguard/<job>, as the primary's default
    endpoint_url: str | None = None  # another endpoint (an S3-compatible store, a test server)
    region_name: str | None = None  # the second region
    # Copies of one checkpoint before it is reported failed (a newer commit starts afresh).
    max_attempts: int = 5
    # Delay before the first retry, doubling each time up to `max_backoff_s`.
    backoff_s: float = 2.0
    max_backoff_s: float = 300.0
    # How long the trainer's close() waits for the copy in flight (a job that ends leaves its
    # newest checkpoint replicated when the replica is reachable).
    close_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not _BUCKET.fullmatch(self.bucket):
            raise ValueError(
                f"replica.bucket must be an S3 bucket name (3-63 lowercase letters, digits, "
                f"'.' or '-'), got {self.bucket!r}"
            )
        if self.prefix is not None and (
            not isinstance(self.prefix, str) or len(self.prefix) > 512 or "\0" in self.prefix
        ):
            raise ValueError(
                f"replica.prefix must be a key prefix of at most 512 characters, got "
                f"{self.prefix!r}"
            )
        if self.endpoint_url is not None and (
            not isinstance(self.endpoint_url, str)
            or not self.endpoint_url.startswith(("http://", "https://"))
        ):
            raise ValueError(
                f"replica.endpoint_url must be an http:// or https:// URL, got "
                f"{self.endpoint_url!r}"
            )
        if self.region_name is not None and (
            not isinstance(self.region_name, str) or not _REGION.fullmatch(self.region_name)
        ):
            raise ValueError(
                f"replica.region_name must be a region name such as 'eu-west-1', got "
                f"{self.region_name!r}"
            )
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int):
            raise ValueError(f"replica.max_attempts must be an integer, got {attempts!r}")
        if not 1 <= attempts <= _MAX_ATTEMPTS:
            raise ValueError(
                f"replica.max_attempts must be in [1, {_MAX_ATTEMPTS}], got {attempts}"
            )
        for name in ("backoff_s", "max_backoff_s", "close_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"replica.{name} must be a number, got {value!r}")
            if not 0 < value <= _MAX_BACKOFF_S:
                raise ValueError(f"replica.{name} must be in (0, {_MAX_BACKOFF_S:g}], got {value}")
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(
                f"replica.max_backoff_s ({self.max_backoff_s}) must be at least replica.backoff_s "
                f"({self.backoff_s})"
            )

    @property
    def location(self) -> S3Config:
        return S3Config(
            bucket=self.bucket,
            prefix=self.prefix,
            endpoint_url=self.endpoint_url,
            region_name=self.region_name,
        )

    def check_apart_from(self, primary: S3Config | None, *, job: str) -> None:
        """ValueError when the replica is the primary itself (same endpoint, bucket, prefix):
        a copy onto itself is no second copy."""
        if primary is None:
            return
        mine = (self.endpoint_url, self.bucket, (self.prefix or default_prefix(job)).strip("/"))
        theirs = (
            primary.endpoint_url,
            primary.bucket,
            (primary.prefix if primary.prefix is not None else default_prefix(job)).strip("/"),
        )
        if mine == theirs:
            raise ValueError(
                f"replica is the primary itself (bucket {self.bucket!r}, same endpoint and "
                "prefix): give the replica another bucket, endpoint or region"
            )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any], *, where: str = "replica") -> ReplicaConfig:
        """Strict: an unknown key, a missing bucket or a bad value raise ValueError naming
        `where.key`."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"{where}.{unknown[0]}: unknown key (known: {', '.join(sorted(known))})"
            )
        if "bucket" not in data:
            raise ValueError(f"{where}.bucket: required key is missing")
        try:
            return cls(**dict(data))
        except ValueError as e:
            raise ValueError(str(e).replace("replica.", f"{where}.", 1)) from None


def replica_from_env(env: Mapping[str, str] | None = None) -> ReplicaConfig | None:
    """The replica in `TRAINGUARD_REPLICA` (a JSON object of ReplicaConfig fields; unset or
    empty: None). Strict: bad JSON, an unknown key or a bad value raise ValueError naming the
    variable and the key."""
    raw = (os.environ if env is None else env).get(REPLICA_ENV, "").strip()
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{REPLICA_ENV}: not a JSON object: {e}") from None
    return ReplicaConfig.from_json(data, where=REPLICA_ENV)


@dataclass(frozen=True)
class ReplicaStatus:
    """What the heartbeat reports: the newest verified replicated step (None: none yet in this
    run) and the lag, seconds since the oldest commit not yet replicated (0 when caught up)."""

    step: int | None
    lag_s: float
    failures: int  # copies failed in a row


@dataclass(frozen=True)
class ReplicaEvent:
    """An outcome for the heartbeat's edge events: `CHECKPOINT_REPLICATED` (with `lag_s`) or
    `CHECKPOINT_REPLICATION_FAILED` (with `reason`, `attempt` and, when one is coming,
    `retry_in_s`)."""

    kind: TrainerEdge
    step: int
    attempt: int = 0
    reason: str = ""
    retry_in_s: float | None = None
    lag_s: float | None = None


class ReplicaLedger:
    """Pure bookkeeping: what was submitted, what is replicated, the lag, the retry schedule."""

    def __init__(self, *, config: ReplicaConfig, clock: Clock) -> None:
        self.config = config
        self.clock = clock
        self.replicated_step: int | None = None
        self.failures = 0
        self._waiting: list[tuple[int, float]] = []  # (step, committed_at), oldest first

    def submitted(self, *, step: int, committed_at: float) -> None:
        if self.replicated_step is not None and step <= self.replicated_step:
            return
        self._waiting.append((step, committed_at))
        if len(self._waiting) > _MAX_WAITING:
            del self._waiting[1]  # the oldest stays: it is what the lag counts from

    def succeeded(self, step: int) -> float:
        """`step` is replicated and verified; the lag it had (seconds since its commit)."""
        lag_s = self.lag_s()
        self.replicated_step = max(step, self.replicated_step or step)
        self._waiting = [(s, t) for s, t in self._waiting if s > self.replicated_step]
        self.failures = 0
        return lag_s

    def failed(self, attempt: int) -> float | None:
        """Attempt `attempt` (1-based) of a copy failed: the delay before the next one, or None
        when the checkpoint has had its `max_attempts`."""
        self.failures += 1
        if attempt >= self.config.max_attempts:
            return None
        return min(self.config.max_backoff_s, self.config.backoff_s * 2.0 ** (attempt - 1))

    def lag_s(self) -> float:
        if not self._waiting:
            return 0.0
        return max(0.0, self.clock.now() - self._waiting[0][1])

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(step=self.replicated_step, lag_s=self.lag_s(), failures=self.failures)


class Replicator:
    """Copies committed checkpoints to the replica in a daemon thread of its own.

    `submit()` (the writer thread, after the primary upload) never waits for a copy; `status()`
    and `take_events()` are for the training thread's heartbeat; `close()` waits, bounded, for
    the copy in flight."""

    def __init__(
        self,
        *,
        store: S3Store,
        config: ReplicaConfig,
        policy: RetentionPolicy,
        job: str,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.store = store
        self.config = config
        self.policy = policy
        self.job = job
        self.clock = clock
        self._cond = threading.Condition()
        self._ledger = ReplicaLedger(config=config, clock=clock)
        self._pending: tuple[int, Path] | None = None
        self._busy = False
        self._copying: int | None = None
        self._closing = False
        self._events: list[ReplicaEvent] = []
        self._thread = threading.Thread(
            target=self._run, name="trainguard-replica", daemon=True
        )  # daemon: a copy stuck on a dead endpoint must never keep a finished job alive
        self._thread.start()

    @property
    def where(self) -> str:
        return f"s3://{self.config.bucket}/{self.store.prefix}"

    def submit(self, *, step: int, directory: Path, committed_at: float) -> None:
        """Replicate the committed checkpoint `step` in `directory` (a newer submit before its
        copy started replaces it: only the newest checkpoint is worth a copy)."""
        with self._cond:
            self._ledger.submitted(step=step, committed_at=committed_at)
            self._pending = (step, directory)
            self._cond.notify_all()

    def status(self) -> ReplicaStatus:
        with self._cond:
            return self._ledger.status()

    def take_events(self) -> list[ReplicaEvent]:
        with self._cond:
            out, self._events = self._events, []
        return out

    def copying(self) -> int | None:
        """The step whose copy is in progress (retries included), or None."""
        with self._cond:
            return self._copying

    def close(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the pending copy (retries included), then stop the thread.
        True when nothing was left to copy."""
        with self._cond:
            # A real wait (threading's own clock): nothing here measures or reports time.
            done = self._cond.wait_for(
                lambda: self._pending is None and not self._busy, timeout=timeout_s
            )
            self._closing = True
            self._cond.notify_all()
        self._thread.join(5.0)
        if not done:
            log.error(
                "event=checkpoint_replication_abandoned job=%s replica=%s reason=timeout",
                self.job,
                self.where,
            )
        return done

    # --- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None:
                    return
                step, directory = self._pending
                self._pending = None
                self._busy = True
                self._copying = step
            try:
                self._replicate(step, directory)
            finally:
                with self._cond:
                    self._busy = False
                    self._copying = None
                    self._cond.notify_all()

    def _replicate(self, step: int, directory: Path) -> None:
        attempt = 0
        while True:
            attempt += 1
            try:
                self._copy(step, directory)
            except Exception as e:  # boto3, the network, a missing bucket, a bad read-back
                reason = f"{type(e).__name__}: {e}".replace(" ", "_")[:300]
                with self._cond:
                    delay_s = self._ledger.failed(attempt)
                    self._events.append(
                        ReplicaEvent(
                            kind=TrainerEdge.CHECKPOINT_REPLICATION_FAILED,
                            step=step,
                            attempt=attempt,
                            reason=reason,
                            retry_in_s=delay_s,
                        )
                    )
                log_at = logging.WARNING if delay_s is not None else logging.ERROR
                log.log(
                    log_at,
                    "event=checkpoint_replication_failed job=%s step=%d attempt=%d "
                    "max_attempts=%d retry_in_s=%s replica=%s reason=%s",
                    self.job,
                    step,
                    attempt,
                    self.config.max_attempts,
                    "-" if delay_s is None else f"{delay_s:g}",
                    self.where,
                    reason,
                )
                if delay_s is None or self._wait_or_superseded(delay_s):
                    return
                continue
            with self._cond:
                lag_s = self._ledger.succeeded(step)
                self._events.append(
                    ReplicaEvent(kind=TrainerEdge.CHECKPOINT_REPLICATED, step=step, lag_s=lag_s)
                )
            log.info(
                "event=checkpoint_replicated job=%s step=%d attempt=%d lag_s=%.3f replica=%s",
                self.job,
                step,
                attempt,
                lag_s,
                self.where,
            )
            self._prune(step)
            return

    def _wait_or_superseded(self, delay_s: float) -> bool:
        """Back off for `delay_s`; True when a newer checkpoint (or close) ends the wait. Only
        `submit` and `close` notify while this thread waits, so one wait is the whole backoff."""
        with self._cond:
            if self._pending is None and not self._closing:
                self._cond.wait(delay_s)
            return self._pending is not None or self._closing

    def _copy(self, step: int, directory: Path) -> None:
        manifest = read_manifest(directory)
        if manifest.step != step:
            raise ValueError(f"{directory}: manifest of step {manifest.step}, expected {step}")
        self.store.upload(directory)
        self.store.verify_remote(manifest)

    def _prune(self, step: int) -> None:
        # Only after this checkpoint verified: the replica then holds a good newest copy, and
        # `apply_retention` never deletes `step` or anything newer.
        try:
            self.store.apply_retention(policy=self.policy, now=self.clock.now(), newest_step=step)
        except Exception as e:
            log.error(
                "event=checkpoint_replica_retention_failed job=%s step=%d replica=%s reason=%s",
                self.job,
                step,
                self.where,
                str(e).replace(" ", "_"),
            )
