"""Draining nodes: the DrainBackend Protocol (a scheduler backend is one, see
controller.backends), the local backend (node state + a `stop_job`
command to the node's agent), a recording fake, and the `drain` / `undrain` step handlers.

Local drain: node -> draining; if the node runs a job, queue `stop_job` for its agent and
poll until the agent reports the command's result; then -> drained (at once when no job
runs, or when the node is silent: the command stays queued for its return). Draining a
drained node is a no-op success, so every step is safe to repeat. After a controller
restart, a node not heard from yet is neither (`presence` "unknown"): the drain step waits
for its next report, bounded by jobs.resume_grace_s, instead of reading its stored age.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from trainguard.bounds import clip_drain_reason
from trainguard.command_args import CommandArgs, StopJobArgs
from trainguard.controller.actions.base import ActionContext, Outcome, PermanentError
from trainguard.controller.nodestate import NodeState
from trainguard.controller.records import CommandRecord
from trainguard.controller.repairplan import FollowUp
from trainguard.controller.safety import stale_drain_reason
from trainguard.controller.views import IncidentView

log = logging.getLogger("trainguard.controller.drain")

DrainState = Literal["draining", "drained"]
# node -> "reporting" | "silent" | "unknown" (controller.jobs.JobManager.presence)
PresenceOf = Callable[[str], str]


class NodeOps(Protocol):
    """What the local backend needs from the controller (the Controller implements it)."""

    def node_state(self, node: str) -> str | None:
        """A NodeState value, or None for an unknown node."""

    def node_job(self, node: str) -> str | None:
        """The job whose processes run on the node now, if any."""

    def report_age_s(self, node: str) -> float | None:
        """Seconds since the node's last report; None if it never reported."""

    def set_node_state(self, node: str, state: str, *, reason: str | None) -> None: ...

    def queue_command(self, node: str, args: CommandArgs, *, command_id: str) -> None:
        """Queue a command for the node's agent; a repeated id is a no-op."""

    def command_status(self, command_id: str) -> CommandRecord | None: ...


class DrainBackend(Protocol):
    name: str

    def drain(
        self,
        node: str,
        *,
        reason: str,
        key: str,
        rule: str | None = None,
        incident_id: int | None = None,
    ) -> tuple[DrainState, dict[str, Any]]:
        """Start draining; returns the state reached and progress data to poll with. `rule`
        and `incident_id` say which incident asks (None: an operator)."""

    def poll(self, node: str, *, key: str, progress: dict[str, Any]) -> DrainState:
        """Check a drain in progress; raises PermanentError when it cannot complete."""

    def undrain(self, node: str, *, key: str, force: bool = False) -> None:
        """Back into service; `force` also undoes a drain trainguard did not make (where
        the backend can tell)."""


class LocalDrainBackend:
    """Drain through the node's own agent: state in the store, `stop_job` as a command."""

    name = "local"

    def __init__(
        self,
        ops: NodeOps,
        *,
        stop_grace_s: float = 30.0,
        silent_after_s: float | None = None,
        presence: PresenceOf | None = None,
        grace_of: Callable[[str], float | None] | None = None,
    ) -> None:
        self._ops = ops
        self._grace_s = stop_grace_s
        # Given: a job's own stop grace on a drained node (None: stop_grace_s); a job
        # recovered in process is killed at once (controller.jobs.JobManager.drain_grace_s),
        # and not awaited: its ranks there are fenced by the next attempt epoch (a rank of an
        # older epoch can never commit), and its survivors go on only once they are gone
        self._grace_of = grace_of
        # A node silent for longer than this cannot answer stop_job: it is drained at once
        # (the command stays queued for when its agent returns). None: always wait.
        self._silent_after_s = silent_after_s
        # Given: says whether a node is silent instead (an unknown node is not: waited for)
        self._presence = presence

    def drain(
        self,
        node: str,
        *,
        reason: str,
        key: str,
        rule: str | None = None,
        incident_id: int | None = None,
    ) -> tuple[DrainState, dict[str, Any]]:
        state = self._ops.node_state(node)
        if state is None:
            raise PermanentError(f"unknown node {node!r}")
        if state == "drained":
            return "drained", {}
        held = NodeState.parse(state)
        if held is not None and held.in_lifecycle:
            # already out of service: a lifecycle step (or a retirement) holds it
            return "drained", {"note": f"already out of service: {state}"}
        self._ops.set_node_state(node, "draining", reason=reason)
        if self._presence is not None and self._presence(node) == "unknown":
            # not heard from since the controller started: which job it runs is not known yet
            return "draining", {"reason": reason}
        job = self._ops.node_job(node)
        if job is None:
            self._ops.set_node_state(node, "drained", reason=reason)
            return "drained", {}
        command_id = f"drain-{key}"
        own = self._grace_of(job) if self._grace_of is not None else None
        grace_s = self._grace_s if own is None else own
        self._ops.queue_command(node, StopJobArgs(job=job, grace_s=grace_s), command_id=command_id)
        log.info("event=drain_stop_job node=%s job=%s command=%s", node, job, command_id)
        if self._silent(node):
            self._ops.set_node_state(node, "drained", reason=reason)
            return "drained", {"command_id": command_id, "job": job, "silent": True}
        if own == 0.0:  # killed at once and fenced (above): the replacement need not wait
            self._ops.set_node_state(node, "drained", reason=reason)
            return "drained", {"command_id": command_id, "job": job, "fenced": True}
        return "draining", {"command_id": command_id, "job": job, "reason": reason}

    def _silent(self, node: str) -> bool:
        if self._silent_after_s is None:
            return False
        if self._presence is not None:
            return self._presence(node) == "silent"
        age = self._ops.report_age_s(node)
        return age is None or age > self._silent_after_s

    def poll(self, node: str, *, key: str, progress: dict[str, Any]) -> DrainState:
        held = NodeState.parse(self._ops.node_state(node) or "")
        if held is NodeState.DRAINED or (held is not None and held.in_lifecycle):
            return "drained"
        if self._silent(node):
            self._ops.set_node_state(node, "drained", reason=progress.get("reason"))
            return "drained"
        command_id = str(progress.get("command_id") or f"drain-{key}")
        record = self._ops.command_status(command_id)
        if record is None:
            # Lost (e.g. store restored): queue it again; the agent dedupes by id.
            state, _ = self.drain(node, reason=str(progress.get("reason", "")), key=key)
            return state
        if record.done_at is None:
            return "draining"
        if not record.ok:
            raise PermanentError(f"stop_job on {node} failed: {record.result or 'no detail'}")
        self._ops.set_node_state(node, "drained", reason=progress.get("reason"))
        return "drained"

    def undrain(self, node: str, *, key: str, force: bool = False) -> None:
        state = self._ops.node_state(node)
        if state is None:
            raise PermanentError(f"unknown node {node!r}")
        held = NodeState.parse(state)
        if held is not None and held.in_lifecycle:
            raise PermanentError(
                f"{node} is {state}: the node lifecycle holds it"
                " (`agentctl node return` validates it and brings it back)"
            )
        self._ops.set_node_state(node, "active", reason=None)


class RecordingDrainBackend:
    """Test double: records calls; drains complete at once unless `complete` is False."""

    name = "recording"

    def __init__(self, *, complete: bool = True) -> None:
        self.complete = complete
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def drain(
        self,
        node: str,
        *,
        reason: str,
        key: str,
        rule: str | None = None,
        incident_id: int | None = None,
    ) -> tuple[DrainState, dict[str, Any]]:
        with self._lock:
            self.calls.append(("drain", node))
        return ("drained" if self.complete else "draining"), {}

    def poll(self, node: str, *, key: str, progress: dict[str, Any]) -> DrainState:
        with self._lock:
            self.calls.append(("poll", node))
        return "drained" if self.complete else "draining"

    def undrain(self, node: str, *, key: str, force: bool = False) -> None:
        with self._lock:
            self.calls.append(("undrain", node))


@dataclass
class DrainHandler:
    """The `drain` step, params {"node", "reason"}; refuses to act on stale data."""

    backend: DrainBackend
    ops: NodeOps
    stale_after_s: float
    stale_exempt_rules: tuple[str, ...] = ()
    poll_interval_s: float = 1.0
    kind: str = "drain"
    remediation: bool = True
    # Given: a node unknown after a controller restart is waited for (its stored report
    # age would make the stale check, and the drain, guess)
    presence: PresenceOf | None = None
    # Given: node -> the retire reason when it is a lemon (controller.lemons); a lemon is
    # retired once drained instead of staying drained
    lemon: Callable[[str], str | None] | None = None
    # Given: (node, incident, drain key) -> the node lifecycle's follow-up of an incident's
    # drain (controller.repairplan: diagnose -> repair -> validate), planned before the step
    # ends so a crash in between re-plans it under the same key
    after_drain: Callable[[str, IncidentView, str], FollowUp | None] | None = None

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True

    def run(self, ctx: ActionContext) -> Outcome:
        node = str(ctx.params.get("node", ""))
        if not node:
            raise PermanentError("drain needs a node")
        if self.presence is not None and self.presence(node) == "unknown":
            return Outcome(
                message=f"waiting for {node} to report again after the controller restart",
                output=dict(ctx.progress),
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        # an incident's reason carries its rule's summary: cut, never refused, on this path
        reason = clip_drain_reason(str(ctx.params.get("reason", "")) or "drained by trainguard")
        if ctx.progress.get("phase") == "draining":
            state = self.backend.poll(node, key=ctx.action.idempotency_key, progress=ctx.progress)
            progress = ctx.progress
        else:
            if ctx.incident is not None:
                # the rule that asked for this drain: a correlated decision's drain step
                # carries its own rule (e.g. node_silent), which may act on stale data
                rule = ctx.params.get("rule")
                why = stale_drain_reason(
                    rule=rule if isinstance(rule, str) and rule else ctx.incident.rule,
                    report_age_s=self.ops.report_age_s(node),
                    stale_after_s=self.stale_after_s,
                    exempt_rules=self.stale_exempt_rules,
                )
                if why is not None:
                    return Outcome(message=f"skipped: {why}", skipped=True)
            asked = ctx.params.get("rule")
            state, data = self.backend.drain(
                node,
                reason=reason,
                key=ctx.action.idempotency_key,
                rule=asked if isinstance(asked, str) and asked else None,
                incident_id=ctx.incident.id if ctx.incident is not None else None,
            )
            progress = {**data, "phase": "draining"}
        if state == "drained":
            note = progress.get("note")
            retired = self._retire_lemon(node)
            if retired is None:
                retired = self._follow_up(node, ctx, reason=reason)
            if retired is not None:
                note = f"{note}; {retired}" if note else retired
            return Outcome(
                message=f"{node} drained" + (f" ({note})" if note else ""),
                output={"node": node, "phase": "drained", **({"note": note} if note else {})},
            )
        return Outcome(
            message=f"{node} draining: waiting for its job to stop",
            output=progress,
            done=False,
            poll_after_s=self.poll_interval_s,
        )

    def _follow_up(self, node: str, ctx: ActionContext, *, reason: str) -> str | None:
        """The lifecycle's follow-up of an incident's drain of a node now drained; its note."""
        if self.after_drain is None or ctx.incident is None:
            return None
        if self.ops.node_state(node) != NodeState.DRAINED.value:
            return None  # a lifecycle step (or a retirement) already holds it
        follow = self.after_drain(node, ctx.incident, ctx.action.idempotency_key)
        if follow is None:
            return None
        if follow.keep_out is not None:
            self.ops.set_node_state(
                node,
                NodeState.DRAINED.value,
                reason=clip_drain_reason(f"{reason}; {follow.keep_out}"),
            )
        return follow.note

    def _retire_lemon(self, node: str) -> str | None:
        """Retire a drained lemon (flagged for RMA); the note for the step, or None."""
        why = self.lemon(node) if self.lemon is not None else None
        if why is None or self.ops.node_state(node) != NodeState.DRAINED.value:
            return None
        self.ops.set_node_state(node, NodeState.RETIRED.value, reason=why)
        log.warning("event=lemon_retired node=%s reason=%r", node, why)
        return f"retired, {why}"


@dataclass
class UndrainHandler:
    """The `undrain` step, params {"node"}: back to active (a no-op when already active)."""

    backend: DrainBackend
    kind: str = "undrain"
    remediation: bool = True

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True

    def run(self, ctx: ActionContext) -> Outcome:
        node = str(ctx.params.get("node", ""))
        if not node:
            raise PermanentError("undrain needs a node")
        force = ctx.params.get("force") is True
        self.backend.undrain(node, key=ctx.action.idempotency_key, force=force)
        return Outcome(message=f"{node} back in service", output={"node": node})


__all__ = [
    "DrainBackend",
    "DrainHandler",
    "DrainState",
    "PresenceOf",
    "LocalDrainBackend",
    "NodeOps",
    "RecordingDrainBackend",
    "UndrainHandler",
]
