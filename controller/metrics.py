"""The controller's own Prometheus metrics, in a per-instance CollectorRegistry (two
controllers in one test process never share series). Names `trainguard_controller_*`, units
in names, counters end in `_total`; every label has a bounded set of values."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Report ingest is sub-millisecond when healthy; the 100 ms p99 target sits mid-range.
INGEST_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# One rule tick over 2,048 nodes must stay under 250 ms.
EVAL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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

    # --- helpers the controller calls -------------------------------------------------------

    def count(self, kind: str, result: str) -> None:
        self.actions_total.labels(kind=kind, result=result).inc()

    def set_nodes(self, counts: dict[tuple[str, str], int]) -> None:
        for role in ("active", "spare"):
            for state in ("active", "draining", "drained"):
                self.nodes.labels(role=role, state=state).set(counts.get((role, state), 0))

    def set_incidents(self, open_incidents: Iterable[tuple[str, str]]) -> None:
        """(rule, severity) of every unresolved incident; series for rules at 0 are dropped."""
        counts: dict[tuple[str, str], int] = {}
        for key in open_incidents:
            counts[key] = counts.get(key, 0) + 1
        self.incidents_open.clear()
        for (rule, severity), n in counts.items():
            self.incidents_open.labels(rule=rule, severity=severity).set(n)


__all__ = ["ControllerMetrics"]
