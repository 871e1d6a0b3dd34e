"""The controller's durable state: one SQLite file (WAL) by default, or a PostgreSQL database
(`store.url`), with one versioned, migrated schema.

`Store` opens the database and holds one repository per kind of row; rows never leave the
package: callers get the records of controller/records.py or the read models of
controller/views.py. The map:

- errors.py: StoreError (cannot open), StoreUnavailable (the database went away),
  LeaseLost (the write fence refused a write), StoreConnectError.
- connection.py: what the store uses of a connection, PostgreSQL URLs, PgConnection.
- dialect.py: the SQL spelled once (SQLite's) and rewritten for PostgreSQL; Dialect.
- database.py: Database, the one connection with its lock, `transaction()` (the write fence
  checked first), `query()`; sqlitefile.py: checks of an SQLite file; schema.py: migrations.
- rows.py: JSON as stored, a record from a row, the timeline insert the repositories share.
- nodes.py, jobs.py, events.py, commands.py, incidents.py (with timelines), actions.py,
  silences.py, breakers.py, audit.py: one repository each (`store.nodes`, `store.jobs`, ...).
- retention.py: bounded deletes of old rows; space.py: file sizes, vacuum, WAL checkpoints.
- lease.py: the HA leader lease and the fence it puts on every write transaction.

A write that spans tables runs in one transaction inside one repository method (an
incident with its first timeline entries, an action with its incident's entry, events with the
command results they carry, a job's placement with its nodes, retention's deletes); every
repository shares the one Database, so its lock and transaction are the store's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainguard.controller.store import schema
from trainguard.controller.store.actions import ActionRepository
from trainguard.controller.store.audit import AuditRepository
from trainguard.controller.store.breakers import BreakerRepository
from trainguard.controller.store.commands import CommandRepository
from trainguard.controller.store.database import Database, WriteFence
from trainguard.controller.store.dialect import Dialect
from trainguard.controller.store.errors import (
    LeaseLost,
    StoreConnectError,
    StoreError,
    StoreUnavailable,
)
from trainguard.controller.store.events import EventRepository
from trainguard.controller.store.incidents import IncidentRepository
from trainguard.controller.store.jobs import JobRepository
from trainguard.controller.store.nodes import NodeRepository
from trainguard.controller.store.retention import RetentionRepository
from trainguard.controller.store.silences import SilenceRepository
from trainguard.controller.store.space import SpaceRepository


class Store:
    """The store. Open with `Store(path, now=...)` (SQLite) or `Store("postgresql://...",
    now=..., password=...)`; migrates an older schema forward. Its repositories share one
    Database (one connection, one lock)."""

    def __init__(
        self,
        path: str | Path,
        *,
        now: Callable[[], float],
        password: str | None = None,
        connect_timeout_s: int = 10,
    ) -> None:
        self.db = Database(path, now=now, password=password, connect_timeout_s=connect_timeout_s)
        self.nodes = NodeRepository(self.db)
        self.jobs = JobRepository(self.db)
        self.events = EventRepository(self.db)
        self.commands = CommandRepository(self.db)
        self.incidents = IncidentRepository(self.db)
        self.actions = ActionRepository(self.db)
        self.silences = SilenceRepository(self.db)
        self.breakers = BreakerRepository(self.db)
        self.audit = AuditRepository(self.db)
        self.retention = RetentionRepository(self.db)
        self.space = SpaceRepository(self.db)

    @property
    def path(self) -> str:
        """The SQLite file, or the PostgreSQL URL with its password elided."""
        return self.db.path

    @property
    def dialect(self) -> Dialect:
        return self.db.dialect

    @property
    def fence(self) -> WriteFence | None:
        """None (one controller): every write goes through. HA sets it before the first write."""
        return self.db.fence

    @fence.setter
    def fence(self, fence: WriteFence | None) -> None:
        self.db.fence = fence

    def close(self) -> None:
        self.db.close()

    def check_fence(self) -> None:
        """Raise LeaseLost unless this process may write now (HA: it holds the lease, checked
        in the store); a no-op without a fence. The action worker calls it before each step's
        side effects outside the store."""
        self.db.check_fence()

    def schema_version(self) -> int:
        return schema.schema_version(self.db)


__all__ = [
    "LeaseLost",
    "Store",
    "StoreConnectError",
    "StoreError",
    "StoreUnavailable",
    "WriteFence",
]
