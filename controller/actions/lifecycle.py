"""The node lifecycle's steps: `validate` (a preflight on the node, then back into service on
a pass, its hardware incidents ended; stays drained with the reason on a fail) and `retire`
(out for good, with the reason).
The automatic steps before a `validate` (diagnose, repair) are controller.actions.repairsteps.

Both are action rows, so a controller killed mid-step resumes them: `validate` keeps its
preflight command's id and start time in its progress, and its command id is derived from the
step's idempotency key, so a re-run finds the same preflight instead of starting another. The
agent answers a `preflight` with a `preflight_result` event; the report path completes the
command with it (ok = passed, the checks in its data), in the transaction that stores the event.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.command_args import PreflightArgs
from trainguard.controller.actions.base import ActionContext, Outcome, PermanentError
from trainguard.controller.actions.drain import DrainBackend, NodeOps
from trainguard.controller.nodestate import NodeState

log = logging.getLogger("trainguard.controller.lifecycle")

_SUMMARY_MAX = 400  # characters of a failed preflight's reason (it becomes the drain reason)


def preflight_summary(checks: Sequence[Any], *, passed: bool) -> str:
    """One line for a preflight result: the failing checks with their detail, or "passed"."""
    failed = [
        c for c in checks if isinstance(c, dict) and not c.get("passed", False) and c.get("name")
    ]
    if passed and not failed:
        names = [str(c.get("name")) for c in checks if isinstance(c, dict) and c.get("name")]
        return "passed" + (f" ({', '.join(names)})" if names else "")
    parts = [f"{c['name']}: {c.get('detail') or 'failed'}" for c in failed]
    text = "failed: " + ("; ".join(parts) if parts else "no check passed")
    return text if len(text) <= _SUMMARY_MAX else text[: _SUMMARY_MAX - 1] + "…"


@dataclass
class ValidateHandler:
    """The `validate` step, params {"node"}: the node goes to `validating`, a `preflight`
    command runs there, and on a pass the drain backend undrains it (active, in the pool its
    role names); on a fail or no answer within `timeout_s` it goes back to `drained` with the
    reason and the step fails. The lifecycle's own validation after a repair (params "root",
    controller.repairplan) also names the `role` the node comes back in, and a fail there is
    a hardware failure: a node `lemon` calls one is retired."""

    backend: DrainBackend
    ops: NodeOps
    preflight: PreflightArgs
    timeout_s: float
    poll_interval_s: float = 1.0
    kind: str = "validate"
    remediation: bool = True
    # Given: (node, role) -> sets the node's role (a repaired node comes back as a spare)
    set_role: Callable[[str, str], None] | None = None
    # Given: node -> the retire reason when it is a lemon (controller.lemons)
    lemon: Callable[[str], str | None] | None = None
    # Given: (node, now) after a pass -> ends the node's hardware incidents and starts its
    # signal windows over (Controller._node_validated); idempotent, as a re-run calls it again
    on_validated: Callable[[str, float], None] | None = None

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True  # the command id is the step's own: a re-run finds the same preflight

    def run(self, ctx: ActionContext) -> Outcome:
        node = str(ctx.params.get("node", ""))
        if not node:
            raise PermanentError("validate needs a node")
        command_id = str(
            ctx.progress.get("command_id") or f"preflight-{ctx.action.idempotency_key}"
        )
        started_at = float(ctx.progress.get("started_at", ctx.now))
        state = NodeState.parse(self.ops.node_state(node) or "")
        if state is None:
            raise PermanentError(f"unknown node {node!r}")
        if "command_id" not in ctx.progress:
            if state not in (NodeState.DRAINED, NodeState.RETIRED, NodeState.VALIDATING):
                raise PermanentError(
                    f"{node} is {state.value}: only a drained or retired node is validated"
                )
            self.ops.set_node_state(node, NodeState.VALIDATING.value, reason="validating")
            self.ops.queue_command(node, self.preflight, command_id=command_id)
            log.info("event=preflight_queued node=%s command=%s", node, command_id)
        progress = {"node": node, "command_id": command_id, "started_at": started_at}
        record = self.ops.command_status(command_id)
        if record is None or record.done_at is None:
            if record is None:  # lost with a restored store: ask again (the agent dedupes)
                self.ops.queue_command(node, self.preflight, command_id=command_id)
            if ctx.now - started_at > self.timeout_s:
                why = f"preflight did not answer within {self.timeout_s:g} s"
                why = self._keep_out(node, state, why, repaired="root" in ctx.params)
                raise PermanentError(f"{node}: {why}")
            return Outcome(
                message=f"{node} validating: waiting for its preflight",
                output=progress,
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        summary = record.result or ("passed" if record.ok else "failed")
        if not record.ok:
            why = f"preflight {summary}" if not summary.startswith("preflight") else summary
            why = self._keep_out(node, state, why, repaired="root" in ctx.params)
            raise PermanentError(f"{node}: {why}")
        if state in (NodeState.VALIDATING, NodeState.DRAINED):
            role = ctx.params.get("role")
            if self.set_role is not None and role in ("spare", "active"):
                self.set_role(node, str(role))
            # drained first, then the backend's undrain: the one way back into service, and
            # under Slurm it resumes the node there too. A re-run after a crash in between
            # finds the node drained and undrains it again (a no-op where done).
            self.ops.set_node_state(node, NodeState.DRAINED.value, reason="preflight passed")
            self.backend.undrain(node, key=ctx.action.idempotency_key)
        if self.on_validated is not None:
            # after the undrain, and again on a re-run: what it ends stays ended
            self.on_validated(node, ctx.now)
        log.info("event=node_validated node=%s command=%s", node, command_id)
        return Outcome(
            message=f"{node} passed its preflight and is back in service",
            output={**progress, "passed": True},
        )

    def _keep_out(self, node: str, state: NodeState, why: str, *, repaired: bool) -> str:
        """Back to drained with the reason; after a repair, a lemon is retired. The reason."""
        if state is NodeState.VALIDATING or self.ops.node_state(node) == "validating":
            self.ops.set_node_state(node, NodeState.DRAINED.value, reason=why)
        log.info("event=node_validation_failed node=%s reason=%r", node, why)
        retired = self.lemon(node) if repaired and self.lemon is not None else None
        if retired is not None and self.ops.node_state(node) == NodeState.DRAINED.value:
            self.ops.set_node_state(node, NodeState.RETIRED.value, reason=retired)
            log.warning("event=lemon_retired node=%s reason=%r", node, retired)
            return f"{why}; retired, {retired}"
        return why


@dataclass
class RetireHandler:
    """The `retire` step, params {"node", "reason"}: the node leaves service for good (an RMA)
    with the reason. A node in service is drained through the backend first (under Slurm it is
    drained there too); a node still running a job is refused: drain it first."""

    backend: DrainBackend
    ops: NodeOps
    kind: str = "retire"
    remediation: bool = True

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True

    def run(self, ctx: ActionContext) -> Outcome:
        node = str(ctx.params.get("node", ""))
        reason = str(ctx.params.get("reason", "")).strip()
        if not node:
            raise PermanentError("retire needs a node")
        if not reason:
            raise PermanentError("retire needs a reason")
        state = NodeState.parse(self.ops.node_state(node) or "")
        if state is None:
            raise PermanentError(f"unknown node {node!r}")
        if state is NodeState.DRAINING:
            raise PermanentError(f"{node} is draining: retire it once it is drained")
        if state is NodeState.ACTIVE:
            job = self.ops.node_job(node)
            if job is not None:
                raise PermanentError(f"{node} runs job {job}: drain it first")
            reached, _ = self.backend.drain(
                node, reason=f"retired: {reason}", key=ctx.action.idempotency_key
            )
            if reached != "drained":
                raise PermanentError(f"{node} did not drain at once ({reached}); drain it first")
        self.ops.set_node_state(node, NodeState.RETIRED.value, reason=f"retired: {reason}")
        log.info("event=node_retired node=%s reason=%r", node, reason)
        return Outcome(message=f"{node} retired: {reason}", output={"node": node})


__all__ = ["RetireHandler", "ValidateHandler", "preflight_summary"]
