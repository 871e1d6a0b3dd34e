"""`SignalState`: the ingest state. It takes agent reports and inventory updates, holds the latest
values and bounded history per target, and points an `EvalContext` at each target for the engine.

Event-derived counters (XIDs, lost GPUs, NaN losses) are kept here too; a quiet-target memo
lets a tick skip the thousands of identical GPUs and ports a condition is false for.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from trainguard.controller.signals.catalogue import DEFAULT_TRACKED, RANK_FIELDS, SCOPES, SIGNALS
from trainguard.controller.signals.getters import EvalContext, getter
from trainguard.controller.signals.records import (
    _JOB_NUMERIC,
    _NODE_NUMERIC,
    _GpuRec,
    _ib_value,
    _JobRec,
    _NodeRec,
    _PortRec,
    _RankRec,
)
from trainguard.controller.signals.series import Series
from trainguard.model import (
    GPU_VALUE_FIELDS,
    NVLINK_VALUE_FIELDS,
    GpuSample,
    IbPortSample,
    NvLinkSample,
)
from trainguard.protocol import Event, EventKind, RankState, Report
from trainguard.xid_catalog import XidCatalog as _Catalog
from trainguard.xid_catalog import XidInfo

__all__ = ["SIGNAL_EVENT_KINDS", "SignalState", "XidCatalog"]


_INTERN_MAX = 200_000  # distinct GPU/link value tuples remembered for the quiet-target memo
_CHECK_EVERY = 16  # targets between two reads of a rule's time budget (walked scopes)
_EVENT_ATTRS = frozenset({"xid_total", "xid_fatal_total", "xid_last_code", "gpu_lost_total"})
# Event kinds that change signals (`SignalState._ingest_event`): what a restart replays.
SIGNAL_EVENT_KINDS: frozenset[EventKind] = frozenset(
    {
        EventKind.XID,
        EventKind.GPU_LOST,
        EventKind.FALLEN_OFF_BUS,
        EventKind.PREEMPTION_NOTICE,
        EventKind.NAN_LOSS,
    }
)


class XidCatalog(Protocol):
    """The part of `trainguard.xid_catalog.XidCatalog` this module needs."""

    def classify(self, code: int, message: str = "") -> XidInfo: ...


class SignalState:
    """In-memory, per-target signal values and bounded history, fed by agent reports.

    Not thread-safe: the controller calls `ingest`/`set_*` and the engine's `evaluate` from one
    thread (or under one lock).
    """

    def __init__(
        self,
        *,
        xid_catalog: XidCatalog | None = None,
        history_s: float = 900.0,
        min_spacing_s: float = 5.0,
    ) -> None:
        if history_s <= 0:
            raise ValueError("history_s must be positive")
        if min_spacing_s < 0:
            raise ValueError("min_spacing_s must not be negative")
        self.history_s = history_s
        self.min_spacing_s = min_spacing_s
        self.xid_catalog: XidCatalog = xid_catalog if xid_catalog is not None else _Catalog.load()
        self._nodes: dict[str, _NodeRec] = {}
        self._ranks: dict[tuple[str, int], _RankRec] = {}
        self._jobs: dict[str, _JobRec] = {}
        self._tracked: dict[str, set[str]] = {s: set(DEFAULT_TRACKED[s]) for s in SCOPES}
        self._interned: dict[Any, int] = {}
        self._next_id = 0
        # (rule name, condition text) -> ids of GPU/link states its condition is false for;
        # a transparent memo that lets a tick skip the thousands of quiet, identical targets.
        self._memo: dict[tuple[str, str], set[int]] = {}
        self._refresh_tracked()

    # --- configuration -------------------------------------------------------------------

    def track(self, needs: Mapping[str, Iterable[str]]) -> None:
        """Also keep history for these signals (scope -> names), e.g. `RuleSet.history_needs()`.
        History starts from the next change; unknown names raise ValueError."""
        for scope, names in needs.items():
            if scope not in SIGNALS:
                raise ValueError(f"unknown scope {scope!r}")
            for name in names:
                if name not in SIGNALS[scope]:
                    raise ValueError(f"unknown signal {name!r} for scope {scope}")
                self._tracked[scope].add(name)
        self._refresh_tracked()
        self._rekey()

    def is_tracked(self, scope: str, name: str) -> bool:
        return name in self._tracked[scope]

    def _refresh_tracked(self) -> None:
        t = self._tracked
        self._memo.clear()  # a newly tracked signal changes what windowed functions return
        self._gpu_fields = tuple(n for n in GPU_VALUE_FIELDS if n in t["gpu"])
        self._link_fields = tuple(n for n in NVLINK_VALUE_FIELDS if n in t["nvlink"])
        self._gpu_sig = _tuple_getter(self._gpu_fields)
        self._link_sig = _tuple_getter(("link", *self._link_fields))
        self._ib_sig_names = tuple(sorted(t["ib_port"]))
        self._ib_derived = tuple(n for n in ("up", "phys_up", "rate_gbps") if n in t["ib_port"])
        self._rank_fields = tuple(n for n in RANK_FIELDS if n in t["rank"])
        self._node_fields = tuple(
            n for n in ("gpus", "gpus_lost", "ib_ports", "ib_ports_down") if n in t["node"]
        )
        self._job_fields = tuple(
            n for n in ("ranks", "step", "samples_per_s", "world_size") if n in t["job"]
        )

    # --- feeding -------------------------------------------------------------------------

    def ingest(self, report: Report, *, now: float, new_events: Sequence[Event]) -> None:
        """Take one agent report received at `now` (controller's unix time). `new_events` are
        the report's events not seen before (the caller dedupes resends).

        A delta report (`full` is False) lists only changed GPUs, NVLinks and IB ports: they
        are merged into what is held, and nothing it leaves out is dropped."""
        node = self._nodes.get(report.node)
        if node is None:
            node = self._nodes[report.node] = _NodeRec(report.node, now)
        elif node.first_seen is None:
            node.first_seen = now
        node.last_report_at = now
        node.role_hint = report.role_hint
        node.agent_sources_stale = report.health.get("sources_stale", 0.0)
        delta = report.full is False
        self._ingest_gpus(node, report.gpus, now, delta=delta)
        self._ingest_ports(node, report.ib_ports, now, delta=delta)
        jobs_touched = self._ingest_ranks(node, report.ranks, now)
        for event in new_events:
            self._ingest_event(node, event, now, jobs_touched)
        if self._node_fields:
            for name in self._node_fields:
                v = _NODE_NUMERIC[name](node)
                self._record(node.series, name, node.first_seen or now, v, now)
        for job in jobs_touched:
            self._sample_job(job, now)

    def replay_event(self, node: str, event: Event, *, at: float) -> None:
        """Count an acknowledged event again at `at`, the time it was received: how a
        restarted controller rebuilds its event-driven series (xid_total, xid_fatal_total,
        gpu_lost_total, preemption_total, nan_total) before its first tick. Replay events in
        the order they were received. The node's freshness is left alone, so rules over its
        GPUs and ranks still wait for its next report."""
        rec = self._nodes.get(node)
        if rec is None:
            rec = self._nodes[node] = _NodeRec(node, None)
        self._ingest_event(rec, event, at, set())

    def _record(
        self, series: dict[str, Series], name: str, since: float, value: Any, now: float
    ) -> None:
        """Note the current value of a tracked signal (appends only on change)."""
        if value is None:
            return
        s = series.get(name)
        if s is None:
            series[name] = Series(now, float(value))
            return
        s.update(now, float(value), min_spacing_s=self.min_spacing_s, horizon_s=self.history_s)

    def _change(
        self,
        series: dict[Any, Series],
        key: Any,
        *,
        since: float,
        old: Any,
        new: Any,
        now: float,
    ) -> None:
        """A tracked value went from `old` (held since `since` or the last change) to `new`."""
        s = series.get(key)
        if s is None:
            if old is None:
                series[key] = Series(now, float(new))
                return
            s = series[key] = Series(since, float(old))
        s.update(now, float(new), min_spacing_s=self.min_spacing_s, horizon_s=self.history_s)

    def _ingest_gpus(
        self, node: _NodeRec, gpus: Sequence[GpuSample], now: float, *, delta: bool = False
    ) -> None:
        seen: set[int] = set()
        fields = self._gpu_fields
        link_fields = self._link_fields
        gpu_sig = self._gpu_sig
        link_sig = self._link_sig
        for entry in gpus:
            g = entry
            seen.add(g.index)
            rec = node.gpus.get(g.index)
            sig = gpu_sig(g)
            if delta and rec is not None and rec.sample is not None:
                held_links = rec.sample.nvlinks
                if not entry.nvlinks:
                    # The usual delta entry: GPU values moved, its links did not. The sample
                    # was decoded for this ingest and is held by nothing else yet, so it takes
                    # the held links in place (dataclasses.replace cost 25 us a GPU).
                    object.__setattr__(entry, "nvlinks", held_links)
                    lsig = rec.link_sig
                else:
                    g = _merge_links(entry, held_links)
                    lsig = [link_sig(ln) for ln in g.nvlinks] if link_fields else None
            else:
                # One C-level getter call per GPU and per link gives comparable tuples of just
                # the tracked values; the field-by-field diff runs only when one of them moved.
                lsig = [link_sig(ln) for ln in g.nvlinks] if link_fields else None
            if rec is None:
                rec = node.gpus[g.index] = _GpuRec(g.index, g, now)
                rec.sig, rec.link_sig = sig, lsig
                self._reintern(rec)
                continue
            old = rec.sample
            rec.sample = g
            old_sig, old_lsig = rec.sig, rec.link_sig
            rec.sig, rec.link_sig = sig, lsig
            if old is None or sig != old_sig or lsig != old_lsig:
                self._reintern(rec)
            if old is None:
                for name in fields:
                    nv = getattr(g, name)
                    if nv is not None and name in rec.series:
                        self._change(rec.series, name, since=now, old=None, new=nv, now=now)
                continue
            if sig != old_sig:
                for name in fields:
                    nv = getattr(g, name)
                    ov = getattr(old, name)
                    if nv is not None and nv != ov:
                        self._change(
                            rec.series, name, since=rec.first_seen, old=ov, new=nv, now=now
                        )
            if lsig is not None and lsig != old_lsig:
                old_links = {ln.link: ln for ln in old.nvlinks}
                for ln in g.nvlinks:
                    ol = old_links.get(ln.link)
                    if ol is None:
                        continue
                    for name in link_fields:
                        nv = getattr(ln, name)
                        ov = getattr(ol, name)
                        if nv is not None and nv != ov:
                            self._change(
                                rec.link_series,
                                (ln.link, name),
                                since=rec.first_seen,
                                old=ov,
                                new=nv,
                                now=now,
                            )
        if delta:
            return  # an absent GPU is unchanged, never gone
        # A GPU that vanished from the report (off the bus) keeps its event counters and
        # history, but its sample-derived signals become absent.
        for index, rec in node.gpus.items():
            if index not in seen:
                rec.sample = None
                rec.sig = rec.link_sig = None
                rec.sig_id = rec.links_id = None

    def _ingest_ports(
        self, node: _NodeRec, ports: Sequence[IbPortSample], now: float, *, delta: bool = False
    ) -> None:
        seen: set[tuple[str, int]] = set()
        tracked = self._tracked["ib_port"]
        derived = self._ib_derived
        for p in ports:
            key = (p.device, p.port)
            seen.add(key)
            rec = node.ports.get(key)
            if rec is None:
                rec = node.ports[key] = _PortRec(p, now)
                rec.sig_id = self._port_id(p)
                continue
            old = rec.sample
            rec.sample = p
            rekey = False
            # the derived values come from these three fields, which rarely move
            if (p.state_code, p.phys_state_code, p.rate_gbps) != (
                old.state_code,
                old.phys_state_code,
                old.rate_gbps,
            ):
                for name in derived:
                    nv = _ib_value(p, name)
                    ov = _ib_value(old, name)
                    if nv is None:
                        rekey = rekey or ov is not None
                    elif nv != ov:
                        self._change(
                            rec.series, name, since=rec.first_seen, old=ov, new=nv, now=now
                        )
            # Counters dominate the cost: walk only the values that moved and are tracked.
            for new_map, old_map in ((p.counters, old.counters), (p.hw_counters, old.hw_counters)):
                if new_map == old_map:
                    continue
                if new_map.keys() != old_map.keys():
                    rekey = True  # a counter appeared or vanished: present() may change
                for counter, nv in new_map.items():
                    if counter in tracked:
                        ov = old_map.get(counter)
                        if nv != ov:
                            self._change(
                                rec.series, counter, since=rec.first_seen, old=ov, new=nv, now=now
                            )
            if rekey:
                rec.sig_id = self._port_id(p)
        if delta:
            return  # an absent port is unchanged, never gone
        for key in [k for k in node.ports if k not in seen]:
            del node.ports[key]

    def _ingest_ranks(self, node: _NodeRec, ranks: Sequence[RankState], now: float) -> set[_JobRec]:
        touched: set[_JobRec] = set()
        keys: set[tuple[str, int]] = set()
        fields = self._rank_fields
        for r in ranks:
            key = (r.job, r.rank)
            keys.add(key)
            rec = self._ranks.get(key)
            job = self._job(r.job, now)
            touched.add(job)
            if rec is None:
                rec = self._ranks[key] = _RankRec(r.job, r.rank, node.name, now)
                job.ranks[r.rank] = rec
            elif rec.node != node.name:
                prev = self._nodes.get(rec.node)
                if prev is not None:
                    prev.rank_keys.discard(key)
                rec.node = node.name
            old = rec.state
            rec.state = r
            rec.received_at = now
            if old is not None:
                for name in fields:
                    nv = getattr(r, name)
                    ov = getattr(old, name)
                    if nv is not None and nv != ov:
                        self._change(
                            rec.series, name, since=rec.first_seen, old=ov, new=nv, now=now
                        )
        # Ranks this node no longer reports have exited or moved: forget them.
        for key in node.rank_keys - keys:
            rec = self._ranks.get(key)
            if rec is not None and rec.node == node.name:
                self._drop_rank(rec)
                remaining = self._jobs.get(key[0])
                if remaining is not None:
                    touched.add(remaining)
        node.rank_keys = keys
        return touched

    def _ingest_event(
        self, node: _NodeRec, e: Event, now: float, jobs_touched: set[_JobRec]
    ) -> None:
        if e.kind == EventKind.XID or e.kind in (EventKind.GPU_LOST, EventKind.FALLEN_OFF_BUS):
            rec = None
            if e.gpu is not None:
                rec = node.gpus.get(e.gpu)
                if rec is None:
                    rec = node.gpus[e.gpu] = _GpuRec(e.gpu, None, now)
            if e.kind == EventKind.XID:
                # the line decides for some codes (NVLink5 Fatal/Nonfatal, XID 154's action)
                fatal = (
                    e.code is not None
                    and self.xid_catalog.classify(e.code, e.message).severity == "fatal"
                )
                self._bump(node.series, "xid_total", node, now, "node")
                if fatal:
                    self._bump(node.series, "xid_fatal_total", node, now, "node")
                if rec is not None:
                    self._bump(rec.series, "xid_total", rec, now, "gpu")
                    if fatal:
                        self._bump(rec.series, "xid_fatal_total", rec, now, "gpu")
                    if e.code is not None:
                        old = rec.xid_last_code
                        rec.xid_last_code = e.code
                        if "xid_last_code" in self._tracked["gpu"] and old != e.code:
                            self._change(
                                rec.series,
                                "xid_last_code",
                                since=rec.first_seen,
                                old=old,
                                new=e.code,
                                now=now,
                            )
            elif rec is not None:
                self._bump(rec.series, "gpu_lost_total", rec, now, "gpu")
            if rec is not None and rec.sample is not None:
                self._reintern(rec)
        elif e.kind == EventKind.PREEMPTION_NOTICE:
            self._bump(node.series, "preemption_total", node, now, "node")
        elif e.kind == EventKind.NAN_LOSS and e.job is not None:
            job = self._job(e.job, now)
            jobs_touched.add(job)
            self._bump(job.series, "nan_total", job, now, "job")
            if e.rank is not None:
                rank = self._ranks.get((e.job, e.rank))
                if rank is None:
                    rank = self._ranks[(e.job, e.rank)] = _RankRec(e.job, e.rank, node.name, now)
                    job.ranks[e.rank] = rank
                    node.rank_keys.add((e.job, e.rank))
                self._bump(rank.series, "nan_total", rank, now, "rank")

    def _bump(self, series: dict[str, Series], name: str, rec: Any, now: float, scope: str) -> None:
        old = getattr(rec, name)
        setattr(rec, name, old + 1)
        if name in self._tracked[scope]:
            since = rec.first_seen if rec.first_seen is not None else now
            self._change(series, name, since=since, old=old, new=old + 1, now=now)

    def _reintern(self, rec: _GpuRec) -> None:
        counters = (rec.xid_total, rec.xid_fatal_total, rec.xid_last_code, rec.gpu_lost_total)
        rec.sig_id = self._intern((rec.sig, counters))
        rec.links_id = self._intern(tuple(rec.link_sig)) if rec.link_sig is not None else None

    def _port_id(self, p: IbPortSample) -> int:
        return self._intern(tuple(_ib_value(p, n) for n in self._ib_sig_names))

    def _rekey(self) -> None:
        """Tracked sets changed: recompute every interned key (rare: rule reloads)."""
        for node in self._nodes.values():
            for g in node.gpus.values():
                if g.sample is not None:
                    g.sig = self._gpu_sig(g.sample)
                    g.link_sig = (
                        [self._link_sig(ln) for ln in g.sample.nvlinks]
                        if self._link_fields
                        else None
                    )
                    self._reintern(g)
            for p in node.ports.values():
                p.sig_id = self._port_id(p.sample)

    def _intern(self, key: Any) -> int:
        """A small int per distinct value tuple. Ids are never reused, so dropping the table
        when it grows only costs cache misses."""
        ident = self._interned.get(key)
        if ident is None:
            if len(self._interned) >= _INTERN_MAX:
                self._interned.clear()
                self._memo.clear()
            self._next_id += 1
            ident = self._interned[key] = self._next_id
        return ident

    def _sample_job(self, job: _JobRec, now: float) -> None:
        # One sample per min_spacing_s: summing a 16k-rank job on every report would cost more
        # than the report itself.
        if now - job.sampled_at < self.min_spacing_s:
            return
        job.sampled_at = now
        for name in self._job_fields:
            v = _JOB_NUMERIC[name](job)
            self._record(job.series, name, now, v, now)

    def _job(self, name: str, now: float | None) -> _JobRec:
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = _JobRec(name, now)
        elif job.first_seen is None:
            job.first_seen = now
        return job

    def _drop_rank(self, rec: _RankRec) -> None:
        self._ranks.pop((rec.job, rec.rank), None)
        job = self._jobs.get(rec.job)
        if job is not None and job.ranks.get(rec.rank) is rec:
            del job.ranks[rec.rank]
            if not job.ranks and job.meta_state is None:
                del self._jobs[rec.job]

    def resume_ages(self, *, at: float, reported_since: float) -> None:
        """The controller stalled until `at` (controller.stallguard): the nodes that had
        reported since `reported_since` (were not silent when it stalled) are taken as
        reported at `at`, and their ranks as received at `at`, so report, heartbeat and step
        ages count from the resumption."""
        for node in self._nodes.values():
            t = node.last_report_at
            if t is None or t < reported_since or t >= at:
                continue
            node.last_report_at = at
            for key in node.rank_keys:
                r = self._ranks.get(key)
                if r is not None and r.node == node.name and r.received_at < at:
                    r.received_at = at

    def set_node_meta(self, node: str, *, role: str, state: str, job: str | None) -> None:
        """The controller's inventory view of a node (role, drain state, assigned job)."""
        rec = self._nodes.get(node)
        if rec is None:
            rec = self._nodes[node] = _NodeRec(node, None)
        rec.role = role
        rec.state = state
        rec.job = job

    def set_job_meta(self, job: str, *, nodes: Sequence[str], state: str) -> None:
        """The controller's job table entry: the job's node set and state."""
        rec = self._job(job, None)
        rec.meta_nodes = tuple(nodes)
        rec.meta_state = state

    def forget_job(self, job: str) -> None:
        """Drop a job and its ranks (the job was deleted from the controller)."""
        rec = self._jobs.pop(job, None)
        if rec is None:
            return
        for r in list(rec.ranks.values()):
            self._ranks.pop((r.job, r.rank), None)
            node = self._nodes.get(r.node)
            if node is not None:
                node.rank_keys.discard((r.job, r.rank))

    def forget_node(self, node: str) -> None:
        """Drop everything known about a node (removed from the cluster)."""
        rec = self._nodes.pop(node, None)
        if rec is None:
            return
        for key in rec.rank_keys:
            r = self._ranks.get(key)
            if r is not None and r.node == node:
                self._drop_rank(r)

    def forget_node_history(self, node: str) -> None:
        """Start the windows of a node's hardware signals over (its own, its GPUs', NVLinks'
        and IB ports'): a node that passed its validation after a repair is judged on what
        happens from then on, not on the fault that was repaired (a fatal XID would keep
        `increase(xid_fatal_total[5m])` true for five minutes and hide the next one). The
        current values stay; only their history goes."""
        rec = self._nodes.get(node)
        if rec is None:
            return
        for series in rec.series.values():
            series.forget_history()
        for g in rec.gpus.values():
            for series in (*g.series.values(), *g.link_series.values()):
                series.forget_history()
        for p in rec.ports.values():
            for series in p.series.values():
                series.forget_history()

    # --- reading -------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def jobs(self) -> list[str]:
        return sorted(self._jobs)

    def last_report_at(self, node: str) -> float | None:
        rec = self._nodes.get(node)
        return None if rec is None else rec.last_report_at

    def series_points(self) -> int:
        """Total history points held (for memory figures in benchmarks and docs)."""
        total = 0
        for node in self._nodes.values():
            total += sum(len(s) for s in node.series.values())
            for g in node.gpus.values():
                total += sum(len(s) for s in g.series.values())
                total += sum(len(s) for s in g.link_series.values())
            for p in node.ports.values():
                total += sum(len(s) for s in p.series.values())
        for r in self._ranks.values():
            total += sum(len(s) for s in r.series.values())
        for j in self._jobs.values():
            total += sum(len(s) for s in j.series.values())
        return total

    def matches(
        self,
        scope: str,
        ctx: EvalContext,
        *,
        fresh_after: float | None,
        test: Callable[[EvalContext], bool],
        memo_key: tuple[str, str] | None = None,
        reads: Collection[str] = (),
        check: Callable[[], None] | None = None,
    ) -> Iterator[None]:
        """Like `walk`, but yields only where `test(ctx)` holds.

        `check` (the rule's time budget; it raises to stop) is called every `_CHECK_EVERY`
        targets, and before each node's targets of the gpu, nvlink and ib_port scopes.

        For gpu, nvlink and ib_port scopes with a `memo_key`, a condition that reads only
        tracked values and event counters (`reads`, no `age()`) is a pure function of a GPU's
        or port's interned values while it has no history yet (windowed functions over an
        unchanged value are constant), so a False result is remembered per value tuple and
        identical quiet targets are skipped without evaluating anything.
        """
        memo: set[int] | None = None
        if memo_key is not None and scope in ("gpu", "nvlink", "ib_port"):
            keyed = self._tracked[scope] | (_EVENT_ATTRS if scope == "gpu" else frozenset())
            if all(name in keyed for name in reads):
                memo = self._memo.setdefault(memo_key, set())
                if len(memo) > _INTERN_MAX:
                    memo.clear()
        if memo is None:
            seen = 0
            last = None
            per_node = scope in ("gpu", "nvlink", "ib_port")
            for _ in self.walk(scope, ctx, fresh_after=fresh_after):
                if check is not None:
                    if seen % _CHECK_EVERY == 0 or (per_node and ctx.node is not last):
                        check()
                        last = ctx.node
                    seen += 1
                if test(ctx):
                    yield
            return
        for node in list(self._nodes.values()):
            if fresh_after is not None and not _fresh(node, fresh_after):
                continue
            if check is not None:
                check()
            ctx.node = node
            if scope == "ib_port":
                for p in node.ports.values():
                    ident = p.sig_id if not p.series else None
                    if ident is not None and ident in memo:
                        continue
                    ctx.port = p
                    if test(ctx):
                        yield
                    elif ident is not None:
                        memo.add(ident)
                continue
            for g in node.gpus.values():
                if scope == "gpu":
                    ident = g.sig_id if not g.series else None
                    if ident is not None and ident in memo:
                        continue
                    ctx.gpu = g
                    if test(ctx):
                        yield
                    elif ident is not None:
                        memo.add(ident)
                    continue
                if g.sample is None:
                    continue
                ident = g.links_id if not g.link_series else None
                if ident is not None and ident in memo:
                    continue
                ctx.gpu = g
                hit = False
                for ln in g.sample.nvlinks:
                    ctx.link = ln
                    if test(ctx):
                        hit = True
                        yield
                if not hit and ident is not None:
                    memo.add(ident)

    def walk(self, scope: str, ctx: EvalContext, *, fresh_after: float | None) -> Iterator[None]:
        """Point `ctx` at each target of `scope` in turn (yielding after each). With
        `fresh_after`, targets on nodes whose last report is older are skipped (node and job
        scopes are never skipped)."""
        if scope == "node":
            for node in list(self._nodes.values()):
                ctx.node = node
                yield
            return
        if scope == "job":
            for job in list(self._jobs.values()):
                ctx.job = job
                yield
            return
        if scope == "rank":
            for r in list(self._ranks.values()):
                owner = self._nodes.get(r.node)
                if fresh_after is not None and not _fresh(owner, fresh_after):
                    continue
                ctx.rank = r
                ctx.node = owner
                ctx.job = self._jobs.get(r.job)
                yield
            return
        for node in list(self._nodes.values()):
            if fresh_after is not None and not _fresh(node, fresh_after):
                continue
            ctx.node = node
            if scope == "gpu":
                for g in node.gpus.values():
                    ctx.gpu = g
                    yield
            elif scope == "nvlink":
                for g in node.gpus.values():
                    if g.sample is None:
                        continue
                    ctx.gpu = g
                    for ln in g.sample.nvlinks:
                        ctx.link = ln
                        yield
            elif scope == "ib_port":
                for p in node.ports.values():
                    ctx.port = p
                    yield

    def rank_node(self, job: str, rank: int) -> str | None:
        r = self._ranks.get((job, rank))
        return None if r is None else r.node

    def value(self, target: Any, name: str, *, now: float, stale_after_s: float = 10.0) -> Any:
        """The current value of signal `name` for a `model.Target` (None if absent);
        for tools and tests, the engine uses compiled getters instead."""
        ctx = self.context_for(target, now=now, stale_after_s=stale_after_s)
        if ctx is None:
            return None
        return getter(target.scope, name)(ctx)

    def context_for(
        self, target: Any, *, now: float, stale_after_s: float = 10.0
    ) -> EvalContext | None:
        ctx = EvalContext(self, now=now, stale_after_s=stale_after_s)
        scope = target.scope
        if scope in ("rank", "job"):
            job = self._jobs.get(target.job)
            if job is None:
                return None
            ctx.job = job
            if scope == "rank":
                ctx.rank = job.ranks.get(target.rank)
                if ctx.rank is None:
                    return None
                ctx.node = self._nodes.get(ctx.rank.node)
            return ctx
        ctx.node = self._nodes.get(target.node)
        if ctx.node is None:
            return None
        if scope in ("gpu", "nvlink"):
            ctx.gpu = ctx.node.gpus.get(target.gpu)
            if ctx.gpu is None:
                return None
            if scope == "nvlink":
                links = ctx.gpu.sample.nvlinks if ctx.gpu.sample is not None else ()
                ctx.link = next((ln for ln in links if ln.link == target.link), None)
                if ctx.link is None:
                    return None
        elif scope == "ib_port":
            ctx.port = ctx.node.ports.get((target.device, target.port))
            if ctx.port is None:
                return None
        return ctx


def _merge_links(g: GpuSample, old_links: tuple[NvLinkSample, ...]) -> GpuSample:
    """A delta GPU entry with its changed links laid over the links held (order kept)."""
    changed = {ln.link: ln for ln in g.nvlinks}
    merged = tuple(changed.pop(ln.link, ln) for ln in old_links)
    if changed:  # a link not held before: appended (the next full report settles the set)
        merged += tuple(changed.values())
    return dataclasses.replace(g, nvlinks=merged)


def _tuple_getter(names: Sequence[str]) -> Callable[[Any], Any]:
    if not names:
        return lambda obj: ()
    if len(names) == 1:
        one = operator.attrgetter(names[0])
        return lambda obj: (one(obj),)
    return operator.attrgetter(*names)


def _fresh(node: _NodeRec | None, fresh_after: float) -> bool:
    return (
        node is not None and node.last_report_at is not None and node.last_report_at >= fresh_after
    )
