"""The leader lease of controllers sharing one store, and the fence it puts on the store.

One row (`controller_lease`, store/schema.py migration 5) says who leads: holder, advertise
URL, epoch and expiry. `Lease` takes it when it is free or expired (epoch + 1) and renews it
while held, each in one conditional UPDATE, on a connection of its own (a long store
transaction never delays a renewal). On PostgreSQL every time in the row is the DATABASE's
clock (clock_timestamp()), so the controllers' clocks may disagree; only the lease's length is
measured locally, on the monotonic clock, from before the request that set it.

`LeaseFence` is what the store checks first in every write transaction (Store.fence; a refused
write raises LeaseLost): the local deadline has not passed AND the row still names this holder
and epoch, unexpired; on PostgreSQL the row is read FOR SHARE, so a takeover's UPDATE waits for
the transaction to commit and a write can never land under an epoch that has been replaced. A
controller whose lease lapsed (stopped, partitioned, or its store gone) therefore writes
nothing, and as every side effect outside the store follows a fenced write of its step, it
does nothing either.
Why not a PostgreSQL advisory lock: it belongs to a session, and a stopped process (SIGSTOP,
a VM paused, a GC pause) keeps its session and so its lock while it cannot act, and when it
resumes nothing tells it another leader would have been right; there is no epoch to fence.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from trainguard.clock import Clock
from trainguard.controller.store.connection import Connection, connect_postgres
from trainguard.controller.store.dialect import Dialect
from trainguard.controller.store.errors import LeaseLost

__all__ = ["Lease", "LeaseFence", "LeaseState", "lease_connection"]

log = logging.getLogger("trainguard.controller.lease")

# The database's clock in unix seconds. clock_timestamp(), not now(): now() is when the
# transaction began, which a statement that waited on the row lock would read in the past.
_PG_NOW = "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"


@dataclass(frozen=True)
class LeaseState:
    """The lease row as read, with the database's time of the read."""

    holder: str
    advertise_url: str
    epoch: int
    expires_at: float
    db_now: float

    @property
    def held(self) -> bool:
        return bool(self.holder) and self.expires_at > self.db_now


def safety_margin_s(lease_s: float) -> float:
    """How much earlier than the database this process counts its lease as over: clock
    rates differ a little, and a renewal's answer can arrive late."""
    return lease_s / 10


class Lease:
    """The lease row through `conn` (autocommit: every call is one statement). `now`: the
    clock the row's times are on; None = the database's (PostgreSQL). Tests on SQLite pass
    a fake clock's `now`."""

    def __init__(
        self,
        conn: Connection,
        *,
        dialect: Dialect,
        holder: str,
        advertise_url: str,
        lease_s: float,
        now: Callable[[], float] | None = None,
    ) -> None:
        if now is None and not dialect.postgres:
            raise ValueError("a lease on SQLite needs a clock (`now`)")
        self._conn = conn
        self.holder = holder
        self.advertise_url = advertise_url
        self.lease_s = lease_s
        self._now = now
        self._now_sql = ":now" if now is not None else _PG_NOW
        self._lock = threading.Lock()

    def _run(self, sql: str, **params: Any) -> list[Any]:
        params["now"] = self._now() if self._now is not None else 0.0
        with self._lock:
            return list(self._conn.execute(sql.replace("NOW", self._now_sql), params).fetchall())

    def read(self) -> LeaseState:
        rows = self._run(
            "SELECT holder, advertise_url, epoch, expires_at, NOW AS db_now FROM controller_lease"
            " WHERE id = 1"
        )
        r = rows[0]
        return LeaseState(
            holder=str(r[0]),
            advertise_url=str(r[1]),
            epoch=int(r[2]),
            expires_at=float(r[3]),
            db_now=float(r[4]),
        )

    def acquire(self) -> int | None:
        """Take the lease if it is free or expired, or still this holder's own (a controller
        that stepped down, its store back before the lease ran out, takes it again without
        waiting): its new epoch, or None (another holds it). Always a new epoch: what the
        old one began is fenced off."""
        rows = self._run(
            "UPDATE controller_lease SET holder = :holder, advertise_url = :url,"
            " epoch = epoch + 1, expires_at = NOW + :lease_s, acquired_at = NOW,"
            " renewed_at = NOW WHERE id = 1 AND (expires_at <= NOW OR holder = :holder)"
            " RETURNING epoch",
            holder=self.holder,
            url=self.advertise_url,
            lease_s=self.lease_s,
        )
        return int(rows[0][0]) if rows else None

    def renew(self, epoch: int) -> bool:
        """Extend the lease held under `epoch`; False if it lapsed or another took it."""
        rows = self._run(
            "UPDATE controller_lease SET expires_at = NOW + :lease_s, renewed_at = NOW"
            " WHERE id = 1 AND holder = :holder AND epoch = :epoch AND expires_at > NOW"
            " RETURNING epoch",
            holder=self.holder,
            epoch=epoch,
            lease_s=self.lease_s,
        )
        return bool(rows)

    def release(self, epoch: int) -> bool:
        """Give the lease up (a clean stop): another controller may take it at once."""
        rows = self._run(
            "UPDATE controller_lease SET expires_at = 0 WHERE id = 1 AND holder = :holder"
            " AND epoch = :epoch RETURNING epoch",
            holder=self.holder,
            epoch=epoch,
        )
        return bool(rows)


class LeaseFence:
    """Store.fence of one controller incarnation: refuses every write unless `grant`ed an
    epoch whose local deadline has not passed and the lease row agrees, in the transaction."""

    def __init__(
        self,
        *,
        holder: str,
        dialect: Dialect,
        clock: Clock,
        now: Callable[[], float] | None = None,
    ) -> None:
        self.holder = holder
        self._clock = clock
        self._now = now
        self._sql = (
            "SELECT epoch FROM controller_lease WHERE id = 1 AND holder = :holder"  # noqa: S608
            " AND epoch = :epoch AND expires_at > "
            + (":now" if now is not None else _PG_NOW)
            + (" FOR SHARE" if dialect.postgres else "")
        )
        self._epoch: int | None = None
        self._deadline = 0.0  # on clock.monotonic()

    @property
    def epoch(self) -> int | None:
        return self._epoch

    def grant(self, epoch: int, *, deadline: float) -> None:
        self._epoch = epoch
        self._deadline = deadline

    def extend(self, deadline: float) -> None:
        self._deadline = max(self._deadline, deadline)

    def revoke(self) -> None:
        self._epoch = None

    def valid(self) -> bool:
        """This process may still act by its own count (no store round trip)."""
        return self._epoch is not None and self._clock.monotonic() < self._deadline

    def check(self, c: Connection) -> None:
        epoch = self._epoch
        if epoch is None:
            raise LeaseLost("this controller is a standby: it does not write")
        if self._clock.monotonic() >= self._deadline:
            raise LeaseLost(f"the lease of epoch {epoch} ran out before it was renewed")
        params = {
            "holder": self.holder,
            "epoch": epoch,
            "now": self._now() if self._now is not None else 0.0,
        }
        if c.execute(self._sql, params).fetchone() is None:
            raise LeaseLost(f"the lease of epoch {epoch} is no longer this controller's")


def lease_connection(url: str, *, password: str | None, timeout_s: float) -> Any:
    """A PostgreSQL connection of its own for the lease, whose statements give up after
    `timeout_s` (a renewal must not hang past the lease on a lost server): the server's
    statement_timeout, and TCP settings for a server that answers nothing at all."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if not any(k == "options" for k, _ in query):
        query.append(("options", f"-c statement_timeout={int(timeout_s * 1000)}"))
    url = urlunsplit(parts._replace(query=urlencode(query, quote_via=quote)))
    return connect_postgres(
        url, password=password, connect_timeout_s=max(1, int(timeout_s)), tcp_timeout_s=timeout_s
    )
