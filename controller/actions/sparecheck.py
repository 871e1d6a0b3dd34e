"""A spare joins a job only after a passing preflight: the gate the replace, restart and grow
steps (and the Slurm backend's spare pick) put the free hot spares through before they swap
one into a job.

A spare whose last preflight passed within `max_age_s` is taken as it is. Any other is sent a
`preflight` command (its id derives from the step's idempotency key and the node, so a step
re-run after a controller restart finds the same command instead of starting another) and the
step waits for the answer within its progress (`spare_preflights`: node -> command id and
start time). A spare whose preflight fails, or does not answer within `timeout_s`, is drained
with the reason `preflight failed: ...` (out of the pool until `node return` validates it) and
the next spare is tried. A lemon (controller.lemons) is retired from the pool instead, before
any preflight.

So that a swap seldom waits, the tick keeps the free spares' results fresh (`keep_warm`): a
spare without a pass in the last half of `max_age_s` gets a preflight ahead of need (its id
names the node and the half-period, so a restarted controller finds it), a gate that meets one
still running waits for it rather than starting another, and a spare whose warm preflight
fails leaves the pool with the reason at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainguard.command_args import PreflightArgs
from trainguard.controller.actions.drain import NodeOps
from trainguard.controller.config import LifecycleConfig
from trainguard.controller.nodestate import NodeState
from trainguard.controller.records import CommandRecord

log = logging.getLogger("trainguard.controller.sparecheck")

PROGRESS_KEY = "spare_preflights"


@dataclass(frozen=True)
class SpareGate:
    """What the gate found: the spares that may join now (in the order given), whether a
    preflight is still running (the step waits), and the spares it took out of the pool."""

    ready: list[str]
    waiting: list[str]
    failed: dict[str, str] = field(default_factory=dict)


@dataclass
class SparePreflight:
    ops: NodeOps
    preflight: PreflightArgs
    last_preflight: Callable[[str], CommandRecord | None]
    max_age_s: float
    timeout_s: float
    # node -> the retire reason when it is a lemon: a failing spare is retired, not drained
    lemon: Callable[[str], str | None] = lambda node: None
    warm_every_s: float = 15.0  # how often keep_warm looks at the pool (the tick calls it)
    # Given: the scheduler's side of taking a spare out of the pool, (node, reason) (the Slurm
    # backend drains it in Slurm, so Slurm's state mirrored back keeps it out)
    out_of_pool: Callable[[str, str], None] | None = None
    _warmed_at: float = field(default=float("-inf"), init=False)

    def keep_warm(self, spares: list[str], *, now: float) -> list[str]:
        """Queue a preflight for each free spare whose last pass is older than half of
        `max_age_s` (none already queued for this half-period), and take out of the pool a
        spare whose warm preflight failed. Returns the nodes a preflight was queued for."""
        if self.max_age_s <= 0 or now - self._warmed_at < self.warm_every_s:
            return []  # max_age_s 0: every swap runs its own preflight
        self._warmed_at = now
        queued: list[str] = []
        for node in spares:
            if self.lemon(node) is not None:
                continue  # the gate retires it when a job would take it
            if self._fresh_pass(node, now=now, max_age_s=self.max_age_s / 2):
                continue
            command_id = self._warm_id(node, now=now)
            record = self.ops.command_status(command_id)
            if record is None:
                self.ops.queue_command(node, self.preflight, command_id=command_id)
                log.info("event=spare_preflight_queued node=%s command=%s", node, command_id)
                queued.append(node)
            elif record.done_at is not None and not record.ok:
                summary = record.result or "failed"
                reason = summary if summary.startswith("preflight") else f"preflight {summary}"
                self._take_out(node, reason, retire=False)
        return queued

    def _warm_id(self, node: str, *, now: float) -> str:
        return f"preflight-warm-{node}-{int(now // max(1.0, self.max_age_s / 2))}"

    def check(
        self, spares: list[str], *, need: int, now: float, key: str, progress: dict[str, Any]
    ) -> SpareGate:
        """Put up to `need` of `spares` (in order) through the preflight; `progress` is the
        step's saved output and gains the running preflights (the caller saves it)."""
        entries: dict[str, Any] = dict(progress.get(PROGRESS_KEY) or {})
        ready: list[str] = []
        waiting: list[str] = []
        failed: dict[str, str] = {}
        for node in spares:
            if len(ready) + len(waiting) >= need:
                break
            lemon = self.lemon(node)
            if lemon is not None:  # a lemon leaves the pool for good, pass or not
                failed[node] = lemon
                self._take_out(node, lemon, retire=True)
                continue
            entry = entries.get(node)
            if entry is None:
                if self._fresh_pass(node, now=now):
                    ready.append(node)
                    continue
                warm = self.ops.command_status(self._warm_id(node, now=now))
                if warm is not None and warm.done_at is None:  # keep_warm's, still running
                    entry = {"command_id": warm.id, "started_at": now}
                    entries[node] = entry
                else:
                    entry = {"command_id": f"preflight-{key}-{node}", "started_at": now}
                    entries[node] = entry
                    self.ops.queue_command(node, self.preflight, command_id=entry["command_id"])
                    log.info(
                        "event=spare_preflight_queued node=%s command=%s",
                        node,
                        entry["command_id"],
                    )
            verdict = self._verdict(node, entry, now=now)
            if verdict is None:
                waiting.append(node)
            elif verdict == "passed":
                ready.append(node)
            else:
                failed[node] = verdict
                self._take_out(node, verdict, retire=False)
        progress[PROGRESS_KEY] = entries
        return SpareGate(ready=ready, waiting=waiting, failed=failed)

    def _fresh_pass(self, node: str, *, now: float, max_age_s: float | None = None) -> bool:
        last = self.last_preflight(node)
        return (
            last is not None
            and bool(last.ok)
            and last.done_at is not None
            and now - last.done_at <= (self.max_age_s if max_age_s is None else max_age_s)
        )

    def _verdict(self, node: str, entry: dict[str, Any], *, now: float) -> str | None:
        """ "passed", the failure reason, or None while the preflight runs."""
        command_id = str(entry["command_id"])
        record = self.ops.command_status(command_id)
        if record is None or record.done_at is None:
            if record is None:  # lost with a restored store: ask again (the agent dedupes)
                self.ops.queue_command(node, self.preflight, command_id=command_id)
            if now - float(entry["started_at"]) > self.timeout_s:
                return f"preflight failed: no answer within {self.timeout_s:g} s"
            return None
        if record.ok:
            return "passed"
        summary = record.result or "failed"
        return summary if summary.startswith("preflight") else f"preflight {summary}"

    def _take_out(self, node: str, reason: str, *, retire: bool) -> None:
        """Out of the pool: drained with the reason, or retired (a lemon, flagged for RMA)."""
        state = NodeState.parse(self.ops.node_state(node) or "")
        if state is NodeState.ACTIVE:
            if self.out_of_pool is not None:
                self.out_of_pool(node, reason)
            wanted = NodeState.RETIRED if retire else NodeState.DRAINED
            self.ops.set_node_state(node, wanted.value, reason=reason)
        log.warning("event=spare_taken_out node=%s retired=%s reason=%r", node, retire, reason)


def preflight_args(lifecycle: LifecycleConfig) -> PreflightArgs:
    """The preflight the lifecycle config asks for (validation and spares alike)."""
    return PreflightArgs(
        ckpt_dir=lifecycle.preflight_ckpt_dir or None,
        tolerance=lifecycle.preflight_tolerance,
        burn_s=lifecycle.preflight_burn_s,
    )


def spare_preflight(
    lifecycle: LifecycleConfig,
    *,
    ops: NodeOps,
    last_preflight: Callable[[str], CommandRecord | None],
    lemon: Callable[[str], str | None] = lambda node: None,
) -> SparePreflight:
    return SparePreflight(
        lemon=lemon,
        ops=ops,
        preflight=preflight_args(lifecycle),
        last_preflight=last_preflight,
        max_age_s=lifecycle.spare_preflight_max_age_s,
        timeout_s=lifecycle.preflight_timeout_s,
    )


__all__ = ["PROGRESS_KEY", "SpareGate", "SparePreflight", "preflight_args", "spare_preflight"]
