"""The controller's own Prometheus metrics, in a per-instance CollectorRegistry (two
controllers in one test process never share series). Names `trainguard_controller_*`, units
in names, counters end in `_total`; every label has a bounded set of values. A value with no
sample value (`trainguard.bounds.metric_value`) is skipped and counted, never a broken
/metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from trainguard.bounds import metric_value
from trainguard.controller.nodestate import node_state_values
from trainguard.controller.views import JobView

# Report ingest is sub-millisecond when healthy; the 100 ms p99 target sits mid-range.
INGEST_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# One rule tick over 2,048 nodes must stay under 250 ms.
EVAL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Remediation phases: detection in seconds, recovery onto a spare within ~60 s, a bad day in
# tens of minutes.
REMEDIATION_PHASES = ("detect", "checkpoint", "drain", "restart", "mttr")
PHASE_BUCKETS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
# Steps of work lost per recovery: 0-1 with a proactive checkpoint, up to the save interval.
LOST_STEPS_BUCKETS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0)
DEFAULT_SPARE_POOL = "default"  # spares whose node has no `pool` label
# The store's tables retention deletes from, and the maintenance jobs (controller/maintenance.py)
RETENTION_TABLES = ("events", "commands", "incidents", "incident_timeline", "actions", "audit_log")
MAINTENANCE_JOBS = ("retention", "checkpoint")


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.report_ingest_seconds = Histogram(
            "trainguard_controller_report_ingest_seconds",
            "Time to ingest one agent report (observed by the API around ingest).",
            buckets=INGEST_BUCKETS_S,
            registry=r,
        )
        self.rule_eval_seconds = Histogram(
            "trainguard_controller_rule_eval_seconds",
            "Time to evaluate every rule once (one tick).",
            buckets=EVAL_BUCKETS_S,
            registry=r,
        )
        self.rule_overruns_total = Counter(
            "trainguard_controller_rule_overruns_total",
            "Rule evaluations cut at rule_budget.eval_budget_s, by rule.",
            ["rule"],
            registry=r,
        )
        self.rule_disabled = Gauge(
            "trainguard_controller_rule_disabled",
            "1 while a rule is disabled for overrunning its budget (until a reload), by rule.",
            ["rule"],
            registry=r,
        )
        self.rules_deferred_total = Counter(
            "trainguard_controller_rules_deferred_total",
            "Rule evaluations left for the next tick: rule_budget.tick_budget_s was spent.",
            registry=r,
        )
        self.tick_seconds = Histogram(
            "trainguard_controller_tick_seconds",
            "Time of one whole tick: flush, evaluation, incidents, commands.",
            buckets=EVAL_BUCKETS_S,
            registry=r,
        )
        self.nodes = Gauge(
            "trainguard_controller_nodes",
            "Known nodes by role and state.",
            ["role", "state"],
            registry=r,
        )
        self.nodes_reporting = Gauge(
            "trainguard_controller_nodes_reporting",
            "Nodes whose last report is younger than node_silent_after_s.",
            registry=r,
        )
        self.incidents_open = Gauge(
            "trainguard_controller_incidents_open",
            "Unresolved incidents by rule and severity.",
            ["rule", "severity"],
            registry=r,
        )
        self.incidents_opened_total = Counter(
            "trainguard_controller_incidents_opened_total",
            "Incidents opened, by rule.",
            ["rule"],
            registry=r,
        )
        self.actions_total = Counter(
            "trainguard_controller_actions_total",
            "Action steps finished (succeeded, failed, skipped) or retried, by kind.",
            ["kind", "result"],
            registry=r,
        )
        self.alert_resends_total = Counter(
            "trainguard_controller_alert_resends_total",
            "Open incidents' alerts re-sent to Alertmanager (no action row), by channel and"
            " outcome (sent, failed).",
            ["channel", "outcome"],
            registry=r,
        )
        self.notifications_failed_total = Counter(
            "trainguard_controller_notifications_failed_total",
            "Failed notification deliveries (each attempt), by channel.",
            ["channel"],
            registry=r,
        )
        self.reports_total = Counter(
            "trainguard_controller_reports_total",
            "Agent reports ingested.",
            registry=r,
        )
        self.reports_refused_total = Counter(
            "trainguard_controller_reports_refused_total",
            "Agent reports refused because the credential speaks for another node.",
            registry=r,
        )
        self.report_items_refused_total = Counter(
            "trainguard_controller_report_items_refused_total",
            "Rank states and events refused because they speak about a job beyond the"
            " reporting node's part in it (controller.jobscope), by reason.",
            ["reason"],
            registry=r,
        )
        self.controller_stalls_total = Counter(
            "trainguard_controller_stalls_total",
            "Times the tick loop found it had not run for over 2 tick intervals + 1 s (the"
            " controller itself stalled: paused, migrated, a stuck disk); node ages restart"
            " from the resumption (controller.stallguard).",
            registry=r,
        )
        self.job_names_refused_total = Counter(
            "trainguard_controller_job_names_refused_total",
            "Job names in agent reports refused: beyond the node's budget of names the job"
            " table does not hold (node_budget) or the controller's (total_budget).",
            ["reason"],
            registry=r,
        )
        self.events_total = Counter(
            "trainguard_controller_events_total",
            "New agent events stored (duplicates excluded), by kind.",
            ["kind"],
            registry=r,
        )
        self.commands_timed_out_total = Counter(
            "trainguard_controller_commands_timed_out_total",
            "Agent commands reported failed because no result came back in time.",
            registry=r,
        )
        self.remediation_phase_seconds = Histogram(
            "trainguard_controller_remediation_phase_seconds",
            "Duration of each remediation phase (mttr: fault to training past the checkpoint).",
            ["phase"],
            buckets=PHASE_BUCKETS_S,
            registry=r,
        )
        for phase in REMEDIATION_PHASES:  # exported with zero counts before the first recovery
            self.remediation_phase_seconds.labels(phase=phase)
        self.remediation_lost_steps = Histogram(
            "trainguard_controller_remediation_lost_steps",
            "Training steps redone after a recovery (failure step - restored checkpoint step).",
            buckets=LOST_STEPS_BUCKETS,
            registry=r,
        )
        self.retention_deleted_rows_total = Counter(
            "trainguard_controller_retention_deleted_rows_total",
            "Store rows deleted by retention, by table.",
            ["table"],
            registry=r,
        )
        for table in RETENTION_TABLES:  # exported at 0 before the first deletion
            self.retention_deleted_rows_total.labels(table=table)
        self.maintenance_last_run_timestamp_seconds = Gauge(
            "trainguard_controller_maintenance_last_run_timestamp_seconds",
            "When a store maintenance job last completed (unix time), by job.",
            ["job"],
            registry=r,
        )
        self.maintenance_errors_total = Counter(
            "trainguard_controller_maintenance_errors_total",
            "Store maintenance job runs that failed, by job.",
            ["job"],
            registry=r,
        )
        for job in MAINTENANCE_JOBS:
            self.maintenance_errors_total.labels(job=job)
        self.store_size_bytes = Gauge(
            "trainguard_controller_store_size_bytes",
            "Size of the store's files on disk, read at scrape time (file: db, wal).",
            ["file"],
            registry=r,
        )
        self.jobs = _JobsCollector()
        r.register(self.jobs)

    # --- helpers the controller calls -------------------------------------------------------

    def count(self, kind: str, result: str) -> None:
        self.actions_total.labels(kind=kind, result=result).inc()

    def set_nodes(self, counts: dict[tuple[str, str], int]) -> None:
        for role in ("active", "spare"):
            for state in node_state_values():
                self.nodes.labels(role=role, state=state).set(counts.get((role, state), 0))

    def set_incidents(self, open_incidents: Iterable[tuple[str, str]]) -> None:
        """(rule, severity) of every unresolved incident; series for rules at 0 are dropped."""
        counts: dict[tuple[str, str], int] = {}
        for key in open_incidents:
            counts[key] = counts.get(key, 0) + 1
        self.incidents_open.clear()
        for (rule, severity), n in counts.items():
            self.incidents_open.labels(rule=rule, severity=severity).set(n)

    def known_rules(self, names: Iterable[str]) -> None:
        """Export incidents_opened_total at 0 for every loaded rule: a counter first seen at 1
        hides that first incident from Prometheus' increase()."""
        for name in names:
            self.incidents_opened_total.labels(rule=name)

    def set_jobs(self, jobs: Sequence[JobView]) -> None:
        """The job views of this tick (ETTR, restarts, attempt, steps, node count)."""
        self.jobs.jobs = tuple(jobs)

    def set_node_incidents(self, open_counts: Mapping[str, int]) -> None:
        """Unresolved incidents per known node (0 included, so every node has a series)."""
        self.jobs.node_incidents = dict(open_counts)

    def set_node_hardware_incidents(self, counts: Mapping[str, int]) -> None:
        """Hardware incidents per known node within lifecycle.lemon_window_s (controller.lemons)."""
        self.jobs.node_hardware = dict(counts)

    def watch_store_size(self, sizes: Callable[[], tuple[int, int]]) -> None:
        """Export `sizes()` = (db bytes, wal bytes) as store_size_bytes, read at each scrape."""
        self.store_size_bytes.labels(file="db").set_function(lambda: float(sizes()[0]))
        self.store_size_bytes.labels(file="wal").set_function(lambda: float(sizes()[1]))

    def set_spares(self, available: Mapping[str, int]) -> None:
        """Available hot spares per pool; the default pool is always exported."""
        self.jobs.spares = {DEFAULT_SPARE_POOL: 0, **available}


class _Skips:
    """Samples a collector skipped since start because their value had no sample value."""

    def __init__(self) -> None:
        self.total = 0


class _SafeGauge(GaugeMetricFamily):
    """A gauge family that skips (and counts in `skips`) a value with no sample value."""

    def __init__(self, name: str, doc: str, *, labels: list[str], skips: _Skips) -> None:
        super().__init__(name, doc, labels=labels)
        self.skips = skips

    def add_metric(self, labels: Any, value: Any, timestamp: Any = None) -> None:
        v = metric_value(value)
        if v is None:
            self.skips.total += 1
            return
        super().add_metric(labels, v, timestamp)


class _SafeCounter(CounterMetricFamily):
    def __init__(self, name: str, doc: str, *, labels: list[str], skips: _Skips) -> None:
        super().__init__(name, doc, labels=labels)
        self.skips = skips

    def add_metric(
        self,
        labels: Any,
        value: Any,
        created: Any = None,
        timestamp: Any = None,
        exemplar: Any = None,
    ) -> None:
        v = metric_value(value)
        if v is None:
            self.skips.total += 1
            return
        super().add_metric(labels, v, created, timestamp, exemplar)


class _JobsCollector:
    """Per-job, per-pool and per-node families from the latest views: a job or node that
    leaves the views leaves /metrics too, so label values stay bounded by what the controller
    knows."""

    def __init__(self) -> None:
        self.jobs: tuple[JobView, ...] = ()
        self.spares: dict[str, int] = {DEFAULT_SPARE_POOL: 0}
        self.node_incidents: dict[str, int] = {}
        self.node_hardware: dict[str, int] = {}
        self.skips = _Skips()

    def describe(self) -> Iterable[Metric]:
        return []  # label values change every tick; describing would freeze them

    def collect(self) -> Iterator[Metric]:
        jobs, spares, node_incidents = self.jobs, dict(self.spares), dict(self.node_incidents)
        gauges = {
            "ettr": _SafeGauge(
                "trainguard_controller_job_ettr_ratio",
                "Effective training time ratio of the job (0..1).",
                labels=["job"],
                skips=self.skips,
            ),
            "attempt": _SafeGauge(
                "trainguard_controller_job_attempt",
                "Current attempt of the job (increments on every restart).",
                labels=["job"],
                skips=self.skips,
            ),
            "step": _SafeGauge(
                "trainguard_controller_job_step",
                "Highest step any rank of the job reported.",
                labels=["job"],
                skips=self.skips,
            ),
            "ckpt": _SafeGauge(
                "trainguard_controller_job_checkpoint_step",
                "Newest committed checkpoint step the ranks reported.",
                labels=["job"],
                skips=self.skips,
            ),
            "nodes": _SafeGauge(
                "trainguard_controller_job_nodes",
                "Nodes the job runs on.",
                labels=["job"],
                skips=self.skips,
            ),
            **_interval_gauges(self.skips),
        }
        restarts = _SafeCounter(
            "trainguard_controller_job_restarts",
            "Restarts of the job (any cause).",
            labels=["job"],
            skips=self.skips,
        )
        for job in jobs:
            labels = [job.name]
            if job.ettr is not None:
                gauges["ettr"].add_metric(labels, job.ettr)
            gauges["attempt"].add_metric(labels, job.attempt)
            if job.last_step is not None:
                gauges["step"].add_metric(labels, job.last_step)
            if job.ckpt_step is not None:
                gauges["ckpt"].add_metric(labels, job.ckpt_step)
            gauges["nodes"].add_metric(labels, len(job.nodes))
            advice = job.checkpoint_interval
            if advice is not None:
                gauges["ckpt_cost"].add_metric(labels, advice.checkpoint_s)
                gauges["restart"].add_metric(labels, advice.restart_s)
                gauges["mtbf"].add_metric(labels, advice.mtbf_s)
                gauges["optimal"].add_metric(labels, advice.optimal_s)
                gauges["optimal_waste"].add_metric(labels, advice.optimal_waste)
                if advice.current_s is not None:
                    gauges["current"].add_metric(labels, advice.current_s)
                if advice.current_waste is not None:
                    gauges["current_waste"].add_metric(labels, advice.current_waste)
            cost = job.failure_cost
            if cost is not None:
                # GPU-seconds: Prometheus' base unit (the views say GPU-hours)
                gauges["lost_gpu_s"].add_metric(labels, cost.lost_gpu_hours * 3600.0)
                if cost.checkpoint_overhead_gpu_hours is not None:
                    gauges["overhead_gpu_s"].add_metric(
                        labels, cost.checkpoint_overhead_gpu_hours * 3600.0
                    )
                if cost.lost_money is not None:
                    gauges["lost_money"].add_metric(labels, cost.lost_money)
            restarts.add_metric(labels, job.restarts)
        yield from gauges.values()
        yield restarts
        pools = _SafeGauge(
            "trainguard_controller_spares",
            "Hot spares available (role spare, state active), by pool.",
            labels=["pool"],
            skips=self.skips,
        )
        for pool, n in sorted(spares.items()):
            pools.add_metric([pool], n)
        yield pools
        per_node = _SafeGauge(
            "trainguard_controller_node_incidents_open",
            "Unresolved incidents per node (one series per known node).",
            labels=["node"],
            skips=self.skips,
        )
        for node, n in sorted(node_incidents.items()):
            per_node.add_metric([node], n)
        yield per_node
        hardware = _SafeGauge(
            "trainguard_controller_node_hardware_incidents",
            "Hardware incidents per node within lifecycle.lemon_window_s (one series per known"
            " node); at lifecycle.lemon_incidents the node is a lemon and is retired.",
            labels=["node"],
            skips=self.skips,
        )
        for node, n in sorted(dict(self.node_hardware).items()):
            hardware.add_metric([node], n)
        yield hardware
        skipped = CounterMetricFamily(
            "trainguard_controller_metric_values_skipped",
            "Samples left out of /metrics because their value could not be exported.",
        )
        skipped.add_metric([], self.skips.total)
        yield skipped


# the checkpoint interval advice per job (controller.ckptinterval): key -> (name, help)
_INTERVAL_GAUGES = {
    "ckpt_cost": (
        "trainguard_controller_job_checkpoint_cost_seconds",
        "What one checkpoint costs the job's training loop (mean of recent commits).",
    ),
    "restart": (
        "trainguard_controller_job_restart_seconds",
        "The job's restart time, fault to training again (mean of recent restarts, or the prior).",
    ),
    "mtbf": (
        "trainguard_controller_job_mtbf_seconds",
        "The job's expected time between failures (node MTBF / nodes).",
    ),
    "current": (
        "trainguard_controller_job_checkpoint_interval_seconds",
        "The periodic checkpoint interval the job runs with.",
    ),
    "optimal": (
        "trainguard_controller_job_checkpoint_interval_optimal_seconds",
        "The optimal checkpoint interval (Daly's refinement of Young's sqrt(2 C MTBF)).",
    ),
    "current_waste": (
        "trainguard_controller_job_checkpoint_waste_ratio",
        "Expected fraction of time lost with the current interval (checkpoints, redone work,"
        " restarts).",
    ),
    "optimal_waste": (
        "trainguard_controller_job_checkpoint_waste_optimal_ratio",
        "Expected fraction of time lost with the optimal interval.",
    ),
    # the cost of failures per job (controller.failurecost)
    "lost_gpu_s": (
        "trainguard_controller_job_lost_gpu_seconds",
        "GPU-seconds the job's failures cost within economics.mtbf_window_s (downtime and redone"
        " steps, times its GPUs).",
    ),
    "overhead_gpu_s": (
        "trainguard_controller_job_checkpoint_overhead_gpu_seconds",
        "GPU-seconds the job's checkpoints held its loop since the controller started.",
    ),
    "lost_money": (
        "trainguard_controller_job_lost_cost",
        "What the job's lost GPU-hours cost at cost.gpu_hour (absent without a price).",
    ),
}


def _interval_gauges(skips: _Skips) -> dict[str, _SafeGauge]:
    return {
        key: _SafeGauge(name, text, labels=["job"], skips=skips)
        for key, (name, text) in _INTERVAL_GAUGES.items()
    }


__all__ = [
    "DEFAULT_SPARE_POOL",
    "MAINTENANCE_JOBS",
    "REMEDIATION_PHASES",
    "RETENTION_TABLES",
    "ControllerMetrics",
]
