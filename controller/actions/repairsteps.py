"""The node lifecycle's automatic steps after a hardware drain (lifecycle.auto_repair):
`diagnose` (a preflight, and the repair it calls for) and `repair` (a GPU reset or a node
reboot through the agent); the `validate` step (controller.actions.lifecycle) ends the run.

Crash safety, as `validate`'s: each step's agent command has an id derived from the step's
idempotency key, and the command is queued before the node's state moves, so a step re-run
after a kill -9 finds its own command (and the state it set) and goes on from there instead
of starting another; the next step's row is added (under a key of its own, which the store
dedupes) after the node moved and before the step ends. A failure leaves the node drained
with the reason (the step fails).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from trainguard.bounds import clip_drain_reason
from trainguard.command_args import PreflightArgs, RepairArgs
from trainguard.controller.actions.base import ActionContext, Outcome, PermanentError
from trainguard.controller.actions.drain import NodeOps
from trainguard.controller.actions.lifecycle import preflight_summary
from trainguard.controller.nodestate import NodeState
from trainguard.controller.records import CommandRecord
from trainguard.controller.repairplan import diagnose

log = logging.getLogger("trainguard.controller.repair")


class RepairPlan(Protocol):
    """What the steps ask of the planner (controller.repairplan.RepairPlanner)."""

    def start_repair(
        self, node: str, *, method: str, gpus: Sequence[int], root: str, why: str
    ) -> str | None: ...

    def start_validation(self, node: str, *, root: str) -> None: ...

    def repair_refused(self, method: str) -> str | None: ...


def _keep_out(ops: NodeOps, node: str, *, held: NodeState, why: str) -> None:
    """Back to drained with the reason, if the step's own state still holds the node."""
    if ops.node_state(node) == held.value:
        ops.set_node_state(node, NodeState.DRAINED.value, reason=clip_drain_reason(why))
    log.info("event=node_kept_out node=%s step=%s reason=%r", node, held.value, why)


def _own_state(ops: NodeOps, node: str) -> NodeState:
    state = NodeState.parse(ops.node_state(node) or "")
    if state is None:
        raise PermanentError(f"unknown node {node!r}")
    return state


@dataclass
class _Step:
    """A diagnosis in progress: its preflight command and when the step began."""

    node: str
    command_id: str
    record: CommandRecord | None
    started_at: float

    def progress(self) -> dict[str, Any]:
        return {"node": self.node, "command_id": self.command_id, "started_at": self.started_at}


@dataclass
class DiagnoseHandler:
    """The `diagnose` step, params {"node", "action", "gpus", "why", "root"}: the node goes to
    `diagnosing`, a preflight runs there, and controller.repairplan.diagnose decides: a repair
    (the node to `repairing`, a `repair` step added), or the node back to `drained` with the
    reason (a check a repair cannot fix, a reboot the policy or its rate limit refuses, no
    answer within `timeout_s`)."""

    ops: NodeOps
    plan: RepairPlan
    preflight: PreflightArgs
    timeout_s: float
    poll_interval_s: float = 1.0
    kind: str = "diagnose"
    remediation: bool = True

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True  # its preflight's id is the step's own: a re-run finds the same one

    def run(self, ctx: ActionContext) -> Outcome:
        node = str(ctx.params.get("node", ""))
        root = str(ctx.params.get("root", ""))
        if not node or not root:
            raise PermanentError("diagnose needs a node and a root key")
        command_id = f"diagnose-{ctx.action.idempotency_key}"
        step = _Step(
            node=node,
            command_id=command_id,
            record=self.ops.command_status(command_id),
            started_at=float(ctx.progress.get("started_at", ctx.now)),
        )
        state = _own_state(self.ops, node)
        if step.record is None:
            # the first run, or a command lost with a restored store (then it is asked again)
            mine = state is NodeState.DIAGNOSING and "command_id" in ctx.progress
            if state is not NodeState.DRAINED and not mine:
                return Outcome(message=f"skipped: {node} is {state.value}", skipped=True)
            self.ops.queue_command(node, self.preflight, command_id=command_id)
            log.info("event=diagnose_queued node=%s command=%s", node, command_id)
        if state is NodeState.DRAINED:
            # queued first, moved second: a re-run after a crash in between finds its command
            why = str(ctx.params.get("why") or "hardware incident")
            self.ops.set_node_state(
                node, NodeState.DIAGNOSING.value, reason=clip_drain_reason(f"diagnosing: {why}")
            )
            state = NodeState.DIAGNOSING
        if step.record is None or step.record.done_at is None:
            if ctx.now - step.started_at > self.timeout_s:
                why = f"diagnosis: preflight did not answer within {self.timeout_s:g} s"
                _keep_out(self.ops, node, held=NodeState.DIAGNOSING, why=why)
                raise PermanentError(f"{node}: {why}")
            return Outcome(
                message=f"{node} diagnosing: waiting for its preflight",
                output=step.progress(),
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        return self._decide(ctx, step, state=state, root=root)

    def _decide(self, ctx: ActionContext, step: _Step, *, state: NodeState, root: str) -> Outcome:
        node = step.node
        assert step.record is not None
        checks = step.record.data.get("checks") if isinstance(step.record.data, dict) else None
        checks = checks if isinstance(checks, list) else []
        summary = preflight_summary(checks, passed=bool(step.record.ok))
        verdict = diagnose(action=str(ctx.params.get("action", "")), checks=checks)
        if verdict.method is None:
            why = f"diagnosis: preflight {summary}; {verdict.why}"
            _keep_out(self.ops, node, held=NodeState.DIAGNOSING, why=why)
            raise PermanentError(f"{node}: {why}")
        gpus = [int(g) for g in ctx.params.get("gpus") or [] if isinstance(g, int)]
        why = str(ctx.params.get("why") or "")
        if state is NodeState.DIAGNOSING:
            # moved first, the row second: the repair step finds the node repairing
            refused = self.plan.repair_refused(verdict.method)
            if refused is None:
                self.ops.set_node_state(
                    node,
                    NodeState.REPAIRING.value,
                    reason=clip_drain_reason(f"repairing: {verdict.method} ({verdict.why})"),
                )
                state = NodeState.REPAIRING
        else:
            refused = None
        if state is not NodeState.REPAIRING:
            if refused is None:
                return Outcome(message=f"skipped: {node} is {state.value}", skipped=True)
        else:  # a re-run finds its row already there (the store ignores the key again)
            refused = self.plan.start_repair(
                node, method=verdict.method, gpus=gpus, root=root, why=why
            )
        if refused is not None:
            text = f"diagnosis: {why + ': ' if why else ''}{refused}"
            _keep_out(self.ops, node, held=state, why=text)
            raise PermanentError(f"{node}: {text}")
        log.info("event=diagnosed node=%s method=%s preflight=%r", node, verdict.method, summary)
        return Outcome(
            message=f"{node} diagnosed: {verdict.method} ({verdict.why}); preflight {summary}",
            output={**step.progress(), "method": verdict.method, "passed": bool(step.record.ok)},
        )


@dataclass
class RepairHandler:
    """The `repair` step, params {"node", "method", "gpus", "root"}: a `repair` command (GPU
    reset or reboot) to the node's agent; done, the node goes to `validating` and a `validate`
    step is added; failed or unanswered within `timeout_s`, the node goes back to `drained`
    with the reason and, where `lemon` says it is one, is retired."""

    ops: NodeOps
    plan: RepairPlan
    timeout_s: float
    lemon: Callable[[str], str | None] | None = None
    poll_interval_s: float = 1.0
    kind: str = "repair"
    remediation: bool = True

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True  # the agent dedupes the command id; a reboot's id is written down first

    def run(self, ctx: ActionContext) -> Outcome:
        node = str(ctx.params.get("node", ""))
        root = str(ctx.params.get("root", ""))
        method = str(ctx.params.get("method", ""))
        gpus = [int(g) for g in ctx.params.get("gpus") or [] if isinstance(g, int)]
        if not node or not root:
            raise PermanentError("repair needs a node and a root key")
        args = RepairArgs(method=method, gpus=gpus)  # raises ValueError on a bad method
        # a repair the agent refused while the drained job's ranks were still stopping is
        # sent again under the next id (each id derives from the key and the try's number)
        tries = int(ctx.progress.get("tries", 0))
        command_id = f"repair-{ctx.action.idempotency_key}" + (f"-{tries}" if tries else "")
        record = self.ops.command_status(command_id)
        state = _own_state(self.ops, node)
        started_at = float(ctx.progress.get("started_at", ctx.now))
        progress = {
            "node": node,
            "command_id": command_id,
            "started_at": started_at,
            "tries": tries,
        }
        if record is None:
            if state is not NodeState.REPAIRING:
                return Outcome(message=f"skipped: {node} is {state.value}", skipped=True)
            self.ops.queue_command(node, args, command_id=command_id)
            log.info("event=repair_queued node=%s method=%s command=%s", node, method, command_id)
        if record is None or record.done_at is None:
            if ctx.now - started_at > self.timeout_s:
                self._failed(node, f"{method} did not answer within {self.timeout_s:g} s")
            return Outcome(
                message=f"{node} repairing: waiting for its {method}",
                output=progress,
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        if not record.ok and record.data.get("jobs") and ctx.now - started_at <= self.timeout_s:
            # refused while a job still runs there: the drain moved the job away and its old
            # attempt is being stopped (the lifecycle starts right after the drain step)
            jobs = ", ".join(str(j) for j in record.data["jobs"])
            log.info("event=repair_waits node=%s jobs=%s command=%s", node, jobs, command_id)
            return Outcome(
                message=f"{node} repairing: waiting for job(s) {jobs} to leave it",
                output={**progress, "tries": tries + 1},
                done=False,
                poll_after_s=max(self.poll_interval_s, 2.0),
            )
        if not record.ok:
            # the agent's message names the method ("gpu_reset failed: GPU 0: ...")
            self._failed(node, record.result or f"{method} failed: no detail")
        if state is NodeState.REPAIRING:
            self.ops.set_node_state(
                node, NodeState.VALIDATING.value, reason=f"validating after {method}"
            )
        elif state is not NodeState.VALIDATING:
            return Outcome(message=f"skipped: {node} is {state.value}", skipped=True)
        self.plan.start_validation(node, root=root)
        log.info("event=node_repaired node=%s method=%s command=%s", node, method, command_id)
        return Outcome(
            message=f"{node} repaired ({record.result or method}); validating",
            output={**progress, "method": method},
        )

    def _failed(self, node: str, why: str) -> None:
        _keep_out(self.ops, node, held=NodeState.REPAIRING, why=f"repair: {why}")
        retired = self.lemon(node) if self.lemon is not None else None
        if retired is not None and self.ops.node_state(node) == NodeState.DRAINED.value:
            self.ops.set_node_state(node, NodeState.RETIRED.value, reason=retired)
            log.warning("event=lemon_retired node=%s reason=%r", node, retired)
            why = f"{why}; retired, {retired}"
        raise PermanentError(f"{node}: repair: {why}")


__all__ = ["DiagnoseHandler", "RepairHandler", "RepairPlan"]
