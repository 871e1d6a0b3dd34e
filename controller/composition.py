"""The controller's composition root: `Controller` builds the controller's parts over one
store and presents them as one object, the ControllerService the API calls.

The work is done by services, each with one job: `ReportService` (controller/reports.py,
the report ingest hot path and the commands riding on its responses), `TickService`
(controller/tick.py: rule evaluation, incidents, the tick and action worker threads),
`QueryService` (controller/queries.py: the API's reads) and `OperatorService`
(controller/operations.py: drain, roles, jobs, silences, faults). They share the in-memory
node state and its lock (`LiveState`, controller/livestate.py). The methods here delegate.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.command_args import CommandArgs
from trainguard.controller.actions.alertresend import AlertResender
from trainguard.controller.actions.base import ActionHandler, HandlerRegistry
from trainguard.controller.actions.drain import DrainBackend, DrainHandler, UndrainHandler
from trainguard.controller.actions.lifecycle import RetireHandler, ValidateHandler
from trainguard.controller.actions.notify import (
    AlertmanagerNotifier,
    Notifier,
    NotifyHandler,
    build_notifiers,
    channels_for,
)
from trainguard.controller.actions.repairsteps import DiagnoseHandler, RepairHandler
from trainguard.controller.actions.sparecheck import preflight_args, spare_preflight
from trainguard.controller.actions.worker import ActionRunner
from trainguard.controller.backends.aws.asg import AsgClient
from trainguard.controller.backends.aws.backend import CloudReplacement
from trainguard.controller.backends.base import Capability, step_handlers
from trainguard.controller.backends.build import build_backend
from trainguard.controller.backends.slurm.cli import SlurmRunner
from trainguard.controller.ckptadvisor import CheckpointAdvisor
from trainguard.controller.ckptauto import AutoInterval
from trainguard.controller.config import ControllerConfig
from trainguard.controller.incidents import IncidentManager
from trainguard.controller.jobnames import JobNames
from trainguard.controller.jobs import JobManager, JobSpec
from trainguard.controller.lemons import LemonPolicy
from trainguard.controller.livestate import LiveState
from trainguard.controller.maintenance import MaintenanceScheduler
from trainguard.controller.metrics import ControllerMetrics
from trainguard.controller.model import Decision
from trainguard.controller.operations import OperatorService
from trainguard.controller.queries import QueryService
from trainguard.controller.records import CommandRecord, NodeRecord
from trainguard.controller.repairplan import DIAGNOSIS_CHECKS, RepairPlanner
from trainguard.controller.reports import ReportService
from trainguard.controller.rules.loader import Rule
from trainguard.controller.safety import Safety
from trainguard.controller.signals import SignalState
from trainguard.controller.store import Store, WriteFence
from trainguard.controller.store.errors import LeaseLost, StoreError, StoreUnavailable
from trainguard.controller.store.lease import LeaseFence
from trainguard.controller.tick import TickService, load_rule_set
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
from trainguard.kinds import CommandKind
from trainguard.protocol import FaultSpec, Report, ReportResponse
from trainguard.strict import ConfigError
from trainguard.xid_catalog import XidCatalog

log = logging.getLogger("trainguard.controller")


@dataclass
class ActionBackends:
    """Injectable action backends (tests pass recording fakes).

    notifiers None: built from config.notify. drain None: the scheduler backend's (the local
    backend over this controller for torchrun, scontrol for Slurm). handlers: extra step
    handlers registered over the backend's. slurm_runner: replaces the Slurm commands.
    asg_client: region -> the Auto Scaling client cloud replacement uses (tests; default
    boto3's).
    """

    notifiers: list[Notifier] | None = None
    drain: DrainBackend | None = None
    handlers: list[ActionHandler] = field(default_factory=list)
    slurm_runner: SlurmRunner | None = None
    asg_client: Callable[[str], AsgClient] | None = None


class Controller:
    """Implements controller.service.ControllerService."""

    def __init__(
        self,
        config: ControllerConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        backends: ActionBackends | None = None,
        metrics: ControllerMetrics | None = None,
        fence: WriteFence | None = None,
        standby: bool = False,
    ) -> None:
        """`metrics`, `fence` and `standby` are for HA (controller/ha.py), which builds one
        Controller per lease epoch over one set of metrics: `fence` is checked by every write
        transaction; a `standby` one only serves reads (it leaves rows a previous process
        left `running` to the leader, which recovers them)."""
        self.config = config
        self.clock = clock
        self.metrics = metrics if metrics is not None else ControllerMetrics()
        backends = backends or ActionBackends()
        try:
            self.store = Store(
                config.store.location,
                now=clock.now,
                password=config.store.read_password(),
                connect_timeout_s=config.store.connect_timeout_s,
            )
        except StoreError as e:
            # a store the controller cannot use (or reach) is a deployment problem: exit 2
            key = "store.path" if config.store.url is None else "store.url"
            raise ConfigError("", key, str(e)) from None
        self.store.fence = fence
        self.lemons = LemonPolicy(store=self.store, config=config.lifecycle, now=clock.now)
        rules = load_rule_set(config)
        self.metrics.known_rules(rules.names())
        catalog = XidCatalog.load(config.xid_catalog or None)
        self.signals = SignalState(xid_catalog=catalog, history_s=config.history_s)
        self.signals.track(rules.history_needs())
        # in-memory node state (the store is written on change, freshness in batches)
        self.live = live = LiveState(store=self.store, signals=self.signals, clock=clock)

        # jobs (the job table + the live view of ranks and launches)
        self.jobs = JobManager(
            store=self.store,
            nodes=live,
            config=config.jobs,
            node_silent_after_s=config.node_silent_after_s,
            clock_now=clock.now,
            on_state=live.set_job_meta,
        )

        # actions
        self.notifiers = (
            backends.notifiers if backends.notifiers is not None else build_notifiers(config.notify)
        )
        self.registry = HandlerRegistry()
        self.registry.register(
            NotifyHandler(
                notifiers={n.channel: n for n in self.notifiers},
                base_url=config.notify.base_url,
                on_failure=self._notification_failed,
                rule_of=self._rule,
            )
        )
        # where jobs run (torchrun on the agents, or Slurm): every job step asks it
        self.backend = build_backend(
            config,
            live=live,
            jobs=self.jobs,
            clock=clock,
            open_incident_nodes=lambda: set(self.store.incidents.open_counts()),
            observe=self._observe_recovery,
            slurm_runner=backends.slurm_runner,
        )
        drain_backend = backends.drain or self.backend
        wake = threading.Event()  # the action worker: new or due steps
        lifecycle = config.lifecycle
        # the node lifecycle after a hardware drain: diagnose -> repair -> validate
        self.repairs = RepairPlanner(
            store=self.store, config=lifecycle, catalog=catalog, now=clock.now, wake=wake.set
        )
        self.registry.register(
            DrainHandler(
                backend=drain_backend,
                ops=live,
                stale_after_s=config.stale_after_s,
                stale_exempt_rules=tuple(config.safety.stale_exempt_rules),
                presence=self.jobs.presence,
                lemon=self.lemons.verdict,
                after_drain=lambda node, incident, key: self.repairs.after_drain(
                    node, incident=incident, key=key
                ),
            )
        )
        self.registry.register(UndrainHandler(backend=drain_backend))
        self.registry.register(
            ValidateHandler(
                backend=drain_backend,
                ops=live,
                preflight=preflight_args(lifecycle),
                timeout_s=lifecycle.preflight_timeout_s,
                set_role=self._set_role,
                lemon=lambda node: self.lemons.verdict(node, failing=1),
                on_validated=self._node_validated,
            )
        )
        self.registry.register(
            DiagnoseHandler(
                ops=live,
                plan=self.repairs,
                preflight=dataclasses.replace(
                    preflight_args(lifecycle), checks=list(DIAGNOSIS_CHECKS)
                ),
                timeout_s=lifecycle.preflight_timeout_s,
            )
        )
        self.registry.register(
            RepairHandler(
                ops=live,
                plan=self.repairs,
                timeout_s=lifecycle.repair_timeout_s,
                lemon=lambda node: self.lemons.verdict(node, failing=1),
            )
        )
        self.registry.register(RetireHandler(backend=drain_backend, ops=live))
        # cloud replacement: a retired node's instance terminated through its Auto Scaling
        # Group (the aws backend); without the capability the kind stays unavailable
        self.cloud: CloudReplacement | None = None
        if Capability.CLOUD_REPLACE in self.backend.capabilities:
            self.cloud = CloudReplacement(
                config.backend.aws,
                store=self.store,
                live=live,
                wake=wake.set,
                dry_run=config.safety.dry_run,
                set_role=self._set_role,
                preflight=preflight_args(lifecycle),
                client_for=backends.asg_client,
            )
            self.registry.register(self.cloud.handler)
        for job_handler in step_handlers(self.backend):
            self.registry.register(job_handler)
        for handler in backends.handlers:
            self.registry.register(handler)
        self.safety = Safety(self.store, config.safety)
        self.safety.job_floor = lambda node: self.jobs.drain_floor_reason(
            node, open_incident_nodes=set(self.store.incidents.open_counts())
        )
        self.incidents = IncidentManager(
            store=self.store,
            safety=self.safety,
            registry=self.registry,
            channels=lambda severity, page: channels_for(
                self.notifiers, severity=severity, page=page
            ),
            on_new_actions=wake.set,
            jobs=self.jobs,
        )
        self.runner = ActionRunner(
            store=self.store,
            registry=self.registry,
            config=config.actions,
            listener=self.incidents,
            counter=self.metrics,
            gate=lambda action, now: self.incidents.notification_gate(action, now=now),
        )

        # the services
        self.reports = ReportService(
            live=live,
            jobs=self.jobs,
            store=self.store,
            metrics=self.metrics,
            clock=clock,
            wake=wake,
            max_nodes=config.api.max_nodes,
            scheduler=self.backend,
            fast_reports_s=config.actions.fast_reports_s,
            fast_reports_window_s=config.actions.fast_reports_window_s,
            fast_reports_max_nodes=config.actions.fast_reports_max_nodes,
            remediating=lambda: self.runner.remediating,
            job_names=JobNames(
                max_per_node=config.api.max_unknown_jobs_per_node,
                max_total=config.api.max_unknown_jobs,
                expire_after_s=config.api.unknown_job_expire_s,
                is_known=lambda job: self.jobs.get(job) is not None,
            ),
        )
        advisor = CheckpointAdvisor(
            store=self.store,
            jobs=self.jobs,
            config=config.economics,
            cost=config.cost,
            clock=clock,
            node_count=lambda: len(live.nodes),
            started_at=clock.now(),
        )
        # `checkpoint.interval: auto` jobs: the advice sent to their ranks, on the tick
        self.auto_interval = AutoInterval(
            store=self.store, jobs=self.jobs, advisor=advisor, config=config.economics, clock=clock
        )
        self.queries = QueryService(
            live=live,
            jobs=self.jobs,
            store=self.store,
            clock=clock,
            node_silent_after_s=config.node_silent_after_s,
            scheduler_jobs=self.backend.job_views,
            lemons=self.lemons,
            advisor=advisor,
            auto_interval=self.auto_interval,
        )
        self.operations = OperatorService(
            live=live,
            queries=self.queries,
            jobs=self.jobs,
            incidents=self.incidents,
            runner=self.runner,
            store=self.store,
            clock=clock,
            wake=wake,
            max_silences=config.api.max_silences,
        )
        # the free spares' preflights kept fresh ahead of need, so a swap seldom waits for one
        spare_keeper = dataclasses.replace(
            spare_preflight(
                lifecycle,
                ops=live,
                last_preflight=lambda node: self.store.commands.last_done(
                    node, kind=CommandKind.PREFLIGHT.value
                ),
                lemon=self.lemons.verdict,
            ),
            out_of_pool=lambda node, reason: self._spare_out_of_pool(
                drain_backend, node, reason=reason
            ),
        )
        # open incidents' alerts re-sent to Alertmanager, by the leader only
        am_config = config.notify.alertmanager
        self.alert_resender = AlertResender(
            notifiers=[n for n in self.notifiers if isinstance(n, AlertmanagerNotifier)],
            resend_s=am_config.resend_s if am_config is not None else 60.0,
            open_incidents=self.store.incidents.unresolved,
            actions_of=self.store.actions.for_incident,
            leader=lambda: not standby and (not isinstance(fence, LeaseFence) or fence.valid()),
            rule_of=self._rule,
            base_url=config.notify.base_url,
            on_result=lambda channel, outcome: self.metrics.alert_resends_total.labels(
                channel=channel, outcome=outcome
            ).inc(),
        )
        self.ticker = TickService(
            config=config,
            clock=clock,
            rules=rules,
            live=live,
            queries=self.queries,
            jobs=self.jobs,
            incidents=self.incidents,
            runner=self.runner,
            store=self.store,
            metrics=self.metrics,
            wake=wake,
            can_grow=Capability.GROW in self.backend.capabilities,
            expire_job_names=self.reports.expire_job_names,
            lemons=self.lemons,
            plan_replacements=self._plan_replacements,
            resend_alerts=self.alert_resender.resend,
            keep_spares_warm=lambda now: (
                lifecycle.spare_preflight_ahead
                and spare_keeper.keep_warm(
                    self.jobs.spares(
                        {}, open_incident_nodes=set(self.store.incidents.open_counts()), exclude=()
                    ),
                    now=now,
                )
            ),
            auto_interval=self.auto_interval.tick,
        )
        self.maintenance = MaintenanceScheduler(
            store=self.store, config=config.maintenance, metrics=self.metrics, clock=clock
        )
        if not standby:
            self.runner.recover(now=clock.now())
        self.ticker.update_gauges(clock.now())

    def _spare_out_of_pool(self, backend: DrainBackend, node: str, *, reason: str) -> None:
        """A free spare whose preflight ahead of need failed leaves the pool through the drain
        backend, with the reason: under Slurm it is drained there too, so slurmctld schedules
        nothing on it and the mirror keeps it drained (`node return` validates and resumes
        it). A drain that fails is logged; the next round of keep_warm tries it again, as the
        node is still in the pool then."""
        try:
            backend.drain(node, reason=reason, key=f"spare-preflight:{node}")
        except Exception as e:  # a scheduler command that failed: the tick goes on
            log.warning("event=spare_drain_failed node=%s reason=%r error=%r", node, reason, e)

    def _node_validated(self, node: str, now: float) -> None:
        """A node passed its validation: the windows of its signals start over (the repaired
        fault no longer holds a rule's condition true), then its hardware incidents end, so
        the node's next fault opens an incident of its own."""
        with self.live.lock:
            self.live.change_signals(self.signals.forget_node_history, node)
        ended = self.incidents.end_node_incidents(
            node, now=now, why=f"{node} passed its validation (preflight): the fault is repaired"
        )
        if ended:
            log.info("event=incidents_ended node=%s incidents=%s", node, ended)

    def _plan_replacements(self, now: float) -> None:
        if self.cloud is not None:
            self.cloud.planner.plan(now=now)

    def _rule(self, name: str) -> Rule | None:
        # the ticker is built after the handlers; a notify step runs only once it is
        return self.ticker.rule(name)

    def _set_role(self, node: str, role: str) -> None:
        """A node's role, as the lifecycle brings it back (a repaired node returns a spare),
        in the node table and on the scheduler's side (under Slurm: the spare reservation)."""
        with self.live.lock:
            if node in self.live.nodes:
                self.live.put_node(self.store.nodes.update(node, role=role))
        self.backend.return_to_pool(node, role=role)
        log.info("event=node_role node=%s role=%s actor=lifecycle", node, role)

    def _notification_failed(self, channel: str) -> None:
        self.metrics.notifications_failed_total.labels(channel=channel).inc()

    def _observe_recovery(self, phases: dict[str, float], lost_steps: int | None) -> None:
        for phase, seconds in phases.items():
            self.metrics.remediation_phase_seconds.labels(phase=phase).observe(seconds)
        if lost_steps is not None:
            self.metrics.remediation_lost_steps.observe(lost_steps)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the tick thread, the action worker thread and the store maintenance jobs."""
        if self.ticker.running:
            return
        self.backend.start()
        self.ticker.start()
        self.maintenance.start()
        log.info("event=controller_started store=%s rules=%d", self.store.path, self.rule_count)

    def stop(self) -> None:
        """Stop the threads, flush freshness, close the store."""
        self.stop_acting()
        try:
            self.live.flush()
        except LeaseLost:  # HA: a controller that no longer leads writes nothing
            log.info("event=freshness_not_flushed reason=not_leader")
        except StoreUnavailable:  # nothing to flush to; the next leader's agents report anew
            log.warning("event=freshness_not_flushed reason=store_unavailable")
        self.store.close()
        log.info("event=controller_stopped")

    def stop_acting(self) -> None:
        """Stop the tick, the action worker, the maintenance jobs and the backend; the store
        stays open for reads (HA: what a leader that lost its lease keeps)."""
        self.maintenance.stop()
        self.ticker.stop()
        self.backend.close()

    @property
    def running(self) -> bool:
        return self.ticker.running

    @property
    def rule_count(self) -> int:
        return self.ticker.rule_count

    def ticking(self, *, within_s: float | None = None) -> bool:
        """True while the tick thread runs and finished a round lately (TickService.ticking)."""
        return self.ticker.ticking(within_s=within_s)

    # --- the tick (TickService) ---------------------------------------------------------------

    def tick(self, *, now: float | None = None) -> None:
        """One round: flush freshness, time out commands, evaluate rules, apply decisions.
        Without `start()` it also runs the due action steps (tests drive it step by step)."""
        self.ticker.tick(now=now)

    def apply_decisions(self, decisions: Sequence[Decision], *, now: float) -> list[int]:
        """Feed decisions to the incident layer; returns ids of incidents opened."""
        return self.ticker.apply_decisions(decisions, now=now)

    def run_actions(self, *, now: float | None = None) -> int:
        """Run due action steps now (what the worker thread does); returns how many ran."""
        return self.ticker.run_actions(now=now)

    def reload_rules(self, *, actor: str) -> int:
        return self.ticker.reload_rules(actor=actor)

    # --- node state (LiveState: NodeAccess, NodeOps, tooling) ---------------------------------

    def node_record(self, node: str) -> NodeRecord | None:
        return self.live.node_record(node)

    def all_nodes(self) -> list[NodeRecord]:
        return self.live.all_nodes()

    def refresh_node(self, node: str) -> None:
        self.live.refresh_node(node)

    def node_state(self, node: str) -> str | None:
        return self.live.node_state(node)

    def node_job(self, node: str) -> str | None:
        return self.live.node_job(node)

    def report_age_s(self, node: str) -> float | None:
        return self.live.report_age_s(node)

    def set_node_state(self, node: str, state: str, *, reason: str | None) -> None:
        self.live.set_node_state(node, state, reason=reason)

    def queue_command(self, node: str, args: CommandArgs, *, command_id: str) -> None:
        self.live.queue_command(node, args, command_id=command_id)

    def command_status(self, command_id: str) -> CommandRecord | None:
        return self.live.command_status(command_id)

    def pending_commands(self, node: str) -> list[CommandRecord]:
        return self.live.pending_commands(node)

    def nodes_known(self) -> Iterable[str]:
        return self.live.nodes_known()

    def ingest_report(self, report: Report, *, actor: str) -> ReportResponse:
        """The report path's ingest stage (controller/api/reports.py has the stages before)."""
        return self.reports.ingest_report(report, actor=actor)

    def refuse_report(self, *, actor: str, node: str, bound_node: str) -> None:
        self.reports.refuse_report(actor=actor, node=node, bound_node=bound_node)

    # --- reads (QueryService) -----------------------------------------------------------------

    def list_nodes(self) -> list[NodeView]:
        return self.queries.list_nodes()

    def get_node(self, name: str) -> NodeView:
        return self.queries.get_node(name)

    def list_spares(self) -> list[NodeView]:
        return self.queries.list_spares()

    def list_incidents(
        self,
        *,
        state: str | None = None,
        node: str | None = None,
        limit: int = 100,
        before_id: int | None = None,
    ) -> list[IncidentView]:
        return self.queries.list_incidents(state=state, node=node, limit=limit, before_id=before_id)

    def get_incident(self, incident_id: int) -> IncidentDetail:
        return self.queries.get_incident(incident_id)

    def list_jobs(self) -> list[JobView]:
        return self.queries.list_jobs()

    def get_job(self, name: str) -> JobView:
        return self.queries.get_job(name)

    def list_silences(self, *, include_expired: bool = False) -> list[SilenceView]:
        return self.queries.list_silences(include_expired=include_expired)

    def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditEntry]:
        return self.queries.audit_log(limit=limit, before_id=before_id)

    # --- operator calls (OperatorService) -----------------------------------------------------

    def set_role(self, name: str, *, role: NodeRole, actor: str) -> NodeView:
        return self.operations.set_role(name, role=role, actor=actor)

    def drain(self, name: str, *, reason: str, actor: str) -> NodeView:
        return self.operations.drain(name, reason=reason, actor=actor)

    def undrain(self, name: str, *, actor: str, force: bool = False) -> NodeView:
        return self.operations.undrain(name, actor=actor, force=force)

    def return_node(self, name: str, *, actor: str) -> NodeView:
        return self.operations.return_node(name, actor=actor)

    def retire(self, name: str, *, reason: str, actor: str) -> NodeView:
        return self.operations.retire(name, reason=reason, actor=actor)

    def inject_fault(self, node: str, spec: FaultSpec, *, actor: str) -> str:
        return self.operations.inject_fault(node, spec, actor=actor)

    def submit_job(self, spec: JobSpec, *, actor: str) -> JobView:
        """Store a job and start its first attempt (through the action framework)."""
        return self.operations.submit_job(spec, actor=actor)

    def job_action(self, name: str, kind: str, *, actor: str) -> ActionView:
        """Operator checkpoint / restart / stop of a job, as an audited action step."""
        return self.operations.job_action(name, kind, actor=actor)

    def create_silence(
        self,
        *,
        rule: str | None,
        node: str | None,
        duration_s: float,
        comment: str,
        actor: str,
    ) -> SilenceView:
        return self.operations.create_silence(
            rule=rule, node=node, duration_s=duration_s, comment=comment, actor=actor
        )

    def delete_silence(self, silence_id: int, *, actor: str) -> None:
        self.operations.delete_silence(silence_id, actor=actor)


__all__ = ["ActionBackends", "Controller"]
