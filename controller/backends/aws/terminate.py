"""The `terminate_instance` step: a retired node's EC2 instance is terminated through its Auto
Scaling Group (without lowering the desired capacity), the group launches a replacement, and
the old node's record is closed with the reason.

Crash-safe like every action row (the row itself is the intent, written before anything runs),
and the one call that cannot be repeated is guarded by a second record: the step first saves
`phase: intent` with the group and the instances it holds, and only a later run makes the
terminate call, and only while AWS still shows the instance in service. A controller killed
at any point therefore terminates the instance once: before the intent is saved nothing was
called; after it, a run that finds the instance terminating, or gone from its group, takes it
as done (its own call before the crash, or someone else's) and never calls again. The row is
not lost either: it stays open until the replacement has joined.

The replacement's agent registers as a new node, its own instance id in its labels; the step
sends it a preflight (the command id derives from the step's key, so a re-run finds the same
one) and makes it a spare only on a pass, as every spare joins a job only after one
(controller.actions.sparecheck). A failing new node is drained with the reason and the step
fails (it pages).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainguard.command_args import PreflightArgs
from trainguard.controller.actionkinds import ActionKind
from trainguard.controller.actions.base import ActionContext, Outcome, PermanentError
from trainguard.controller.actions.drain import NodeOps
from trainguard.controller.backends.aws.asg import AsgClient
from trainguard.controller.backends.config import INSTANCE_ID, REGION
from trainguard.controller.nodestate import NodeState

log = logging.getLogger("trainguard.controller.aws")

INTENT = "intent"  # the group and its members are recorded; the terminate call comes next
TERMINATED = "terminated"  # the instance is terminating or gone: waiting for its replacement
JOINING = "joining"  # the replacement is in service: waiting for its agent and its preflight


@dataclass
class TerminateInstanceHandler:
    """Params {"node", "instance_id", "region", "reason"}; its progress: phase, group, the
    group's members before (`before`), started_at, terminated_at, the `replacement` instance
    id, and the node its agent registered as (`new_node`) with its preflight's command id."""

    client_for: Callable[[str], AsgClient]  # region -> its Auto Scaling client
    ops: NodeOps
    # the node whose agent reports this instance id (its label), if one does yet
    node_of_instance: Callable[[str], str | None]
    set_role: Callable[[str, str], None]  # (node, role): the passing replacement -> spare
    preflight: PreflightArgs
    timeout_s: float  # from the terminate call to the replacement joining as a spare
    poll_interval_s: float = 10.0
    kind: str = ActionKind.TERMINATE_INSTANCE.value
    remediation: bool = True

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True  # AWS's own view of the instance decides whether the call is still to make

    def run(self, ctx: ActionContext) -> Outcome:
        node, instance_id, region = self._params(ctx.params)
        client = self.client_for(region)
        phase = ctx.progress.get("phase")
        if phase is None:
            return self._record_intent(ctx, client, node=node, instance_id=instance_id)
        progress = dict(ctx.progress)
        if phase == INTENT:
            return self._terminate(ctx, client, progress, node=node, instance_id=instance_id)
        if phase == TERMINATED:
            return self._await_replacement(
                ctx, client, progress, node=node, instance_id=instance_id
            )
        return self._join(ctx, progress, node=node, instance_id=instance_id)

    @staticmethod
    def _params(params: dict[str, Any]) -> tuple[str, str, str]:
        node = str(params.get("node", ""))
        instance_id = str(params.get("instance_id", ""))
        region = str(params.get("region", ""))
        if not node:
            raise PermanentError("terminate_instance needs a node")
        if not INSTANCE_ID.fullmatch(instance_id):
            raise PermanentError(f"{node}: not an EC2 instance id: {instance_id!r}")
        if not REGION.fullmatch(region):
            raise PermanentError(f"{node}: not an AWS region name: {region!r}")
        return node, instance_id, region

    def _still_retired(self, node: str) -> None:
        state = self.ops.node_state(node)
        if state != NodeState.RETIRED.value:
            raise PermanentError(f"{node} is {state} now, not retired: its instance is kept")

    def _record_intent(
        self, ctx: ActionContext, client: AsgClient, *, node: str, instance_id: str
    ) -> Outcome:
        self._still_retired(node)
        found = client.describe_instance(instance_id)
        if found is None:
            raise PermanentError(
                f"{node}: instance {instance_id} is in no Auto Scaling Group; nothing would"
                " replace it (terminate it by hand, or add it to a group)"
            )
        members = client.group_instances(found.group)
        output = {
            "phase": INTENT,
            "node": node,
            "instance_id": instance_id,
            "group": found.group,
            "before": sorted(m.instance_id for m in members),
            "started_at": ctx.now,
        }
        log.info(
            "event=instance_terminate_intent node=%s instance=%s group=%s",
            node,
            instance_id,
            found.group,
        )
        return Outcome(
            message=f"terminating {instance_id} ({node}) in Auto Scaling Group {found.group}",
            output=output,
            done=False,
            poll_after_s=0.0,
        )

    def _terminate(
        self,
        ctx: ActionContext,
        client: AsgClient,
        progress: dict[str, Any],
        *,
        node: str,
        instance_id: str,
    ) -> Outcome:
        found = client.describe_instance(instance_id)
        if found is not None and not found.terminating:
            self._still_retired(node)
            # the one call that must not repeat: the intent above is saved, and a re-run after
            # this call (a crash, a timeout) finds the instance terminating or gone
            client.terminate(instance_id)
            log.warning(
                "event=instance_terminated node=%s instance=%s group=%s",
                node,
                instance_id,
                progress.get("group"),
            )
        else:
            log.info(
                "event=instance_already_terminating node=%s instance=%s",
                node,
                instance_id,
            )
        progress.update(phase=TERMINATED, terminated_at=ctx.now)
        return Outcome(
            message=f"{instance_id} ({node}) terminated; waiting for its replacement",
            output=progress,
            done=False,
            poll_after_s=self.poll_interval_s,
        )

    def _await_replacement(
        self,
        ctx: ActionContext,
        client: AsgClient,
        progress: dict[str, Any],
        *,
        node: str,
        instance_id: str,
    ) -> Outcome:
        group = str(progress["group"])
        before = set(progress.get("before") or ())
        fresh = [
            m
            for m in client.group_instances(group)
            if m.instance_id not in before and m.instance_id != instance_id
        ]
        ready = sorted(m.instance_id for m in fresh if m.in_service)
        if not ready:
            waited_s = ctx.now - float(progress.get("terminated_at", ctx.now))
            if waited_s > self.timeout_s:
                why = (
                    f"replaced: instance {instance_id} terminated in {group}, but no replacement"
                    f" reached service within {self.timeout_s:g} s"
                )
                self._close(node, why)
                raise PermanentError(f"{node}: {why}")
            launching = ", ".join(sorted(m.instance_id for m in fresh)) or "none yet"
            return Outcome(
                message=f"{instance_id} ({node}) terminated; replacement launching: {launching}",
                output=progress,
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        replacement = ready[0]
        log.info(
            "event=instance_replacement_in_service node=%s instance=%s group=%s replacement=%s",
            node,
            instance_id,
            group,
            replacement,
        )
        progress.update(phase=JOINING, replacement=replacement)
        return Outcome(
            message=f"{instance_id} ({node}) replaced by {replacement}: waiting for its agent",
            output=progress,
            done=False,
            poll_after_s=self.poll_interval_s,
        )

    def _join(
        self, ctx: ActionContext, progress: dict[str, Any], *, node: str, instance_id: str
    ) -> Outcome:
        """The replacement's agent registers, passes a preflight and becomes a spare."""
        replacement = str(progress["replacement"])
        new_node = progress.get("new_node") or self.node_of_instance(replacement)
        waited_s = ctx.now - float(progress.get("terminated_at", ctx.now))
        if new_node is None:
            if waited_s > self.timeout_s:
                why = (
                    f"replaced: instance {instance_id} terminated; no agent registered from its"
                    f" replacement {replacement} within {self.timeout_s:g} s"
                )
                self._close(node, why)
                raise PermanentError(f"{node}: {why}")
            return Outcome(
                message=f"replacement {replacement} in service: waiting for its agent",
                output=progress,
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        if new_node == node:  # the new instance took the old node name: the lifecycle's own way
            self._close(
                node,
                f"replaced: instance {instance_id} terminated; {replacement} came"
                " back under this name: `agentctl node return` validates it",
            )
            progress.update(phase="joined", new_node=node)
            return Outcome(
                message=f"{replacement} registered as {node} (retired): validate it with"
                " `agentctl node return`",
                output=progress,
            )
        command_id = str(progress.get("command_id") or f"preflight-{ctx.action.idempotency_key}")
        if "command_id" not in progress:
            self.ops.queue_command(new_node, self.preflight, command_id=command_id)
            log.info("event=preflight_queued node=%s command=%s", new_node, command_id)
            progress.update(new_node=new_node, command_id=command_id)
        record = self.ops.command_status(command_id)
        if record is None or record.done_at is None:
            if record is None:  # lost with a restored store: ask again (the agent dedupes)
                self.ops.queue_command(new_node, self.preflight, command_id=command_id)
            if waited_s > self.timeout_s:
                why = f"preflight did not answer within {self.timeout_s:g} s"
                self._keep_out(new_node, why)
                raise PermanentError(f"{new_node} (replacing {node}): {why}")
            return Outcome(
                message=f"{new_node} ({replacement}) registered: waiting for its preflight",
                output=progress,
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        summary = record.result or ("passed" if record.ok else "failed")
        if not record.ok:
            why = summary if summary.startswith("preflight") else f"preflight {summary}"
            self._keep_out(new_node, why)
            self._close(node, f"replaced: instance {instance_id} terminated; {new_node} {why}")
            raise PermanentError(f"{new_node} (replacing {node}): {why}")
        self.set_role(new_node, "spare")
        self._close(
            node,
            f"replaced: instance {instance_id} terminated in {progress['group']}; {new_node}"
            f" ({replacement}) joined as a spare after a passing preflight",
        )
        log.info(
            "event=instance_replaced node=%s instance=%s new_node=%s replacement=%s",
            node,
            instance_id,
            new_node,
            replacement,
        )
        progress.update(phase="joined")
        return Outcome(
            message=f"{node} ({instance_id}) replaced by {new_node} ({replacement}), a spare",
            output=progress,
        )

    def _keep_out(self, node: str, why: str) -> None:
        """A failing replacement leaves service with the reason (`node return` brings it)."""
        if self.ops.node_state(node) == NodeState.ACTIVE.value:
            self.ops.set_node_state(node, NodeState.DRAINED.value, reason=why)
        log.warning("event=replacement_failed_preflight node=%s reason=%r", node, why)

    def _close(self, node: str, reason: str) -> None:
        """The old node's record: it stays retired, its reason says what became of it."""
        if self.ops.node_state(node) == NodeState.RETIRED.value:
            self.ops.set_node_state(node, NodeState.RETIRED.value, reason=reason)


__all__ = ["INTENT", "JOINING", "TERMINATED", "TerminateInstanceHandler"]
