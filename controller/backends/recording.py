"""The recording fake scheduler backend (tests): it records every call, keeps node states and
jobs in memory, honours the capabilities it is given (a scheduler-side drain or a local one, a
step it cannot do answers `skipped`), answers a repeated step key with its first outcome, and
returns the outcomes a test configures. It passes the backends' conformance suite
(tests/conformance/backend_suite.py), like every real backend."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from trainguard.controller.actions.base import ActionContext, Outcome, PermanentError
from trainguard.controller.actions.drain import DrainState
from trainguard.controller.backends.base import STEP_CAPABILITY, Capability
from trainguard.controller.views import JobView

# Every job step, no scheduler behaviour: the torchrun-like default.
STEP_CAPABILITIES = frozenset(STEP_CAPABILITY.values())


class RecordingBackend:
    """SchedulerBackend test double. `outcomes`: kind -> the Outcome (or a function of the
    context giving it) a step on a known job returns instead of the fake's own."""

    name = "recording"

    def __init__(
        self,
        *,
        capabilities: Iterable[Capability] = STEP_CAPABILITIES,
        nodes: Iterable[str] = (),
        spares: Iterable[str] = (),
        outcomes: dict[str, Outcome | Callable[[ActionContext], Outcome]] | None = None,
    ) -> None:
        self.capabilities = frozenset(capabilities)
        self.outcomes = dict(outcomes or {})
        self.calls: list[tuple[str, str, dict[str, Any]]] = []  # (method, node/key, params)
        self.node_states: dict[str, str] = {n: "active" for n in (*nodes, *spares)}
        self.spares: list[str] = list(spares)
        self.jobs: dict[str, list[str]] = {}
        self.foreign: dict[str, str] = {}  # node -> the reason of a drain made by others
        self._done: dict[str, Outcome] = {}  # step key -> its finished outcome
        self._lock = threading.RLock()

    # --- arranging the world (tests) -------------------------------------------------------

    def run_job(self, name: str, nodes: Iterable[str]) -> None:
        with self._lock:
            self.jobs[name] = list(nodes)

    def drain_by_others(self, node: str, *, reason: str) -> None:
        """Someone else (an admin, a health check) took the node out of service."""
        with self._lock:
            self.node_states[node] = "drained"
            self.foreign[node] = reason

    def _job_on(self, node: str) -> str | None:
        return next((name for name, nodes in self.jobs.items() if node in nodes), None)

    @property
    def _scheduler_drain(self) -> bool:
        return Capability.SCHEDULER_SIDE_DRAIN in self.capabilities

    # --- nodes -----------------------------------------------------------------------------

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
            self.calls.append(("drain", node, {"reason": reason, "key": key}))
            if node in self.foreign:
                return "drained", {"note": f"already out of service: {self.foreign[node]}"}
            job = self._job_on(node)
            if self._scheduler_drain or job is None:
                self.node_states[node] = "draining" if job is not None else "drained"
                return "drained", {}
            self.node_states[node] = "draining"
            return "draining", {"job": job}

    def poll(self, node: str, *, key: str, progress: dict[str, Any]) -> DrainState:
        with self._lock:
            self.calls.append(("poll", node, {"key": key}))
            if self._scheduler_drain or self.node_states.get(node) != "draining":
                return "drained"
            job = self._job_on(node)  # the local drain stopped the job on the node
            if job is not None:
                self.jobs[job] = [n for n in self.jobs[job] if n != node]
            self.node_states[node] = "drained"
            return "drained"

    def undrain(self, node: str, *, key: str, force: bool = False) -> None:
        with self._lock:
            self.calls.append(("undrain", node, {"key": key, "force": force}))
            if node in self.foreign and self._scheduler_drain and not force:
                raise PermanentError(
                    f"{node} was taken out of service by someone else ({self.foreign[node]})"
                )
            self.foreign.pop(node, None)
            self.node_states[node] = "active"

    def return_to_pool(self, node: str, *, role: str) -> None:
        with self._lock:
            self.calls.append(("return_to_pool", node, {"role": role}))

    # --- jobs ------------------------------------------------------------------------------

    def checkpoint(self, ctx: ActionContext) -> Outcome:
        return self._step("checkpoint", ctx)

    def replace(self, ctx: ActionContext) -> Outcome:
        return self._step("replace", ctx)

    def restart(self, ctx: ActionContext) -> Outcome:
        return self._step("restart", ctx)

    def rollback(self, ctx: ActionContext) -> Outcome:
        return self._step("rollback", ctx)

    def stop(self, ctx: ActionContext) -> Outcome:
        return self._step("stop", ctx)

    def collect_stacks(self, ctx: ActionContext) -> Outcome:
        return self._step("collect_stacks", ctx)

    def grow(self, ctx: ActionContext) -> Outcome:
        return self._step("grow", ctx)

    def _resolve(self, ctx: ActionContext) -> str | None:
        for source in (ctx.progress, *ctx.previous.values(), ctx.params):
            name = source.get("job")
            if isinstance(name, str) and name in self.jobs:
                return name
        node = ctx.params.get("node")
        return self._job_on(node) if isinstance(node, str) else None

    def _step(self, kind: str, ctx: ActionContext) -> Outcome:
        key = ctx.action.idempotency_key
        with self._lock:
            self.calls.append((kind, key, dict(ctx.params)))
            if STEP_CAPABILITY[kind] not in self.capabilities:
                return Outcome(
                    message=f"skipped: {kind} is not supported by the {self.name} backend",
                    skipped=True,
                )
            if key in self._done:
                return self._done[key]
            job = self._resolve(ctx)
            if job is None:
                where = ctx.params.get("node") or ctx.params.get("job") or ctx.action.target
                return Outcome(message=f"skipped: no job runs on {where}", skipped=True)
            configured = self.outcomes.get(kind)
            if configured is None:
                outcome = self._own(kind, ctx, job)
            elif isinstance(configured, Outcome):
                outcome = configured
            else:
                outcome = configured(ctx)
            if outcome.done:
                self._done[key] = outcome
            return outcome

    def _own(self, kind: str, ctx: ActionContext, job: str) -> Outcome:
        nodes = self.jobs[job]
        if kind != "replace":
            return Outcome(message=f"{kind} of job {job}", output={"job": job, "nodes": nodes})
        sick = ctx.params.get("node")
        if sick not in nodes:
            return Outcome(
                message=f"job {job} needs no replacement",
                output={"job": job, "nodes": list(nodes), "mode": "none"},
            )
        free = [s for s in self.spares if self._job_on(s) is None]
        if free:
            self.spares.remove(free[0])
            placed = [free[0] if n == sick else n for n in nodes]
            mode = "spare"
        elif Capability.SHRINK in self.capabilities and len(nodes) > 1:
            placed = [n for n in nodes if n != sick]
            mode = "shrink"
        else:
            return Outcome(
                message=f"no spare for {sick}: waiting",
                output={"job": job},
                done=False,
                poll_after_s=5.0,
            )
        self.jobs[job] = placed
        return Outcome(
            message=f"replaced {sick} in job {job}: {', '.join(placed)}",
            output={"job": job, "nodes": placed, "mode": mode},
        )

    # --- views and lifecycle ---------------------------------------------------------------

    def job_views(self, *, now: float) -> list[JobView]:
        if Capability.EXTERNAL_JOB_VIEWS not in self.capabilities:
            return []
        with self._lock:
            return [
                JobView(
                    name=name,
                    state="running",
                    nodes=tuple(nodes),
                    scheduler=self.name,
                    scheduler_job_id=name,
                )
                for name, nodes in sorted(self.jobs.items())
            ]

    def job_nodes(self, job: str) -> frozenset[str] | None:
        if Capability.EXTERNAL_JOB_VIEWS not in self.capabilities:
            return None
        nodes = self.jobs.get(job)  # one dict read: the report path calls this under its lock
        return frozenset(nodes) if nodes is not None else None

    def start(self) -> None:
        self.calls.append(("start", "", {}))

    def close(self) -> None:
        self.calls.append(("close", "", {}))


__all__ = ["STEP_CAPABILITIES", "RecordingBackend"]
