"""The store's maintenance: what to delete and reclaim (plain functions over a Store, tested
on a fake clock) and the scheduler that runs them as the controller's background jobs.

Jobs (APScheduler BackgroundScheduler, one worker thread, `max_instances=1` and coalescing,
so a slow run is never stacked with the next and missed runs collapse into one):
- `retention` every `maintenance.retention_interval_s`: `run_retention` deletes old rows in
  bounded batches, then `run_vacuum` gives the freed pages back (the file shrinks);
- `checkpoint` every `maintenance.checkpoint_interval_s`: `run_checkpoint` copies the WAL
  into the file and truncates the -wal file.
A job body that raises is logged and counted (trainguard_controller_maintenance_errors_total)
and the next run comes as scheduled: maintenance never stops the controller.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler  # type: ignore[import-untyped]
from apscheduler.triggers.interval import IntervalTrigger  # type: ignore[import-untyped]

from trainguard.clock import Clock
from trainguard.controller.config import MaintenanceConfig, RetentionConfig
from trainguard.controller.metrics import ControllerMetrics
from trainguard.controller.store import Store

log = logging.getLogger("trainguard.controller")

# The first retention run comes this long after start rather than a whole interval later:
# a controller restarted more often than retention_interval_s must still get its runs.
FIRST_RETENTION_DELAY_S = 60.0
# Free pages given back per lock hold: a few ms of I/O, so the API and the tick never wait
# long for the store while a large vacuum runs.
VACUUM_PAGES_PER_STEP = 2048


@dataclass(frozen=True)
class RetentionResult:
    """Rows deleted per table by one retention run, and the batches (transactions) it took."""

    deleted: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    complete: bool = True  # False: stopped early by `cancelled`, the rest waits for next run

    @property
    def total(self) -> int:
        return sum(self.deleted.values())


def _drain(batch: Callable[[], int], cancelled: Callable[[], bool], limit: int) -> tuple[int, int]:
    """Run `batch` (one transaction deleting at most `limit` rows) until a batch comes back
    short; returns (rows, batches)."""
    rows = batches = 0
    while not cancelled():
        n = batch()
        batches += 1
        rows += n
        if n < limit:
            break
    return rows, batches


def run_retention(
    store: Store,
    *,
    now: float,
    policy: RetentionConfig,
    cancelled: Callable[[], bool] = lambda: False,
) -> RetentionResult:
    """Delete what `policy` no longer keeps as of `now`, table by table, each in batches of
    `policy.batch_rows` rows per transaction (the store's lock is free between batches).
    `cancelled` is asked before each batch (the controller is stopping)."""
    limit = policy.batch_rows
    deleted: dict[str, int] = {}
    batches = 0

    def simple(table: str, key: str, expire: Callable[..., int]) -> None:
        nonlocal batches
        age_s = policy.max_age_s(key)
        if age_s is None:
            return
        rows, n = _drain(lambda: expire(now=now, max_age_s=age_s, limit=limit), cancelled, limit)
        deleted[table] = deleted.get(table, 0) + rows
        batches += n

    simple("events", "events", store.retention.expire_events)
    simple("commands", "commands", store.retention.expire_commands)
    incidents_age_s = policy.max_age_s("incidents")
    if incidents_age_s is not None:
        while not cancelled():
            got = store.retention.expire_incidents(now=now, max_age_s=incidents_age_s, limit=limit)
            batches += 1
            for table, n in got.items():
                deleted[table] = deleted.get(table, 0) + n
            if got["incidents"] == 0:
                break
    simple("actions", "operator_actions", store.retention.expire_operator_actions)
    simple("audit_log", "audit", store.retention.expire_audit)
    return RetentionResult(deleted=deleted, batches=batches, complete=not cancelled())


def run_vacuum(
    store: Store, *, max_pages: int, cancelled: Callable[[], bool] = lambda: False
) -> int:
    """Give up to `max_pages` free pages back to the filesystem, a step at a time; returns
    how many went. The file shrinks at the next WAL checkpoint."""
    freed = 0
    while freed < max_pages and not cancelled():
        n = store.space.incremental_vacuum(pages=min(VACUUM_PAGES_PER_STEP, max_pages - freed))
        if n == 0:
            break
        freed += n
    return freed


@dataclass(frozen=True)
class CheckpointResult:
    busy: bool  # another connection held the WAL: retried at the next run
    wal_frames: int
    checkpointed_frames: int
    wal_bytes_before: int
    wal_bytes_after: int


def run_checkpoint(store: Store) -> CheckpointResult:
    """Copy the WAL into the database file and truncate the -wal file (TRUNCATE)."""
    _, wal_before = store.space.file_sizes()
    busy, frames, done = store.space.checkpoint_wal(mode="TRUNCATE")
    _, wal_after = store.space.file_sizes()
    return CheckpointResult(busy, frames, done, wal_before, wal_after)


class MaintenanceScheduler:
    """Owns the BackgroundScheduler that runs the maintenance jobs for one controller."""

    def __init__(
        self,
        *,
        store: Store,
        config: MaintenanceConfig,
        metrics: ControllerMetrics,
        clock: Clock,
    ) -> None:
        self._store = store
        self._config = config
        self._metrics = metrics
        self._clock = clock
        self._stopping = threading.Event()
        self._scheduler: BackgroundScheduler | None = None
        metrics.watch_store_size(store.space.file_sizes)

    @property
    def running(self) -> bool:
        return self._scheduler is not None and self._scheduler.running

    def job_ids(self) -> list[str]:
        return [] if self._scheduler is None else [j.id for j in self._scheduler.get_jobs()]

    def start(self) -> None:
        """Start the scheduler thread with both jobs (nothing when maintenance is disabled)."""
        if not self._config.enabled or self.running:
            return
        self._stopping.clear()
        # one worker: the jobs share the store's one connection, so running them side by side
        # would only queue them on its lock
        scheduler = BackgroundScheduler(
            executors={"default": {"type": "threadpool", "max_workers": 1}},
            job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None},
            timezone=timezone.utc,
        )
        started = datetime.now(timezone.utc)
        retention_s = self._config.retention_interval_s
        scheduler.add_job(
            self.retention_job,
            IntervalTrigger(seconds=retention_s, timezone=timezone.utc),
            id="retention",
            name="store retention and incremental vacuum",
            next_run_time=started + timedelta(seconds=min(FIRST_RETENTION_DELAY_S, retention_s)),
        )
        scheduler.add_job(
            self.checkpoint_job,
            IntervalTrigger(seconds=self._config.checkpoint_interval_s, timezone=timezone.utc),
            id="checkpoint",
            name="store WAL checkpoint",
        )
        scheduler.start()
        self._scheduler = scheduler
        log.info(
            "event=maintenance_started retention_interval_s=%s checkpoint_interval_s=%s",
            retention_s,
            self._config.checkpoint_interval_s,
        )

    def stop(self) -> None:
        """Stop the scheduler; a running job stops at its next batch and is waited for."""
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is None:
            return
        self._stopping.set()
        scheduler.shutdown(wait=True)

    def run_now(self, job_id: str) -> None:
        """Move a job's next run to now (an operator or a test asking for a run)."""
        if self._scheduler is None:
            raise RuntimeError("the maintenance scheduler is not running")
        self._scheduler.modify_job(job_id, next_run_time=datetime.now(timezone.utc))

    # --- the job bodies, each wrapped so an error is logged, counted and survived ------------

    def retention_job(self) -> None:
        self._guarded("retention", self._retention)

    def checkpoint_job(self) -> None:
        self._guarded("checkpoint", self._checkpoint)

    def _guarded(self, job: str, body: Callable[[], Any]) -> None:
        try:
            body()
        except Exception:
            self._metrics.maintenance_errors_total.labels(job=job).inc()
            log.exception("event=maintenance_error job=%s", job)
            return
        self._metrics.maintenance_last_run_timestamp_seconds.labels(job=job).set(self._clock.now())

    def _retention(self) -> None:
        started = self._clock.monotonic()
        result = run_retention(
            self._store,
            now=self._clock.now(),
            policy=self._config.retention,
            cancelled=self._stopping.is_set,
        )
        for table, n in result.deleted.items():
            if n:
                self._metrics.retention_deleted_rows_total.labels(table=table).inc(n)
        pages = run_vacuum(
            self._store, max_pages=self._config.vacuum_max_pages, cancelled=self._stopping.is_set
        )
        if pages:
            run_checkpoint(self._store)  # in WAL mode the file shrinks at the checkpoint
        log.info(
            "event=retention_done deleted=%d batches=%d vacuum_pages=%d complete=%s took_s=%.3f %s",
            result.total,
            result.batches,
            pages,
            result.complete,
            self._clock.monotonic() - started,
            " ".join(f"{t}={n}" for t, n in sorted(result.deleted.items())),
        )

    def _checkpoint(self) -> None:
        result = run_checkpoint(self._store)
        if result.busy:
            log.info("event=wal_checkpoint_busy frames=%d", result.wal_frames)


__all__ = [
    "CheckpointResult",
    "MaintenanceScheduler",
    "RetentionResult",
    "run_checkpoint",
    "run_retention",
    "run_vacuum",
]
