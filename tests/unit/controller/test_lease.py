"""The leader lease and its fence (controller/store/lease.py), on both stores: taken when free or
expired with the next epoch, renewed only by its holder under its epoch, given up on release;
a store fenced by an epoch that was taken over writes nothing, and several contenders racing
for a free lease end with exactly one holder. On SQLite the row's times are a FakeClock's;
on PostgreSQL they are the database's own (clock_timestamp()), so expiry there is waited for
on a short lease."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.helpers import wait_for
from tests.integration.postgres_proc import BOTH_STORES
from trainguard.clock import FakeClock
from trainguard.controller.store import Store
from trainguard.controller.store.dialect import POSTGRES, SQLITE, Dialect
from trainguard.controller.store.errors import LeaseLost
from trainguard.controller.store.lease import Lease, LeaseFence, lease_connection, safety_margin_s

pytestmark = BOTH_STORES

LEASE_S = 10.0


@dataclass
class Site:
    """One store (migrated) plus the means to open lease connections and fenced stores on it."""

    location: str
    clock: FakeClock
    dialect: Dialect
    conns: list[Any]
    stores: list[Store]

    @property
    def db_now(self) -> Callable[[], float] | None:
        # SQLite: the row's times on the fake clock; PostgreSQL: the database's clock
        return self.clock.now if self.dialect is SQLITE else None

    def connection(self) -> Any:
        if self.dialect is SQLITE:
            conn: Any = sqlite3.connect(
                self.location, isolation_level=None, check_same_thread=False, timeout=30
            )
        else:
            conn = lease_connection(self.location, password=None, timeout_s=5)
        self.conns.append(conn)
        return conn

    def lease(self, holder: str, *, lease_s: float = LEASE_S) -> Lease:
        return Lease(
            self.connection(),
            dialect=self.dialect,
            holder=holder,
            advertise_url=f"http://{holder}:8800",
            lease_s=lease_s,
            now=self.db_now,
        )

    def store(
        self, holder: str | None = None, epoch: int | None = None, *, local_s: float = LEASE_S
    ) -> Store:
        """A store on the site; fenced for `holder` (granted `epoch` for `local_s` by the
        local count, when given)."""
        s = Store(self.location, now=self.clock.now)
        self.stores.append(s)
        if holder is not None:
            fence = LeaseFence(
                holder=holder, dialect=self.dialect, clock=self.clock, now=self.db_now
            )
            if epoch is not None:
                fence.grant(epoch, deadline=self.clock.monotonic() + local_s)
            s.fence = fence
        return s

    def expire(self, lease: Lease) -> None:
        """Let the lease run out: the fake clock on SQLite; a wait on PostgreSQL."""
        if self.dialect is SQLITE:
            self.clock.advance(lease.lease_s + 0.001)
            return
        wait_for(lambda: not lease.read().held, timeout_s=30, what="the lease to expire")


@pytest.fixture
def site(store_location: str) -> Iterator[Site]:
    dialect = POSTGRES if "://" in store_location else SQLITE
    s = Site(store_location, FakeClock(), dialect, [], [])
    s.store()  # migrates: the lease row exists from schema version 5
    yield s
    for st in s.stores:
        st.close()
    for conn in s.conns:
        conn.close()


def short(site: Site) -> float:
    """A lease length the test can wait out: long on the fake clock, 0.5 s on a real one."""
    return LEASE_S if site.dialect is SQLITE else 0.5


def test_a_free_lease_is_taken_with_epoch_1_and_refused_to_others_while_held(site: Site) -> None:
    a, b = site.lease("a"), site.lease("b")
    assert not a.read().held
    assert a.acquire() == 1
    state = b.read()
    assert state.held and state.holder == "a" and state.advertise_url == "http://a:8800"
    assert state.epoch == 1
    assert b.acquire() is None
    # its holder takes it again (after stepping down) only under a new epoch: the old one's
    # writes and renewals are refused from then on
    assert a.acquire() == 2
    assert not a.renew(1)
    assert b.acquire() is None


def test_only_the_holder_renews_and_only_under_its_epoch(site: Site) -> None:
    a, b = site.lease("a"), site.lease("b")
    epoch = a.acquire()
    assert epoch == 1
    before = a.read().expires_at
    if site.dialect is SQLITE:
        site.clock.advance(3)
    assert a.renew(epoch)
    assert a.read().expires_at > before
    assert not b.renew(epoch)
    assert not a.renew(epoch + 1)


def test_an_expired_lease_is_taken_with_the_next_epoch_and_the_old_holder_cannot_renew(
    site: Site,
) -> None:
    a, b = site.lease("a", lease_s=short(site)), site.lease("b", lease_s=short(site))
    assert a.acquire() == 1
    site.expire(a)
    assert not a.renew(1)  # lapsed: a renewal does not bring it back
    assert b.acquire() == 2
    assert b.read().holder == "b"
    assert not a.renew(1)


def test_release_hands_the_lease_over_at_once(site: Site) -> None:
    a, b = site.lease("a"), site.lease("b")
    assert a.acquire() == 1
    assert not b.release(1)  # only the holder releases
    assert a.release(1)
    assert b.acquire() == 2


def test_a_write_fenced_by_an_epoch_that_was_taken_over_is_refused_and_writes_nothing(
    site: Site,
) -> None:
    a_lease = site.lease("a", lease_s=short(site))
    b_lease = site.lease("b", lease_s=short(site))
    epoch_a = a_lease.acquire()
    assert epoch_a == 1
    # a local count that has not run out (a process whose clock runs slow): the row decides
    a = site.store("a", epoch_a, local_s=1000 * LEASE_S)
    a.audit.record(ts=1.0, actor="a", action="before", target="t", detail={})

    site.expire(a_lease)
    epoch_b = b_lease.acquire()
    assert epoch_b == 2
    b = site.store("b", epoch_b)
    b.audit.record(ts=2.0, actor="b", action="leader", target="t", detail={})

    with pytest.raises(LeaseLost, match="no longer this controller's"):
        a.audit.record(ts=3.0, actor="a", action="deposed", target="t", detail={})
    with pytest.raises(LeaseLost):
        a.check_fence()
    assert [e.action for e in site.store().audit.recent()] == ["leader", "before"]


def test_a_fence_refuses_past_its_local_deadline_before_asking_the_store(site: Site) -> None:
    lease = site.lease("a")
    epoch = lease.acquire()
    assert epoch is not None
    s = site.store("a")
    fence = s.fence
    assert isinstance(fence, LeaseFence)
    fence.grant(epoch, deadline=site.clock.monotonic() + LEASE_S - safety_margin_s(LEASE_S))
    s.audit.record(ts=1.0, actor="a", action="ok", target="t", detail={})
    assert fence.valid()
    # the process was stopped past its lease: by its own count it no longer leads, whatever
    # the row says (on PostgreSQL the row has not even expired)
    site.clock.advance(LEASE_S)
    assert not fence.valid()
    with pytest.raises(LeaseLost, match="ran out"):
        s.audit.record(ts=2.0, actor="a", action="late", target="t", detail={})
    assert [e.action for e in site.store().audit.recent()] == ["ok"]


def test_an_ungranted_fence_refuses_every_write(site: Site) -> None:
    s = site.store("standby")
    with pytest.raises(LeaseLost, match="standby"):
        s.audit.record(ts=1.0, actor="x", action="y", target="t", detail={})
    assert site.store().audit.recent() == []


def test_contenders_racing_for_a_free_lease_leave_exactly_one_holder(site: Site) -> None:
    leases = [site.lease(f"c{i}") for i in range(6)]
    start = threading.Barrier(len(leases))
    won: dict[str, int | None] = {}

    def contend(lease: Lease) -> None:
        start.wait()
        won[lease.holder] = lease.acquire()

    threads = [threading.Thread(target=contend, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winners = [h for h, epoch in won.items() if epoch is not None]
    assert len(won) == len(leases)
    assert len(winners) == 1
    assert won[winners[0]] == 1
    assert leases[0].read().holder == winners[0]
