"""The write side of the controller's API: what an operator does to nodes (role, drain,
undrain, fault injection), jobs (submit, checkpoint, restart, stop) and silences. Every call
is audit-logged under its actor; drains and job steps run as action rows keyed by the audit
id, through the same handlers as remediation."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from trainguard.clock import Clock
from trainguard.controller.actions.worker import ActionRunner
from trainguard.controller.errors import BadRequest, Conflict, LimitReached, NotFound
from trainguard.controller.incidents import IncidentManager
from trainguard.controller.jobs import JobManager, JobSpec
from trainguard.controller.jobstate import JobState
from trainguard.controller.livestate import LiveState
from trainguard.controller.queries import QueryService
from trainguard.controller.records import NewAction
from trainguard.controller.store import Store
from trainguard.controller.views import ActionView, JobView, NodeRole, NodeView, SilenceView
from trainguard.protocol import FaultSpec, to_wire

__all__ = ["OperatorService"]

log = logging.getLogger("trainguard.controller")


class OperatorService:
    """The mutating calls of controller.service.ControllerService."""

    def __init__(
        self,
        *,
        live: LiveState,
        queries: QueryService,
        jobs: JobManager,
        incidents: IncidentManager,
        runner: ActionRunner,
        store: Store,
        clock: Clock,
        wake: threading.Event,
        max_silences: int = 1000,
    ) -> None:
        self._max_silences = max_silences  # api.max_silences
        self._live = live
        self._queries = queries
        self._jobs = jobs
        self._incidents = incidents
        self._runner = runner
        self._store = store
        self._clock = clock
        self._wake = wake

    # --- nodes ------------------------------------------------------------------------------

    def set_role(self, name: str, *, role: NodeRole, actor: str) -> NodeView:
        if role not in ("active", "spare"):
            raise BadRequest(f"role must be 'active' or 'spare', got {role!r}")
        with self._live.lock:
            if name not in self._live.nodes:
                raise NotFound(f"node {name!r} not found")
            self._live.put_node(self._store.nodes.update(name, role=role))
        self._store.audit.record(
            ts=self._clock.now(), actor=actor, action="set_role", target=name, detail={"role": role}
        )
        log.info("event=node_role node=%s role=%s actor=%s", name, role, actor)
        return self._queries.get_node(name)

    def drain(self, name: str, *, reason: str, actor: str) -> NodeView:
        self._operator_step("drain", name, actor=actor, detail={"reason": reason})
        return self._queries.get_node(name)

    def undrain(self, name: str, *, actor: str, force: bool = False) -> NodeView:
        detail: dict[str, Any] = {"force": True} if force else {}
        self._operator_step("undrain", name, actor=actor, detail=detail)
        return self._queries.get_node(name)

    def return_node(self, name: str, *, actor: str) -> NodeView:
        """`agentctl node return`: a `validate` step (a preflight, then back into service on
        a pass). It answers with the node validating; the step goes on in the worker."""
        state = self._live.node_state(name)
        if state is None:
            raise NotFound(f"node {name!r} not found")
        if state not in ("drained", "retired"):
            raise Conflict(f"node {name} is {state}: only a drained or retired node returns")
        self._operator_step("validate", name, actor=actor, detail={})
        return self._queries.get_node(name)

    def retire(self, name: str, *, reason: str, actor: str) -> NodeView:
        """`agentctl node retire`: out of service for good, with the reason (an RMA)."""
        if not reason.strip():
            raise BadRequest("reason: must say why the node is retired")
        self._operator_step("retire", name, actor=actor, detail={"reason": reason.strip()})
        return self._queries.get_node(name)

    def inject_fault(self, node: str, spec: FaultSpec, *, actor: str) -> str:
        if self._live.node_state(node) is None:
            raise NotFound(f"node {node!r} not found")
        command_id = f"fault-{uuid.uuid4().hex[:12]}"
        self._live.queue_command(node, spec, command_id=command_id)
        self._store.audit.record(
            ts=self._clock.now(),
            actor=actor,
            action="inject_fault",
            target=node,
            detail={"command_id": command_id, **to_wire(spec)},
        )
        return command_id

    def _operator_step(self, kind: str, name: str, *, actor: str, detail: dict[str, Any]) -> None:
        if self._live.node_state(name) is None:
            raise NotFound(f"node {name!r} not found")
        self._run_operator_step(kind, "node", name, actor=actor, audit=kind, detail=detail)

    def _run_operator_step(
        self, kind: str, scope: str, name: str, *, actor: str, audit: str, detail: dict[str, Any]
    ) -> ActionView:
        """An operator's step on a node or job: audit-logged, written as an action row keyed
        by the audit id (no incident), run now; a failed step is a 400 with its reason."""
        now = self._clock.now()
        audit_id = self._store.audit.record(
            ts=now, actor=actor, action=audit, target=name, detail=detail
        )
        (action_id,) = self._store.actions.add(
            None,
            [
                NewAction(
                    kind=kind,
                    target=name,
                    idempotency_key=f"operator:{kind}:{name}:{audit_id}",
                    params={scope: name, "actor": actor, **detail},
                )
            ],
            ts=now,
        )
        action = self._runner.run_one(action_id, now=now)
        self._wake.set()
        log.info(
            "event=operator_%s %s=%s actor=%s action=%d state=%s",
            audit,
            scope,
            name,
            actor,
            action_id,
            action.state,
        )
        if action.state == "failed":
            raise BadRequest(f"{kind} {name} failed: {action.result}")
        return action

    # --- jobs -------------------------------------------------------------------------------

    def submit_job(self, spec: JobSpec, *, actor: str) -> JobView:
        """Store a job and start its first attempt (through the action framework)."""
        now = self._clock.now()
        with self._live.lock:
            for node in spec.nodes:
                rec = self._live.nodes.get(node)
                if rec is None:
                    raise BadRequest(f"nodes: unknown node {node!r} (it has never reported)")
                if rec.state != "active":
                    raise BadRequest(f"nodes: {node} is {rec.state}")
        for node in spec.nodes:
            other = self._jobs.job_of_node(node)
            if other is not None and other.name != spec.name:
                raise Conflict(f"nodes: {node} runs job {other.name} ({other.state})")
        submitted = self._jobs.submit(spec, now=now)
        if submitted is None:
            current = self._jobs.get(spec.name)
            state = current.state if current else "unknown"
            raise Conflict(f"job {spec.name!r} exists and is {state}; stop it first")
        self._jobs.place(
            spec.name,
            nodes=spec.nodes,
            nproc_per_node=spec.nproc_per_node,
            assign=spec.nodes,
            release=(),
        )
        self._job_step("restart", spec.name, actor=actor, detail={"reason": "submit"})
        log.info(
            "event=job_submitted job=%s nodes=%s actor=%s", spec.name, ",".join(spec.nodes), actor
        )
        return self._queries.get_job(spec.name)

    def job_action(self, name: str, kind: str, *, actor: str) -> ActionView:
        """Operator checkpoint / restart / stop of a job, as an audited action step."""
        if kind not in ("checkpoint", "restart", "stop"):
            raise BadRequest(f"unknown job action {kind!r}")
        rec = self._jobs.get(name)
        if rec is None:
            raise NotFound(f"job {name!r} not found")
        if kind == "checkpoint" and rec.state not in (JobState.RUNNING, JobState.STARTING):
            raise Conflict(f"job {name} is {rec.state}; only a running job can checkpoint")
        state = JobState.parse(rec.state)
        if kind == "stop" and state is not None and state.finished:
            raise Conflict(f"job {name} is already {rec.state}")
        return self._job_step(kind, name, actor=actor, detail={})

    def _job_step(self, kind: str, job: str, *, actor: str, detail: dict[str, Any]) -> ActionView:
        return self._run_operator_step(
            kind, "job", job, actor=actor, audit=f"job_{kind}", detail=detail
        )

    # --- silences ---------------------------------------------------------------------------

    def create_silence(
        self,
        *,
        rule: str | None,
        node: str | None,
        duration_s: float,
        comment: str,
        actor: str,
    ) -> SilenceView:
        if not rule and not node:
            raise BadRequest("a silence needs a rule, a node, or both")
        if not duration_s > 0:
            raise BadRequest(f"duration_s must be > 0, got {duration_s}")
        now = self._clock.now()
        active = self._store.silences.find(now=now, include_expired=False)
        if len(active) >= self._max_silences:
            raise LimitReached(
                f"{len(active)} silences are active, the most api.max_silences allows"
                f" ({self._max_silences}): delete one or let one expire first"
            )
        silence = self._store.silences.add(
            rule=rule or None,
            node=node or None,
            created_by=actor,
            created_at=now,
            expires_at=now + duration_s,
            comment=comment,
        )
        touched = self._incidents.apply_silence(silence, now=now)
        self._store.audit.record(
            ts=now,
            actor=actor,
            action="create_silence",
            target=f"silence:{silence.id}",
            detail={
                "rule": rule,
                "node": node,
                "duration_s": duration_s,
                "comment": comment,
                "open_incidents": touched,
            },
        )
        log.info(
            "event=silence_created silence=%d rule=%s node=%s actor=%s open_incidents=%d",
            silence.id,
            rule,
            node,
            actor,
            len(touched),
        )
        return silence

    def delete_silence(self, silence_id: int, *, actor: str) -> None:
        now = self._clock.now()
        if not self._store.silences.delete(silence_id, now=now):
            raise NotFound(f"silence {silence_id} not found")
        self._store.audit.record(
            ts=now, actor=actor, action="delete_silence", target=f"silence:{silence_id}", detail={}
        )
