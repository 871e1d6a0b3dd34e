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
not lost either: it stays open until the group has launched the replacement into service.

A replacement's agent registers as a new node (its own instance id in its labels) and joins
the spare pool as every spare does: only after a passing preflight
(controller.actions.sparecheck).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainguard.controller.actionkinds import ActionKind
from trainguard.controller.actions.base import ActionContext, Outcome, PermanentError
from trainguard.controller.actions.drain import NodeOps
from trainguard.controller.backends.aws.asg import AsgClient
from trainguard.controller.backends.config import INSTANCE_ID, REGION
from trainguard.controller.nodestate import NodeState

log = logging.getLogger("trainguard.controller.aws")

INTENT = "intent"  # the group and its members are recorded; the terminate call comes next
TERMINATED = "terminated"  # the instance is terminating or gone: waiting for its replacement


@dataclass
class TerminateInstanceHandler:
    """Params {"node", "instance_id", "region", "reason"}; its progress: phase, group, the
    group's members before (`before`), started_at, terminated_at, and at the end the
    `replacement` instance id."""

    client_for: Callable[[str], AsgClient]  # region -> its Auto Scaling client
    ops: NodeOps
    timeout_s: float  # for the replacement to reach InService after the terminate
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
        return self._await_replacement(ctx, client, progress, node=node, instance_id=instance_id)

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
        self._close(
            node,
            f"replaced: instance {instance_id} terminated in {group}; replacement {replacement}"
            " joins as a spare after its preflight",
        )
        log.info(
            "event=instance_replaced node=%s instance=%s group=%s replacement=%s",
            node,
            instance_id,
            group,
            replacement,
        )
        progress.update(phase="replaced", replacement=replacement)
        return Outcome(
            message=f"{instance_id} ({node}) replaced by {replacement} in {group}",
            output=progress,
        )

    def _close(self, node: str, reason: str) -> None:
        """The old node's record: it stays retired, its reason says what became of it."""
        if self.ops.node_state(node) == NodeState.RETIRED.value:
            self.ops.set_node_state(node, NodeState.RETIRED.value, reason=reason)


__all__ = ["INTENT", "TERMINATED", "TerminateInstanceHandler"]
