"""Each job's checkpoint interval advice from what the controller measured: the checkpoint
cost from the ranks' commit events, the restart time from the job's recoveries, the node MTBF
from the cluster's hardware incidents (controller.ckptinterval does the arithmetic).

The store's parts (incidents, recoveries) are read at most once per `cache_s` and kept, so a
`/metrics` scrape or a job listing costs no query per job; while the store cannot be reached
the last values (or the priors) serve.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from trainguard.clock import Clock
from trainguard.controller.ckptinterval import IntervalAdvice, advise, node_mtbf_s
from trainguard.controller.config import EconomicsConfig
from trainguard.controller.jobs import JobManager
from trainguard.controller.store import Store
from trainguard.controller.store.errors import StoreUnavailable

__all__ = ["CheckpointAdvisor"]

log = logging.getLogger("trainguard.controller.ckptadvisor")

_RECOVERIES_KEPT = 20  # the newest restarts a job's restart time is the mean of


@dataclass
class CheckpointAdvisor:
    store: Store
    jobs: JobManager
    config: EconomicsConfig
    clock: Clock
    node_count: Callable[[], int]  # the nodes the cluster has (the MTBF's exposure)
    started_at: float  # when this controller started (the history's start at the latest)
    cache_s: float = 60.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _mtbf: tuple[float, float] | None = field(default=None, repr=False)  # (read at, value)
    _restart: dict[str, tuple[float, float]] = field(default_factory=dict, repr=False)

    def node_mtbf_s(self) -> float:
        """A node's MTBF: the hardware incidents in `mtbf_window_s` over the node-time the
        cluster was watched in it (its node count x the window, from the oldest job the
        controller holds or its start), with the configured prior (ckptinterval.node_mtbf_s)."""
        now = self.clock.now()
        with self._lock:
            if self._mtbf is not None and now - self._mtbf[0] < self.cache_s:
                return self._mtbf[1]
        cfg = self.config
        since = now - cfg.mtbf_window_s
        try:
            incidents = len(self.store.incidents.hardware_history(since=since))
        except StoreUnavailable:
            with self._lock:
                return cfg.node_mtbf_prior_s if self._mtbf is None else self._mtbf[1]
        first = min((j.created_at for j in self.jobs.records()), default=self.started_at)
        watched_s = max(0.0, now - max(since, min(first, self.started_at)))
        value = node_mtbf_s(
            incidents=incidents,
            exposure_s=watched_s * max(1, self.node_count()),
            prior_mtbf_s=cfg.node_mtbf_prior_s,
            prior_incidents=cfg.node_mtbf_prior_incidents,
        )
        with self._lock:
            self._mtbf = (now, value)
        return value

    def restart_s(self, job: str) -> float:
        """The job's restart time: the mean time from fault to training again (`mttr`, else
        the restart phase) over its recent restarts in the window; the prior without one."""
        now = self.clock.now()
        with self._lock:
            kept = self._restart.get(job)
            if kept is not None and now - kept[0] < self.cache_s:
                return kept[1]
        try:
            outputs = self.store.actions.recoveries(
                job, since=now - self.config.mtbf_window_s, limit=_RECOVERIES_KEPT
            )
        except StoreUnavailable:
            return self.config.restart_prior_s if kept is None else kept[1]
        measured: list[float] = []
        for out in outputs:
            phases = out.get("phases_s")
            if not isinstance(phases, dict):
                continue
            value = phases.get("mttr", phases.get("restart"))
            if isinstance(value, int | float) and value >= 0:
                measured.append(float(value))
        value = sum(measured) / len(measured) if measured else self.config.restart_prior_s
        with self._lock:
            self._restart[job] = (now, value)
            for name in [n for n, (t, _) in self._restart.items() if now - t >= self.cache_s]:
                del self._restart[name]  # jobs no longer asked about
        return value

    def advice(self, job: str, *, nodes: int) -> IntervalAdvice | None:
        """The advice for `job` on `nodes` nodes; None before a checkpoint of it committed
        (no measured cost) or when it has no node."""
        cost = self.jobs.checkpoint_cost_s(job)
        if cost is None or nodes < 1:
            return None
        try:
            return advise(
                checkpoint_s=cost,
                restart_s=self.restart_s(job),
                node_mtbf_s=self.node_mtbf_s(),
                nodes=nodes,
                current_s=self.jobs.checkpoint_interval_s(job),
                step_time_s=self.jobs.step_time_s(job),
            )
        except ValueError as e:  # a measured value out of the model's range: say so, go on
            log.warning("event=checkpoint_advice_failed job=%s reason=%s", job, e)
            return None
