"""Each job's checkpoint economics from what the controller measured: the interval advice
(the checkpoint cost from the ranks' commit events, the restart time from the job's
recoveries, the node MTBF from the cluster's hardware incidents; controller.ckptinterval does
the arithmetic) and the GPU-hours its failures cost (controller.failurecost).

The store's parts (incidents, recoveries) are read at most once per `cache_s` and kept, so a
`/metrics` scrape or a job listing costs no query per job; while the store cannot be reached
the last values (or the priors) serve.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.clock import Clock
from trainguard.controller.ckptinterval import IntervalAdvice, advise, node_mtbf_s
from trainguard.controller.config import CostConfig, EconomicsConfig
from trainguard.controller.failurecost import FailureCost, failure_cost, recovery_loss
from trainguard.controller.jobs import JobManager
from trainguard.controller.store import Store
from trainguard.controller.store.errors import StoreUnavailable

__all__ = ["CheckpointAdvisor"]

log = logging.getLogger("trainguard.controller.ckptadvisor")

_RESTARTS_MEAN = 20  # the newest restarts a job's restart time is the mean of
_RECOVERIES_READ = 500  # the newest recoveries in the window a job's cost counts


@dataclass
class CheckpointAdvisor:
    store: Store
    jobs: JobManager
    config: EconomicsConfig
    cost: CostConfig
    clock: Clock
    node_count: Callable[[], int]  # the nodes the cluster has (the MTBF's exposure)
    started_at: float  # when this controller started (the history's start at the latest)
    cache_s: float = 60.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _mtbf: tuple[float, float] | None = field(default=None, repr=False)  # (read at, value)
    # job -> (read at, its recoveries' outputs in the window, newest first)
    _recoveries: dict[str, tuple[float, list[dict[str, Any]]]] = field(
        default_factory=dict, repr=False
    )

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

    def recoveries(self, job: str) -> list[dict[str, Any]]:
        """The outputs of the job's incident restarts and rollbacks in the window, newest
        first (read at most once per `cache_s`; the last read while the store is away)."""
        now = self.clock.now()
        with self._lock:
            kept = self._recoveries.get(job)
            if kept is not None and now - kept[0] < self.cache_s:
                return kept[1]
        try:
            outputs = self.store.actions.recoveries(
                job, since=now - self.config.mtbf_window_s, limit=_RECOVERIES_READ
            )
        except StoreUnavailable:
            return [] if kept is None else kept[1]
        with self._lock:
            self._recoveries[job] = (now, outputs)
            for name in [n for n, (t, _) in self._recoveries.items() if now - t >= self.cache_s]:
                del self._recoveries[name]  # jobs no longer asked about
        return outputs

    def restart_s(self, job: str) -> float:
        """The job's restart time: the mean time from fault to training again (`mttr`, else
        the restart phase) over its recent restarts in the window; the prior without one."""
        measured = [
            loss[0]
            for loss in map(recovery_loss, self.recoveries(job)[:_RESTARTS_MEAN])
            if loss is not None
        ]
        return sum(measured) / len(measured) if measured else self.config.restart_prior_s

    def job_cost(self, job: str, *, gpus: int) -> FailureCost | None:
        """What the job's failures in the window cost at `gpus` GPUs, and its saves since this
        controller started; None when there is neither."""
        recoveries = self.recoveries(job)
        block_s = self.jobs.checkpoint_block_total_s(job)
        if not recoveries and block_s is None:
            return None
        return failure_cost(
            recoveries=recoveries,
            gpus=gpus,
            step_time_s=self.jobs.step_time_s(job),
            checkpoint_block_s=block_s,
            gpu_hour_price=self.cost.gpu_hour,
        )

    def incident_cost(
        self, *, job: str, outputs: list[dict[str, Any]], gpus: int
    ) -> FailureCost | None:
        """What one incident's recoveries (`outputs`) cost `job` at `gpus` GPUs; None when
        none of them measured a phase."""
        if not any(recovery_loss(o) is not None for o in outputs):
            return None
        return failure_cost(
            recoveries=outputs,
            gpus=gpus,
            step_time_s=self.jobs.step_time_s(job),
            gpu_hour_price=self.cost.gpu_hour,
        )

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
