"""High availability: two or more controllers on one PostgreSQL store, one leading.

`HaController` is what trainguard-controller serves when `ha.enabled`. It contends for the
lease (controller/store/lease.py) every `ha.renew_interval_s`. Holding it, it runs a Controller
built exactly as a restarted controller is (store loaded, incidents seeded and held,
acknowledged events replayed, rows left running recovered, resumed steps waiting for their
nodes), fenced by the lease's epoch: one Controller per epoch, so there is one startup path.
Without it (a standby) it serves reads from a Controller that never acts, whose node list it
refreshes from the store each round, and the API answers writes 503 naming the leader.
A leader that cannot renew before its lease runs out (stopped, partitioned, its store gone)
steps down at once: the fence refuses every write, the tick, the action worker and the
maintenance jobs stop, reads go on from memory; it contends again each round.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import socket
import threading
from typing import Any

from prometheus_client import Counter, Gauge

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.controller.composition import ActionBackends, Controller
from trainguard.controller.config import ControllerConfig
from trainguard.controller.errors import NotLeader
from trainguard.controller.jobs import JobSpec
from trainguard.controller.metrics import ControllerMetrics
from trainguard.controller.store.connection import Connection
from trainguard.controller.store.dialect import POSTGRES, Dialect
from trainguard.controller.store.errors import StoreConnectError
from trainguard.controller.store.lease import Lease, LeaseFence, lease_connection, safety_margin_s
from trainguard.controller.tick import load_rule_set
from trainguard.controller.views import (
    ActionView,
    AuditEntry,
    IncidentDetail,
    IncidentView,
    JobView,
    NodeRole,
    NodeView,
    SilenceView,
)
from trainguard.protocol import FaultSpec, Report, ReportResponse
from trainguard.strict import ConfigError

__all__ = ["HaController", "new_holder_id"]

log = logging.getLogger("trainguard.controller.ha")


def new_holder_id() -> str:
    """This process's name in the lease row: host, pid and a random part (a restarted
    process on the same host is another holder and waits for the old lease to lapse)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


class HaMetrics:
    def __init__(self, metrics: ControllerMetrics) -> None:
        r = metrics.registry
        self.leader = Gauge(
            "trainguard_controller_leader",
            "1 while this controller holds the leader lease and acts, 0 while it is a standby.",
            registry=r,
        )
        self.lease_epoch = Gauge(
            "trainguard_controller_lease_epoch",
            "Epoch of the lease this controller holds (the last it held while a standby).",
            registry=r,
        )
        self.leadership_changes_total = Counter(
            "trainguard_controller_leadership_changes_total",
            "Times this controller took the lease (acquired) or stepped down (lost).",
            ["change"],
            registry=r,
        )
        for change in ("acquired", "lost"):
            self.leadership_changes_total.labels(change=change)


class HaController:
    """Implements controller.service.ControllerService, every method stated below with what
    a leader and a standby do, and the lifecycle main.py drives: start, stop, ticking,
    reload_rules."""

    def __init__(
        self,
        config: ControllerConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        backends: ActionBackends | None = None,
        holder: str | None = None,
        lease_conn: Connection | None = None,
        dialect: Dialect = POSTGRES,
        db_now: Any = None,
        start_threads: bool = True,
    ) -> None:
        """`lease_conn`, `dialect`, `db_now` and `start_threads` are for tests (an SQLite
        store on a fake clock, the leader's tick and steps driven by the test); by default
        the lease has its own connection to store.url and the database's clock."""
        self.config = config
        self.clock = clock
        self._backends = backends
        self._dialect = dialect
        self._db_now = db_now
        self._start_threads = start_threads
        self.metrics = ControllerMetrics()
        self.ha_metrics = HaMetrics(self.metrics)
        self.holder = holder or new_holder_id()
        self.advertise_url = config.ha.advertise_url
        self._lease_s = config.ha.lease_s
        self._renew_s = config.ha.renew_every_s
        if lease_conn is None:
            url = config.store.url
            assert url is not None  # the config requires store.url with ha.enabled
            try:
                lease_conn = lease_connection(
                    url, password=config.store.read_password(), timeout_s=self._renew_s
                )
            except StoreConnectError as e:
                raise ConfigError("", "store.url", str(e)) from None
        self._lease_conn = lease_conn
        self.lease = Lease(
            lease_conn,
            dialect=dialect,
            holder=self.holder,
            advertise_url=self.advertise_url,
            lease_s=self._lease_s,
            now=db_now,
        )
        self._role_lock = threading.RLock()  # role, fence and current change together
        self._fence = self._new_fence()  # never granted: the standby writes nothing
        # built before the lease is contended: opens the store (exit 2 when it cannot)
        self._current = self._build(self._fence, standby=True)
        self._role = "standby"
        self._leader_url = ""
        self._epoch = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._beat: float | None = None  # monotonic end of the last lease round
        self._read_failing = False  # the last lease read failed (the store is unreachable)

    # --- state ------------------------------------------------------------------------------

    @property
    def role(self) -> str:
        return self._role

    @property
    def current(self) -> Controller:
        """The Controller serving now (the leader's, or the standby's read-only one)."""
        return self._current

    def is_leader(self) -> bool:
        """Holds the lease by its own count: what the API checks before a write."""
        return self._role == "leader" and self._fence.valid()

    def leader_url(self) -> str:
        """The leader's advertise_url as last read from the lease ('' when none holds it)."""
        return self.advertise_url if self.is_leader() else self._leader_url

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self._renew_s))

    def _new_fence(self) -> LeaseFence:
        return LeaseFence(
            holder=self.holder, dialect=self._dialect, clock=self.clock, now=self._db_now
        )

    def _build(self, fence: LeaseFence, *, standby: bool) -> Controller:
        return Controller(
            self.config,
            clock=self.clock,
            backends=self._backends,
            metrics=self.metrics,
            fence=fence,
            standby=standby,
        )

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Contend for the lease now and then every renew interval, on a thread of its own."""
        if self._thread is not None:
            return
        log.info(
            "event=ha_started holder=%s advertise_url=%s lease_s=%g renew_interval_s=%g",
            self.holder,
            self.advertise_url,
            self._lease_s,
            self._renew_s,
        )
        self._stop.clear()
        self.lease_round()
        self._thread = threading.Thread(target=self._loop, name="trainguard-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop contending; a leader stops acting, then gives the lease up so a standby takes
        over at once instead of after the lease runs out."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._lease_s + 30)
            self._thread = None
        with self._role_lock:
            current, fence, epoch = self._current, self._fence, self._fence.epoch
            was_leader = self._role == "leader"
            current.stop_acting()
            if was_leader and epoch is not None:
                try:
                    current.live.flush()
                except Exception:  # the store may be gone: nothing to hand over then
                    log.warning("event=freshness_not_flushed reason=store_error")
                fence.revoke()
                self._set_standby()
                try:
                    if self.lease.release(epoch):
                        log.info("event=lease_released epoch=%d", epoch)
                except Exception as e:
                    log.warning("event=lease_release_failed epoch=%d error=%s", epoch, _err(e))
            current.stop()
        try:
            close = getattr(self._lease_conn, "close", None)
            if close is not None:
                close()
        except Exception:
            log.debug("event=lease_connection_close_failed")

    @property
    def running(self) -> bool:
        return self._thread is not None

    def ticking(self, *, within_s: float | None = None) -> bool:
        """The systemd watchdog's liveness: a leader's tick thread is ticking; a standby's
        lease rounds keep coming."""
        if self._role == "leader":
            return self._current.ticking(within_s=within_s)
        beat = self._beat
        limit_s = max(10.0, 3 * self._renew_s) if within_s is None else within_s
        return beat is not None and self.clock.monotonic() - beat <= limit_s

    @property
    def rule_count(self) -> int:
        return self._current.rule_count

    def reload_rules(self, *, actor: str) -> int:
        """The leader reloads (and audits); a standby checks the files (it loads them anew
        when it takes over)."""
        if self._role == "leader":
            return self._current.reload_rules(actor=actor)
        return len(load_rule_set(self.config).rules)

    # --- the lease round --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self._renew_s):
            self.lease_round()

    def lease_round(self) -> None:
        """Renew (leader) or contend (standby) once; never raises. A leader that steps down
        contends in the same round (and so learns who leads now)."""
        try:
            if self._role == "leader":
                self._renew()
            if self._role == "standby":
                self._contend()
        except Exception:
            log.exception("event=lease_round_error role=%s", self._role)
        self._beat = self.clock.monotonic()

    def _deadline_from(self, sent_at: float) -> float:
        return sent_at + self._lease_s - safety_margin_s(self._lease_s)

    def _renew(self) -> None:
        epoch = self._fence.epoch
        if epoch is None:
            return
        sent_at = self.clock.monotonic()
        try:
            renewed = self.lease.renew(epoch)
        except Exception as e:
            # the store is unreachable: keep trying while the lease lasts by our count
            if self._fence.valid():
                log.warning("event=lease_renew_failed epoch=%d error=%s", epoch, _err(e))
                return
            self.step_down(reason=f"store unreachable: {_err(e)}")
            return
        if renewed:
            self._fence.extend(self._deadline_from(sent_at))
            return
        self.step_down(reason="the lease lapsed or another controller took it")

    def _contend(self) -> None:
        try:
            state = self.lease.read()
        except Exception as e:
            # said once per outage (storewatch.py pages for it), then quietly each round
            (log.debug if self._read_failing else log.warning)(
                "event=lease_read_failed error=%s", _err(e)
            )
            self._read_failing = True
            return
        self._read_failing = False
        if state.held and state.holder != self.holder:
            if state.advertise_url != self._leader_url:
                log.info("event=leader_seen leader=%s epoch=%d", state.advertise_url, state.epoch)
            self._leader_url = state.advertise_url
            self._refresh_reads()
            return
        self._leader_url = ""
        sent_at = self.clock.monotonic()
        epoch = self.lease.acquire()
        if epoch is None:
            return
        self._take_over(epoch, deadline=self._deadline_from(sent_at))

    def _take_over(self, epoch: int, *, deadline: float) -> None:
        """Lead under `epoch`: build a Controller the way a restarted one starts, then let it
        act. Writes made while building (recovering rows left running) are fenced already."""
        started = self.clock.monotonic()
        log.info("event=lease_acquired epoch=%d holder=%s", epoch, self.holder)
        fence = self._new_fence()
        fence.grant(epoch, deadline=deadline)
        try:
            leader = self._build(fence, standby=False)
        except Exception as e:
            fence.revoke()
            log.error("event=takeover_failed epoch=%d error=%s", epoch, _err(e))
            try:
                self.lease.release(epoch)
            except Exception:
                log.debug("event=lease_release_failed epoch=%d", epoch)
            return
        # the build may have taken a while: renew before acting
        sent_at = self.clock.monotonic()
        try:
            renewed = self.lease.renew(epoch)
        except Exception:
            renewed = False
        if not renewed:
            fence.revoke()
            leader.stop()
            log.error("event=takeover_failed epoch=%d error=lease_lost_while_loading", epoch)
            return
        fence.extend(self._deadline_from(sent_at))
        with self._role_lock:
            previous = self._current
            self._current, self._fence, self._role = leader, fence, "leader"
            self._epoch = epoch
            self._leader_url = self.advertise_url
        if self._start_threads:
            leader.start()
        previous.stop()
        self.ha_metrics.leader.set(1)
        self.ha_metrics.lease_epoch.set(epoch)
        self.ha_metrics.leadership_changes_total.labels(change="acquired").inc()
        log.warning(
            "event=leader epoch=%d holder=%s advertise_url=%s took_s=%.3f",
            epoch,
            self.holder,
            self.advertise_url,
            self.clock.monotonic() - started,
        )

    def step_down(self, *, reason: str) -> None:
        """Stop acting at once (the fence first, so nothing in flight lands), keep serving
        reads from memory, contend again from the next round."""
        with self._role_lock:
            if self._role != "leader":
                return
            epoch = self._fence.epoch
            self._fence.revoke()
            self._set_standby()
            current = self._current
        self.ha_metrics.leadership_changes_total.labels(change="lost").inc()
        log.error(
            "event=leader_stepped_down epoch=%s holder=%s reason=%s detail=this controller no "
            "longer acts; it serves reads and contends again",
            epoch,
            self.holder,
            reason.replace(" ", "_"),
        )
        current.stop_acting()

    def _set_standby(self) -> None:
        self._role = "standby"
        self._leader_url = ""
        self.ha_metrics.leader.set(0)

    def _refresh_reads(self) -> None:
        """A standby's node list follows the store (the leader flushes freshness each tick)."""
        if self._role != "standby":
            return
        ctl = self._current
        try:
            records = ctl.store.nodes.all()
        except Exception as e:
            log.debug("event=standby_refresh_failed error=%s", _err(e))
            return
        live = ctl.live
        with live.lock:
            for rec in records:
                live.put_node(rec)
                if rec.last_report_at:
                    live.last_seen[rec.name] = rec.last_report_at

    # --- the service (controller/service.py), method by method ----------------------------
    #
    # Reads are served by whichever controller this is: the leader's Controller, or the
    # standby's read-only one (memory and the store; its node list refreshed each round).
    # Writes go to the current Controller too; its store fence refuses them unless this
    # controller holds the lease (NotLeader, which the API answers 503 naming the leader; the
    # API refuses a standby's writes before they get here). A report is refused here, before
    # anything is stored. reload_rules is with the lifecycle above.

    def _refuse(self) -> NotLeader:
        leader = self.leader_url()
        where = f"the leader is {leader}" if leader else "no leader is known yet"
        return NotLeader(f"this controller is a standby; {where}")

    def ingest_report(self, report: Report, *, actor: str) -> ReportResponse:
        """Leader only; a standby raises NotLeader before anything is stored."""
        # checked here, not only by the API: commands ride on the response, and a deposed
        # leader must hand none out in the moment before its lease round notices
        if not self.is_leader():
            raise self._refuse()
        return self._current.ingest_report(report, actor=actor)

    def refuse_report(self, *, actor: str, node: str, bound_node: str) -> None:
        """Write (the audit row): the leader does it; a standby's store fence refuses it."""
        self._current.refuse_report(actor=actor, node=node, bound_node=bound_node)

    def list_nodes(self) -> list[NodeView]:
        """Read: served by leader and standby alike."""
        return self._current.list_nodes()

    def get_node(self, name: str) -> NodeView:
        """Read: served by leader and standby alike."""
        return self._current.get_node(name)

    def set_role(self, name: str, *, role: NodeRole, actor: str) -> NodeView:
        """Write: the leader does it; a standby's store fence refuses it (NotLeader)."""
        return self._current.set_role(name, role=role, actor=actor)

    def drain(self, name: str, *, reason: str, actor: str) -> NodeView:
        """Write: the leader does it; a standby's store fence refuses it (NotLeader)."""
        return self._current.drain(name, reason=reason, actor=actor)

    def undrain(self, name: str, *, actor: str, force: bool = False) -> NodeView:
        """Write: the leader does it; a standby's store fence refuses it (NotLeader)."""
        return self._current.undrain(name, actor=actor, force=force)

    def return_node(self, name: str, *, actor: str) -> NodeView:
        """Write: the leader does it; a standby's store fence refuses it (NotLeader)."""
        return self._current.return_node(name, actor=actor)

    def retire(self, name: str, *, reason: str, actor: str) -> NodeView:
        """Write: the leader does it; a standby's store fence refuses it (NotLeader)."""
        return self._current.retire(name, reason=reason, actor=actor)

    def list_spares(self) -> list[NodeView]:
        """Read: served by leader and standby alike."""
        return self._current.list_spares()

    def list_incidents(
        self,
        *,
        state: str | None = None,
        node: str | None = None,
        limit: int = 100,
        before_id: int | None = None,
    ) -> list[IncidentView]:
        """Read: served by leader and standby alike."""
        return self._current.list_incidents(
            state=state, node=node, limit=limit, before_id=before_id
        )

    def get_incident(self, incident_id: int) -> IncidentDetail:
        """Read: served by leader and standby alike."""
        return self._current.get_incident(incident_id)

    def list_jobs(self) -> list[JobView]:
        """Read: served by leader and standby alike."""
        return self._current.list_jobs()

    def get_job(self, name: str) -> JobView:
        """Read: served by leader and standby alike."""
        return self._current.get_job(name)

    def submit_job(self, spec: JobSpec, *, actor: str) -> JobView:
        """Write: the leader does it; a standby's store fence refuses it (NotLeader)."""
        return self._current.submit_job(spec, actor=actor)

    def job_action(self, name: str, kind: str, *, actor: str) -> ActionView:
        """Write: the leader does it; a standby's store fence refuses it (NotLeader)."""
        return self._current.job_action(name, kind, actor=actor)

    def create_silence(
        self,
        *,
        rule: str | None,
        node: str | None,
        duration_s: float,
        comment: str,
        actor: str,
    ) -> SilenceView:
        """Write: the leader does it; a standby's store fence refuses it (NotLeader)."""
        return self._current.create_silence(
            rule=rule, node=node, duration_s=duration_s, comment=comment, actor=actor
        )

    def list_silences(self, *, include_expired: bool = False) -> list[SilenceView]:
        """Read: served by leader and standby alike."""
        return self._current.list_silences(include_expired=include_expired)

    def delete_silence(self, silence_id: int, *, actor: str) -> None:
        """Write: the leader does it; a standby's store fence refuses it (NotLeader)."""
        self._current.delete_silence(silence_id, actor=actor)

    def inject_fault(self, node: str, spec: FaultSpec, *, actor: str) -> str:
        """Write (a queued command): the leader does it; a standby's store fence refuses it."""
        return self._current.inject_fault(node, spec, actor=actor)

    def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        """Read: served by leader and standby alike."""
        return self._current.audit_log(limit=limit, before_id=before_id)


def _err(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split()).replace(" ", "_")[:300]
