"""The per-target records `SignalState` holds (what was last reported for each GPU, IB port,
node, rank and job, with its history) and the numeric signals derived from them.

Ingest writes these records and the compiled getters read them; both sides share this module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from trainguard.controller.signals.series import Series
from trainguard.model import GpuSample, IbPortSample
from trainguard.protocol import RankState


class _GpuRec:
    __slots__ = (
        "first_seen",
        "gpu_lost_total",
        "index",
        "link_series",
        "link_sig",
        "links_id",
        "sample",
        "series",
        "sig",
        "sig_id",
        "xid_fatal_total",
        "xid_last_code",
        "xid_total",
    )

    def __init__(self, index: int, sample: GpuSample | None, now: float) -> None:
        self.index = index
        self.sample = sample
        self.first_seen = now
        self.series: dict[str, Series] = {}
        self.link_series: dict[tuple[int, str], Series] = {}
        self.sig: Any = None  # tracked GPU values, as last seen
        self.link_sig: Any = None  # tracked NVLink values per link, as last seen
        self.sig_id: int | None = None  # interned (sig, event counters): see SignalState.walk
        self.links_id: int | None = None  # interned link_sig
        self.xid_total = 0
        self.xid_fatal_total = 0
        self.xid_last_code: int | None = None
        self.gpu_lost_total = 0


class _PortRec:
    __slots__ = ("first_seen", "sample", "series", "sig_id")

    def __init__(self, sample: IbPortSample, now: float) -> None:
        self.sample = sample
        self.first_seen = now
        self.series: dict[str, Series] = {}
        # Interned tracked values, for the quiet-target memo. Only read while `series` is
        # empty, i.e. while no tracked value has changed since the port was first seen.
        self.sig_id: int | None = None


class _NodeRec:
    __slots__ = (
        "agent_sources_stale",
        "first_seen",
        "gpus",
        "job",
        "last_report_at",
        "name",
        "ports",
        "preemption_total",
        "rank_keys",
        "role",
        "role_hint",
        "series",
        "state",
        "xid_fatal_total",
        "xid_total",
    )

    def __init__(self, name: str, now: float | None) -> None:
        self.name = name
        self.first_seen = now
        self.last_report_at: float | None = None
        self.gpus: dict[int, _GpuRec] = {}
        self.ports: dict[tuple[str, int], _PortRec] = {}
        self.rank_keys: set[tuple[str, int]] = set()
        self.role: str | None = None
        self.role_hint: str | None = None
        self.state: str | None = None
        self.job: str | None = None
        self.series: dict[str, Series] = {}
        self.xid_total = 0
        self.xid_fatal_total = 0
        self.preemption_total = 0
        self.agent_sources_stale = 0.0  # from the latest report's health


class _RankRec:
    __slots__ = ("first_seen", "job", "nan_total", "node", "rank", "received_at", "series", "state")

    def __init__(self, job: str, rank: int, node: str, now: float) -> None:
        self.job = job
        self.rank = rank
        self.node = node
        self.state: RankState | None = None
        self.received_at = now
        self.first_seen = now
        self.nan_total = 0
        self.series: dict[str, Series] = {}


class _JobRec:
    __slots__ = (
        "first_seen",
        "meta_nodes",
        "meta_state",
        "name",
        "nan_total",
        "ranks",
        "sampled_at",
        "series",
    )

    def __init__(self, name: str, now: float | None) -> None:
        self.name = name
        self.first_seen = now
        self.ranks: dict[int, _RankRec] = {}
        self.meta_nodes: tuple[str, ...] = ()
        self.meta_state: str | None = None
        self.nan_total = 0
        self.series: dict[str, Series] = {}
        self.sampled_at = -math.inf


def _ib_value(p: IbPortSample, name: str) -> Any:
    if name == "up":
        return None if p.state_code is None else int(p.state_code == 4)
    if name == "phys_up":
        return None if p.phys_state_code is None else int(p.phys_state_code == 5)
    if name == "rate_gbps":
        return p.rate_gbps
    v = p.counters.get(name)
    if v is None:
        v = p.hw_counters.get(name)
    return v


def _gpus_lost(node: _NodeRec) -> int:
    return sum(1 for g in node.gpus.values() if g.sample is None or g.sample.lost)


_NODE_NUMERIC: dict[str, Callable[[_NodeRec], Any]] = {
    "gpus": lambda n: sum(1 for g in n.gpus.values() if g.sample is not None),
    "gpus_lost": _gpus_lost,
    "ib_ports": lambda n: len(n.ports),
    "ib_ports_down": lambda n: sum(1 for p in n.ports.values() if p.sample.state_code != 4),
}


def _job_sum(job: _JobRec, name: str) -> Any:
    vals = [getattr(r.state, name) for r in job.ranks.values() if r.state is not None]
    vals = [v for v in vals if v is not None]
    return sum(vals) if vals else None


def _job_max(job: _JobRec, name: str) -> Any:
    vals = [getattr(r.state, name) for r in job.ranks.values() if r.state is not None]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def _job_min(job: _JobRec, name: str) -> Any:
    vals = [getattr(r.state, name) for r in job.ranks.values() if r.state is not None]
    vals = [v for v in vals if v is not None]
    return min(vals) if vals else None


_JOB_NUMERIC: dict[str, Callable[[_JobRec], Any]] = {
    "ranks": lambda j: len(j.ranks),
    "step": lambda j: _job_max(j, "step"),
    "samples_per_s": lambda j: _job_sum(j, "samples_per_s"),
    "world_size": lambda j: _job_max(j, "world_size"),
    # a job's checkpoint is whole only when every rank committed it: the laggard speaks
    "ckpt_step": lambda j: _job_min(j, "ckpt_step"),
    "ckpt_failures": lambda j: _job_max(j, "ckpt_failures"),
    "ckpt_age_s": lambda j: _job_max(j, "ckpt_age_s"),
    "ckpt_interval_s": lambda j: _job_max(j, "ckpt_interval_s"),
    # only rank 0 copies to the replica: the one rank that reports speaks for the job
    "ckpt_replica_step": lambda j: _job_max(j, "ckpt_replica_step"),
    "ckpt_replica_lag_s": lambda j: _job_max(j, "ckpt_replica_lag_s"),
}
