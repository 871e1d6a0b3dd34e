"""The job steps of a remediation: checkpoint, replace, restart, rollback, stop and
collect_stacks, all over controller.jobs.JobManager and the agents' commands; and grow, which
brings a shrunk job back to its full size.

Every step keeps its progress in its action output (so a controller restart resumes where it
was) and every command id derives from the step's idempotency key or the job attempt, so a
repeated run queues nothing twice; a restart that already began attempt N finds it again in
the job table (`begin_attempt` by key) and never begins N+1.

After a controller restart the steps wait (`_await_unknown`, bounded by jobs.resume_grace_s)
for the nodes they act on to report again rather than read their stored report age. A
restart starts attempt N+1 only when every node of attempt N confirmed its stop or has been
silent past jobs.attempt_lease_s (JobManager.attempt_fence); a node that still runs attempt N
after the stop's grace and timeout fails the step (a person must look), never a start beside.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from trainguard.command_args import CheckpointArgs, CollectStacksArgs, StartJobArgs, StopJobArgs
from trainguard.controller.actionkinds import ActionKind
from trainguard.controller.actions.base import ActionContext, Outcome, PermanentError
from trainguard.controller.actions.inprocess import PROGRESS_KEY as INPROCESS_KEY
from trainguard.controller.actions.inprocess import (
    InProcessRecovery,
    job_module,
    standby_unready,
)
from trainguard.controller.actions.recovery import (
    PhaseObserver,
    ckpt_floor,
    first_step_past,
    recovery_phases,
    restart_baseline,
    restart_confirmed,
    rolled_back_in_process,
)
from trainguard.controller.actions.restartloop import LOOP_KEY, RestartLoop, restart_loop
from trainguard.controller.actions.restartphase import RestartPhase, advance
from trainguard.controller.actions.sparecheck import PROGRESS_KEY, SparePreflight
from trainguard.controller.actions.standbyswap import StandbySwap
from trainguard.controller.ckptspec import checkpoint_env
from trainguard.controller.jobs import RESUME_SKIP_ENV, JobManager, JobSpec, shrink_plan
from trainguard.controller.jobstate import TRANSITIONS, JobState
from trainguard.controller.records import CommandRecord, JobRecord

log = logging.getLogger("trainguard.controller.jobsteps")

# A step waiting for an unknown node looks again this often, s: agents report every second.
_UNKNOWN_POLL_S = 1.0


# a job in one of these ended without the incident's help: a rule's job step skips it
_DONE_BY_ITSELF = frozenset({JobState.COMPLETED.value, JobState.STOPPED.value})


def _no_job(ctx: ActionContext) -> Outcome:
    where = ctx.params.get("node") or ctx.params.get("job") or ctx.action.target
    return Outcome(message=f"skipped: no job runs on {where}", skipped=True)


def _job_of(jobs: JobManager, ctx: ActionContext) -> JobRecord | None:
    """The step's job: the one it already pinned in its progress, else the one an earlier
    step of the plan worked on (the node may have left the job since), else its params."""
    for source in (ctx.progress, *ctx.previous.values()):
        name = source.get("job")
        if isinstance(name, str) and name:
            return jobs.get(name)
    return jobs.resolve(ctx.params)


def _await_unknown(
    jobs: JobManager,
    nodes: Iterable[str],
    *,
    spares: bool = False,
    progress: dict[str, Any],
    poll_after_s: float,
) -> Outcome | None:
    """A not-done Outcome (progress unchanged) while any of `nodes` (with `spares`, the free
    hot spares too) is unknown after a controller restart; None when the step may go on."""
    waiting = jobs.unknown(nodes, spares=spares)
    if not waiting:
        return None
    return Outcome(
        message=f"waiting for {', '.join(waiting)} to report again after the controller"
        f" restart (at most {jobs.config.resume_grace_s:g} s from its start, then silent)",
        output=progress,
        done=False,
        poll_after_s=min(poll_after_s, _UNKNOWN_POLL_S),
    )


def _endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class JobStep:
    """What every job step shares: it is idempotent for its key (its command ids derive from
    the key or the job attempt), and it runs on the step's job, `skipped` when there is none.
    Subclasses implement `run_job`, with `progress` a copy of the step's saved output."""

    jobs: JobManager

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True

    def run(self, ctx: ActionContext) -> Outcome:
        job = _job_of(self.jobs, ctx)
        if job is None:
            return _no_job(ctx)
        if ctx.incident is not None and not ctx.progress and job.state in _DONE_BY_ITSELF:
            # the job ended on its own (or an operator stopped it) while its incident's plan
            # ran: nothing is left to save, replace or restart. A step already under way goes
            # on (its attempt may be the one that completed); an operator's step always runs.
            return Outcome(
                message=f"skipped: job {job.name} is {job.state}"
                f" ({job.state_reason or 'no reason given'}): nothing to"
                f" {getattr(self, 'kind', 'do')}",
                skipped=True,
            )
        return self.run_job(ctx, job, dict(ctx.progress))

    def run_job(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        raise NotImplementedError


@dataclass
class CheckpointHandler(JobStep):
    """`checkpoint`: ask every rank for a checkpoint (request id = the step's key) and wait
    for its commit; fall back to the latest committed step when the sick node is silent, the
    trainer reports the save failed, or the timeout passes. Output {"step", "proactive"}."""

    poll_interval_s: float = 0.5
    kind: str = "checkpoint"
    remediation: bool = True

    def run_job(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        sick = ctx.params.get("node") if isinstance(ctx.params.get("node"), str) else None
        if progress.get("phase") != "waiting":
            wait = _await_unknown(
                self.jobs,
                [*([sick] if sick else []), *job.attempt_nodes],
                progress=progress,
                poll_after_s=self.poll_interval_s,
            )
            if wait is not None:
                return wait
            step, ckpt = self.jobs.latest_steps(job.name)
            progress = {
                "phase": "waiting",
                "job": job.name,
                "request_id": ctx.action.idempotency_key,
                "started_at": ctx.now,
                "last_step": step,
                "prior_ckpt": ckpt,
            }
            if job.state not in (JobState.RUNNING, JobState.STARTING):
                return self._fallback(progress, ctx, why=f"job {job.name} is {job.state}")
            if sick is not None and not self.jobs.reporting(sick):
                return self._fallback(
                    progress,
                    ctx,
                    why=f"{sick} is not reporting (its peers may be stuck in a collective)",
                )
            targets = [n for n in job.attempt_nodes if self.jobs.reporting(n)]
            for node in targets:
                self.jobs.nodes.queue_command(
                    node,
                    CheckpointArgs(job=job.name, request_id=progress["request_id"]),
                    command_id=f"ckpt-{ctx.action.idempotency_key}-{node}",
                )
            return Outcome(
                message=f"checkpoint requested from {len(targets)} node(s) of job {job.name};"
                " waiting for the commit",
                output=progress,
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        request_id = str(progress["request_id"])
        for _, rank in self.jobs.ranks(job.name):
            if rank.ckpt_request_id == request_id and rank.ckpt_step is not None:
                took_s = ctx.now - float(progress["started_at"])
                return Outcome(
                    message=f"checkpoint committed at step {rank.ckpt_step} in {took_s:.1f} s",
                    output={
                        **progress,
                        "phase": "done",
                        "step": rank.ckpt_step,
                        "proactive": True,
                        "finished_at": ctx.now,
                    },
                )
        if self.jobs.checkpoint_failed(job.name, request_id):
            return self._fallback(progress, ctx, why="the trainer reported the checkpoint failed")
        if sick is not None and self.jobs.silent(sick):
            # unknown (a controller restart since the request): wait for it, within the timeout
            return self._fallback(progress, ctx, why=f"{sick} stopped reporting")
        timeout_s = self.jobs.config.checkpoint_timeout_s
        if ctx.now - float(progress["started_at"]) > timeout_s:
            return self._fallback(progress, ctx, why=f"no commit within {timeout_s:g} s")
        return Outcome(
            message=f"checkpoint requested from job {job.name}; waiting for the commit",
            output=progress,
            done=False,
            poll_after_s=self.poll_interval_s,
        )

    def _fallback(self, progress: dict[str, Any], ctx: ActionContext, *, why: str) -> Outcome:
        _, ckpt = self.jobs.latest_steps(str(progress["job"]))
        where = f"step {ckpt}" if ckpt is not None else "none yet (the job starts from scratch)"
        return Outcome(
            message=f"no proactive checkpoint ({why}); latest committed checkpoint: {where}",
            output={
                **progress,
                "phase": "done",
                "step": ckpt,
                "proactive": False,
                "finished_at": ctx.now,
            },
        )


def _noting_fallback(outcome: Outcome, progress: dict[str, Any]) -> Outcome:
    """The restart's first outcome after the in-process path fell back says why (the incident
    timeline keeps it), and so does its last (the step's result)."""
    state = progress.get(INPROCESS_KEY)
    if not isinstance(state, dict):
        return outcome
    # an outcome with an output of its own keeps the path's state too: it is never re-decided
    output = outcome.output
    if output is not progress:
        output = {**output, INPROCESS_KEY: state}
    if state.get("phase") != "fallback" or (state.get("noted") and not outcome.done):
        return replace(outcome, output=output)
    state["noted"] = True
    return replace(
        outcome,
        message=f"in-process recovery fell back to a full restart ({state.get('reason')});"
        f" {outcome.message}",
        output=output,
    )


def gate_spares(
    check: SparePreflight | None,
    spares: list[str],
    *,
    need: int,
    ctx: ActionContext,
    progress: dict[str, Any],
) -> tuple[list[str], str | None]:
    """The spares that may join the job now (a passing preflight, fresh or just run, when
    `check` is given) and, while a spare's preflight still runs, what the step waits for.
    `progress` gains the running preflights."""
    if check is None:
        return spares, None
    gate = check.check(
        spares, need=need, now=ctx.now, key=ctx.action.idempotency_key, progress=progress
    )
    skipped = "".join(f"; skipped {n}: {why}" for n, why in gate.failed.items())
    if gate.waiting:
        return gate.ready, f"waiting for the preflight of spare(s) {', '.join(gate.waiting)}" + (
            skipped
        )
    return gate.ready, None


def swap_or_shrink(
    jobs: JobManager,
    job: JobRecord,
    spec: JobSpec,
    *,
    bad: list[str],
    open_nodes: set[str],
    spares: list[str] | None = None,
) -> tuple[str, dict[str, Any]] | None:
    """Place the job on a node set without `bad`: swap them for hot spares (`spares`, else
    every free one), else shrink when the spec allows (`shrink: pack` keeps the world size,
    `shrink: world` runs fewer ranks); (message, output) or None when neither fits."""
    if spares is None:
        spares = jobs.spares(spec.spare_selector, open_incident_nodes=open_nodes, exclude=job.nodes)
    healthy = [n for n in job.nodes if n not in bad]
    if len(spares) >= len(bad):
        chosen = iter(spares)
        swap = {b: next(chosen) for b in bad}
        nodes = [swap.get(n, n) for n in job.nodes]
        jobs.place(
            job.name,
            nodes=nodes,
            nproc_per_node=job.nproc_per_node,
            assign=list(swap.values()),
            release=bad,
        )
        text = ", ".join(f"{b} -> {s}" for b, s in swap.items())
        return (
            f"replaced {text}; job {job.name} now on {', '.join(nodes)}",
            {"nodes": nodes, "mode": "spare", "replaced": swap},
        )
    world = len(job.nodes) * job.nproc_per_node
    candidates = healthy + spares
    if spec.shrink == "world":
        return _shrink_world(jobs, job, spec, bad=bad, candidates=candidates, spares=spares)
    count = shrink_plan(
        world_size=world,
        healthy=len(candidates),
        min_nodes=spec.floor,
        max_nproc=spec.capacity_per_node,
    )
    if count is None:
        return None
    nodes = candidates[:count]
    nproc = world // count
    used = [s for s in spares if s in nodes]
    dropped = [n for n in job.nodes if n not in nodes]
    jobs.place(job.name, nodes=nodes, nproc_per_node=nproc, assign=used, release=dropped)
    return (
        f"{len(spares)} spare(s) for {len(bad)} unusable node(s) ({', '.join(bad)}):"
        f" shrinking job {job.name} to {count} node(s) x {nproc} process(es),"
        f" world size {world} kept ({', '.join(nodes)})",
        {"nodes": nodes, "mode": "shrink", "nproc_per_node": nproc},
    )


def _shrink_world(
    jobs: JobManager,
    job: JobRecord,
    spec: JobSpec,
    *,
    bad: list[str],
    candidates: list[str],
    spares: list[str],
) -> tuple[str, dict[str, Any]] | None:
    """`shrink: world`: run on every usable node (at least min_nodes) at the spec's processes
    per node, so with fewer ranks; the restart resumes the checkpoint at that world size."""
    if len(candidates) < spec.floor:
        return None
    before = len(job.nodes) * job.nproc_per_node
    after = len(candidates) * spec.nproc_per_node
    dropped = [n for n in job.nodes if n not in candidates]
    used = [s for s in spares if s in candidates]
    jobs.place(
        job.name,
        nodes=candidates,
        nproc_per_node=spec.nproc_per_node,
        assign=used,
        release=dropped,
    )
    log.info(
        "event=job_shrunk job=%s ranks_from=%d ranks_to=%d nodes=%s",
        job.name,
        before,
        after,
        ",".join(candidates),
    )
    return (
        f"{len(spares)} spare(s) for {len(bad)} unusable node(s) ({', '.join(bad)}): job"
        f" {job.name} shrunk from {before} to {after} ranks on {', '.join(candidates)}"
        f" (resumes the checkpoint at world size {after}; grows back to {spec.world_size}"
        " when a spare is free)",
        {"nodes": candidates, "mode": "shrink_world", "ranks_from": before, "ranks_to": after},
    )


@dataclass
class ReplaceHandler(JobStep):
    """`replace`: give the job a healthy node set. Unusable nodes (the incident's node,
    drained, not reporting) are swapped for hot spares; with too few spares the job shrinks
    to fewer nodes when it can keep its world size (min_nodes, max_nproc_per_node), else the
    step waits (bounded) for a spare and then pages (fails). With every node usable, a job
    recovered in process whose rank exited has that node swapped for a spare's warm standby
    (controller.actions.standbyswap)."""

    open_incident_nodes: Callable[[], set[str]]
    poll_interval_s: float = 5.0
    kind: str = "replace"
    remediation: bool = True
    # Given: a spare joins only after a passing preflight (controller.actions.sparecheck)
    spare_check: SparePreflight | None = None
    # Given: a crashed job with recovery.in_process whose rank exited on a healthy node has
    # that node's slot taken by a spare's ready warm standby (the node becomes a spare)
    standby_swap: StandbySwap | None = None

    def run_job(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        wait = _await_unknown(
            self.jobs, job.nodes, spares=True, progress=progress, poll_after_s=self.poll_interval_s
        )
        if wait is not None:
            return wait
        spec = self.jobs.spec(job)
        started_at = float(ctx.progress.get("started_at", ctx.now))
        sick = ctx.params.get("node")
        bad = [n for n in job.nodes if n == sick or not self._usable(n)]
        base = {"job": job.name, "started_at": started_at}
        if not bad:
            if self.standby_swap is not None:
                # a killed rank of an in-process job: a spare's warm standby takes its slot
                swapped = self.standby_swap.run(
                    ctx, job, progress, base=base, open_nodes=self.open_incident_nodes()
                )
                if swapped is not None:
                    return swapped
            return Outcome(
                message=f"job {job.name} needs no replacement: {', '.join(job.nodes)}",
                output={**base, "nodes": list(job.nodes), "mode": "none"},
            )
        if job.state in (JobState.RUNNING, JobState.STARTING, JobState.CRASHED):
            self.jobs.set_state(job.name, JobState.RESTARTING, reason=f"replacing {', '.join(bad)}")
        open_nodes = self.open_incident_nodes()
        if PROGRESS_KEY in progress:
            base[PROGRESS_KEY] = progress[PROGRESS_KEY]
        free = self.jobs.spares(
            spec.spare_selector, open_incident_nodes=open_nodes, exclude=job.nodes
        )
        if spec.recovery.in_process:
            # spares whose warm standby of the job is ready first (by name within each):
            # the restart step heals the job in process with them, a full restart without
            module = job_module(spec)
            free.sort(key=lambda n: standby_unready(self.jobs, n, module=module) is not None)
        spares, checking = gate_spares(
            self.spare_check, free, need=len(bad), ctx=ctx, progress=base
        )
        if checking is not None:
            if "wait_since" in progress:
                base["wait_since"] = progress["wait_since"]
            return Outcome(
                message=checking,
                output=base,
                done=False,
                poll_after_s=min(self.poll_interval_s, _UNKNOWN_POLL_S),
            )
        placed = swap_or_shrink(self.jobs, job, spec, bad=bad, open_nodes=open_nodes, spares=spares)
        if placed is not None:
            message, extra = placed
            return Outcome(message=message, output={**base, **extra})
        world = len(job.nodes) * job.nproc_per_node
        candidates = [n for n in job.nodes if n not in bad] + spares
        why = self._why_no_shrink(spec, job, world=world, available=len(candidates))
        wait_s = (
            spec.spare_wait_s if spec.spare_wait_s is not None else self.jobs.config.spare_wait_s
        )
        waited_since = float(ctx.progress.get("wait_since", ctx.now))
        if ctx.now - waited_since >= wait_s:
            self.jobs.set_state(job.name, JobState.WAITING, reason="no spare; paged")
            raise PermanentError(
                f"no spare for {', '.join(bad)} within {wait_s:g} s and no shrink ({why});"
                " a person must add capacity"
            )
        self.jobs.set_state(job.name, JobState.WAITING, reason=f"no spare for {', '.join(bad)}")
        return Outcome(
            message=(
                f"no spare for {', '.join(bad)} (selector {spec.spare_selector or 'any'}) and no"
                f" shrink ({why}): waiting up to {wait_s:g} s for a spare, then paging"
            ),
            output={**base, "wait_since": waited_since},
            done=False,
            poll_after_s=self.poll_interval_s,
        )

    def _usable(self, node: str) -> bool:
        rec = self.jobs.nodes.node_record(node)
        return rec is not None and rec.state == "active" and self.jobs.reporting(node)

    @staticmethod
    def _why_no_shrink(spec: JobSpec, job: JobRecord, *, world: int, available: int) -> str:
        if spec.min_nodes is None or available < spec.floor or spec.shrink == "world":
            return f"{available} usable node(s), min_nodes {spec.floor}"
        return (
            f"{world} ranks do not fit {available} node(s) at up to"
            f" {spec.capacity_per_node} per node; the trainer resumes only at the same world"
            " size"
        )


@dataclass
class RestartHandler(JobStep):
    """`restart` (and `rollback`): stop the current attempt (grace, bounded wait; a silent
    node is not waited for), start attempt+1 on the job's node set, and succeed once a rank of
    the new attempt reports a step past the checkpoint. Output {first_step, restarted_at}.

    rollback: same nodes, from the newest committed checkpoint (the trainer never commits a
    non-finite one), with the skip window in TRAINGUARD_RESUME_SKIP_BATCHES; skipped when the
    trainer already rolled back in process.

    A rule's restart of a job that crash-loops without checkpoint progress does not restart
    it (controller.actions.restartloop): the verdict is stored first, then the job is held
    and the step fails with the evidence (the incident pages)."""

    observe: PhaseObserver = field(default=lambda phases, lost: None)
    poll_interval_s: float = 0.5
    kind: str = "restart"
    remediation: bool = True
    # Given: unusable nodes found at start are swapped for spares (or the job shrinks);
    # None: the restart fails on them (a replace step must run first).
    open_incident_nodes: Callable[[], set[str]] | None = None
    # False (a grow back to full size): the new attempt is no restart, neither counted nor
    # held to max_restarts
    counts_restart: bool = True
    # Given: a spare swapped in at start joins only after a passing preflight
    spare_check: SparePreflight | None = None
    # Given: a job with recovery.in_process is first recovered in process (survivors rejoin
    # with a spare's warm standby), this restart being its fallback
    in_process: InProcessRecovery | None = None

    def run_job(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        fast = self.in_process
        if (
            fast is not None
            and self.kind == "restart"
            and "stop_sent_at" not in progress
            and LOOP_KEY not in progress
        ):
            # after a controller restart the fast path plans on what the job's nodes report
            # (the survivors' ranks, the spare's standby), unknown until they report to this
            # process: wait for them, as the full restart does (it waits for these and more)
            wait = _await_unknown(
                self.jobs, job.nodes, progress=progress, poll_after_s=self.poll_interval_s
            )
            if wait is not None:
                return wait
            # the fast path first (a job with recovery.in_process); None: the full restart
            outcome = fast.run(ctx, job, progress)
            if outcome is not None:
                return outcome
            refreshed = self.jobs.get(job.name)  # a fallback may have begun an attempt
            if refreshed is not None:
                job = refreshed
            return _noting_fallback(self._run_restart(ctx, job, progress), progress)
        outcome = self._run_restart(ctx, job, progress)
        if INPROCESS_KEY in progress:  # the full restart after a fallback: its result says why
            return _noting_fallback(outcome, progress)
        return outcome

    def _run_restart(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        key = ctx.action.idempotency_key
        loop = progress.get(LOOP_KEY)
        if isinstance(loop, dict):  # the breaker decided (maybe before a controller restart)
            return self._hold(ctx, job, RestartLoop.from_output(loop))
        phase = RestartPhase.stored(progress)
        if job.attempt_key == key and phase is RestartPhase.STOP:
            # this step began its attempt before a controller restart
            phase = advance(phase, RestartPhase.START)
        if phase is RestartPhase.STOP and "stop_sent_at" not in progress:
            wait = _await_unknown(
                self.jobs,
                (*job.attempt_nodes, *job.nodes),
                progress=progress,
                poll_after_s=self.poll_interval_s,
            )
            return wait or self._begin(ctx, job, progress)
        if phase is RestartPhase.STOP:
            fenced = self._fence(ctx, job, progress)
            if fenced is not None:
                self._preflight_early(ctx, job, progress)
                return fenced
            phase = advance(phase, RestartPhase.START)
        if phase is RestartPhase.START:
            return self._start(ctx, job, progress)
        return self._confirm(ctx, job, progress)

    def _preflight_early(
        self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]
    ) -> None:
        """While the old attempt is being stopped, start the preflights of the spares the
        start will swap in (for the nodes unusable now), so they overlap the wait; `progress`
        keeps them and the start finds them."""
        if self.spare_check is None or self.open_incident_nodes is None:
            return
        unusable = self._unusable(job)
        if not unusable or job.attempt_key == ctx.action.idempotency_key:
            return
        spec = self.jobs.spec(job)
        free = self.jobs.spares(
            spec.spare_selector, open_incident_nodes=self.open_incident_nodes(), exclude=job.nodes
        )
        gate_spares(self.spare_check, free, need=len(unusable), ctx=ctx, progress=progress)

    def _fence(
        self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]
    ) -> Outcome | None:
        """One live attempt per job: None once every node of the attempt being stopped
        confirmed its stop or has been silent past the lease (then attempt+1 may start); a
        not-done Outcome while that is pending; PermanentError when a node still runs it
        after stop_grace_s + stop_timeout_s of reporting since the stop. The job's other
        nodes (where the next attempt may run) must have reported since the stop or be
        silent: a node that died just before the restart is then replaced, not started on."""
        attempt = int(progress.get("stop_attempt", job.attempt))
        ran = [*progress.get("stopping", []), *progress.get("stop_nodes", [])]
        fence = self.jobs.attempt_fence(
            job.name,
            attempt=attempt,
            ran=ran,
            others=job.nodes,
            since=float(progress["stop_sent_at"]),
        )
        if fence.clear:
            if fence.lapsed:
                progress["stop_lapsed"] = [n for n in fence.lapsed if n in ran]
            return None
        if fence.overdue:
            limit_s = self.jobs.config.stop_grace_s + self.jobs.config.stop_timeout_s
            where = ", ".join(fence.overdue)
            log.warning(
                "event=attempt_not_stopped job=%s attempt=%d nodes=%s limit_s=%g key=%s",
                job.name,
                attempt,
                ",".join(fence.overdue),
                limit_s,
                ctx.action.idempotency_key,
            )
            self.jobs.set_state(
                job.name,
                JobState.FAILED,
                reason=f"attempt {attempt} did not stop on {where}; not starting another",
            )
            raise PermanentError(
                f"attempt {attempt} of job {job.name} still runs on {where}"
                f" {limit_s:g} s after stop_job (stop_grace_s + stop_timeout_s); not starting"
                f" attempt {attempt + 1} beside it. Stop it on {where} (or power the node off),"
                " then restart the job"
            )
        return Outcome(
            message=f"waiting for {fence.waiting_text()}",
            output=progress,
            done=False,
            poll_after_s=self.poll_interval_s,
        )

    def _begin(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        spec = self.jobs.spec(job)
        first = job.attempt == 0
        if not first and self.counts_restart and job.restarts >= spec.max_restarts:
            self.jobs.set_state(
                job.name, JobState.FAILED, reason=f"max_restarts {spec.max_restarts}"
            )
            raise PermanentError(
                f"job {job.name} reached max_restarts ({spec.max_restarts}); not restarting"
            )
        baseline = restart_baseline(self.jobs, job.name, ctx)
        ckpt = baseline["ckpt_step"]
        if not first and self.counts_restart and ctx.incident is not None:
            loop = restart_loop(
                self.jobs,
                job.name,
                now=ctx.now,
                ckpt_now=ckpt,
                exclude=ctx.action.id,
                last_exit=ctx.incident.summary,
            )
            if loop is not None:
                # the decision is stored before it acts: a controller killed in between
                # finds it (run_job) and holds the job, never decides again
                log.warning(
                    "event=restart_loop job=%s restarts=%d ckpt_step=%s key=%s",
                    job.name,
                    len(loop.restarts),
                    ckpt,
                    ctx.action.idempotency_key,
                )
                return Outcome(
                    message=f"{loop.reason()}: holding job {job.name}",
                    output={"job": job.name, LOOP_KEY: loop.to_output()},
                    done=False,
                    poll_after_s=0.0,
                )
        progress.update(
            phase=RestartPhase.STOP.value, job=job.name, **baseline, stop_sent_at=ctx.now
        )
        if self.kind == "rollback":
            rolled = rolled_back_in_process(self.jobs, job.name, ctx)
            if rolled is not None:
                return rolled
            progress["skip_batches"] = self._skip(spec, ctx, job.name, ckpt)
        if not first:
            why = ctx.params.get("reason")  # an operator's restart has none; a grow's says so
            reason = (
                f"incident {ctx.incident.id}"
                if ctx.incident
                else why
                if isinstance(why, str) and why
                else "operator"
            )
            self.jobs.set_state(job.name, JobState.RESTARTING, reason=f"{self.kind} ({reason})")
        # every node that may run the attempt gets stop_job: a node not reporting now reads
        # it with the response to its next report
        stopping = [
            n
            for n in dict.fromkeys((*job.attempt_nodes, *job.nodes))
            if self.jobs.runs_on(job.name, n)
            or (n in job.attempt_nodes and not self.jobs.reporting(n))
        ]
        for node in stopping:
            self.jobs.nodes.queue_command(
                node,
                StopJobArgs(job=job.name, grace_s=self.jobs.config.stop_grace_s),
                command_id=f"stop-{ctx.action.idempotency_key}-{node}",
            )
        progress["stopping"] = stopping
        progress["stop_nodes"] = list(job.attempt_nodes)
        progress["stop_attempt"] = job.attempt
        if not stopping:  # nothing runs the old attempt: start the next one now
            return self._start(ctx, job, progress)
        return Outcome(
            message=f"stopping attempt {job.attempt} on {', '.join(stopping)}",
            output=progress,
            done=False,
            poll_after_s=self.poll_interval_s,
        )

    def _hold(self, ctx: ActionContext, job: JobRecord, loop: RestartLoop) -> Outcome:
        """The breaker's effect: whatever still runs the job is stopped, the job is held
        with the reason (`describe job` shows it), and the step fails with the evidence, so
        the incident pages every channel. Idempotent: a re-run after a controller restart
        queues the same stop ids and sets the same state."""
        for node in dict.fromkeys((*job.attempt_nodes, *job.nodes)):
            if self.jobs.runs_on(job.name, node):
                self.jobs.nodes.queue_command(
                    node,
                    StopJobArgs(job=job.name, grace_s=self.jobs.config.stop_grace_s),
                    command_id=f"stop-{ctx.action.idempotency_key}-{node}",
                )
        current = self.jobs.get(job.name) or job
        state = JobState.parse(current.state)
        if state is not None and (state is JobState.HELD or JobState.HELD in TRANSITIONS[state]):
            self.jobs.set_state(job.name, JobState.HELD, reason=loop.reason())
        log.warning(
            "event=job_held job=%s restarts=%d key=%s reason=%r",
            job.name,
            len(loop.restarts),
            ctx.action.idempotency_key,
            loop.reason(),
        )
        raise PermanentError(loop.evidence())

    def _unusable(self, job: JobRecord) -> list[str]:
        """Nodes of the job that cannot take part in a new attempt: not reporting, not
        active, or about to be drained (a correlated incident's drain step is pending)."""
        draining = {
            a.params.get("node")
            for a, _ in self.jobs.store.actions.open()
            if a.kind == ActionKind.DRAIN and a.state == "pending"
        }
        return [
            n
            for n in job.nodes
            if not self.jobs.reporting(n)
            or (rec := self.jobs.nodes.node_record(n)) is None
            or rec.state != "active"
            or n in draining
        ]

    def _skip(self, spec: JobSpec, ctx: ActionContext, job: str, ckpt: int | None) -> int:
        if spec.rollback_skip_batches is not None:
            return spec.rollback_skip_batches
        since = ctx.incident.opened_at - 60.0 if ctx.incident else 0.0
        steps = [s for ts, s in self.jobs.nan_steps(job) if ts >= since]
        if not steps or ckpt is None:
            return 0
        return max(0, max(steps) - ckpt)

    def _start(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        wait = _await_unknown(
            self.jobs,
            job.nodes,
            spares=self.open_incident_nodes is not None,
            progress=progress,
            poll_after_s=self.poll_interval_s,
        )
        if wait is not None:
            return wait
        spec = self.jobs.spec(job)
        unusable = self._unusable(job)
        if (
            unusable
            and self.open_incident_nodes is not None
            and job.attempt_key != (ctx.action.idempotency_key)
        ):
            # a node died or is being drained since the plan began (or this restart has no
            # replace step, e.g. rank_silent): restart on healthy nodes, swapping only the
            # unusable ones for spares (or shrinking), instead of failing the restart
            open_nodes = self.open_incident_nodes()
            spares, checking = gate_spares(
                self.spare_check,
                self.jobs.spares(
                    spec.spare_selector, open_incident_nodes=open_nodes, exclude=job.nodes
                ),
                need=len(unusable),
                ctx=ctx,
                progress=progress,
            )
            if checking is not None:
                return Outcome(
                    message=checking,
                    output=progress,
                    done=False,
                    poll_after_s=min(self.poll_interval_s, _UNKNOWN_POLL_S),
                )
            placed = swap_or_shrink(
                self.jobs, job, spec, bad=unusable, open_nodes=open_nodes, spares=spares
            )
            if placed is not None:
                progress["replaced"] = placed[1]
                progress["replaced_message"] = placed[0]
                log.info("event=restart_replaced job=%s %s", job.name, placed[0])
                refreshed = self.jobs.get(job.name)
                assert refreshed is not None
                job = refreshed
                unusable = self._unusable(job)
        if unusable:
            self.jobs.set_state(
                job.name,
                JobState.CRASHED if job.attempt else JobState.PENDING,
                reason=f"cannot start on {', '.join(unusable)}",
            )
            raise PermanentError(
                f"cannot start job {job.name} on {', '.join(unusable)} (drained or not"
                " reporting); a replace step must give it healthy nodes"
            )
        job, began = self.jobs.begin_attempt(
            job.name, key=ctx.action.idempotency_key, counts_restart=self.counts_restart
        )
        nodes = list(job.attempt_nodes)
        assert job.rdzv_port is not None
        endpoint = _endpoint(self.jobs.address(nodes[0]), job.rdzv_port)
        # the checkpoint block's interval and retention; an auto job starts at its newest
        # decided interval (controller.ckptauto sends it to the attempt again once it runs)
        decided = None
        if spec.checkpoint is not None and spec.checkpoint.auto:
            rows = self.jobs.store.actions.recent_of(
                ActionKind.CHECKPOINT_INTERVAL.value, target=job.name
            )
            decided = int(rows[0].params["every_steps"]) if rows else None
        env = {**spec.env, **checkpoint_env(spec.checkpoint, every_steps=decided)}
        if progress.get("skip_batches"):
            env[RESUME_SKIP_ENV] = str(progress["skip_batches"])
        for rank, node in enumerate(nodes):
            try:
                args = StartJobArgs(
                    job=job.name,
                    attempt=job.attempt,
                    command=list(spec.command),
                    nproc_per_node=job.nproc_per_node,
                    nnodes=len(nodes),
                    node_rank=rank,
                    rdzv_endpoint=endpoint,
                    rdzv_id=f"{job.name}-{job.attempt}",
                    env=env,
                    ckpt_dir=spec.ckpt_dir,
                    cwd=spec.cwd,
                    python=spec.python,
                    rdzv_conf=dict(spec.rdzv_conf),
                    # a job recovered in process must outlive its first node's torchrun
                    rdzv_backend="static" if spec.recovery.in_process else "c10d",
                )
            except ValueError as e:  # args the agent would refuse: fail as its refusal does
                self.jobs.set_state(
                    job.name, JobState.CRASHED, reason=f"start_job failed on {node}"
                )
                raise PermanentError(f"start_job on {node} failed: {e}") from None
            self.jobs.nodes.queue_command(
                node, args, command_id=f"start-{job.name}-{job.attempt}-{node}"
            )
        progress.update(
            phase=advance(RestartPhase.START, RestartPhase.CONFIRM).value,
            attempt=job.attempt,
            nodes=nodes,
            started_at=ctx.now,
        )
        progress.setdefault("stop_sent_at", ctx.now)
        lapsed = progress.get("stop_lapsed")
        note = (
            f" ({', '.join(lapsed)} silent past the {self.jobs.config.attempt_lease_s:g} s"
            " lease: fenced, stops the old attempt when it reports again)"
            if lapsed
            else ""
        )
        verb = "started" if began else "already started"
        if progress.get("replaced_message"):
            note += f" ({progress['replaced_message']})"
        return Outcome(
            message=f"attempt {job.attempt} {verb} on {', '.join(nodes)}"
            f" (rendezvous {endpoint}){note}; waiting for a step past checkpoint"
            f" {progress.get('ckpt_step')}",
            output=progress,
            done=False,
            poll_after_s=self.poll_interval_s,
        )

    def _confirm(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        attempt = int(progress["attempt"])
        nodes = list(progress["nodes"])
        for node in nodes:
            cmd = self.jobs.nodes.command_status(f"start-{job.name}-{attempt}-{node}")
            if cmd is not None and cmd.ok is False and "already" not in cmd.result:
                self.jobs.set_state(
                    job.name,
                    JobState.CRASHED,
                    reason=f"start failed: start_job on {node}: {cmd.result[-300:] or 'no detail'}",
                )
                raise PermanentError(f"start_job on {node} failed: {cmd.result or 'no detail'}")
        for x in self.jobs.exits(job.name):
            if x["attempt"] == attempt and x["code"] != 0 and not x["stopped"]:
                # The launch died before training (e.g. on the launch lock, the disk full):
                # the job crashed, never left waiting in starting; job_process_failed opens
                # the incident, with this as its evidence.
                why = (
                    f"attempt {attempt} exited on {x['node']} (code {x['code']},"
                    f" {x['message'] or 'no message'}) before training progressed:"
                    f" {x['tail'][-300:] or 'no output'}"
                )
                current = self.jobs.get(job.name)
                if current is not None and current.state == JobState.STARTING:
                    self.jobs.set_state(job.name, JobState.CRASHED, reason=f"start failed: {why}")
                raise PermanentError(why)
        ckpt = progress.get("ckpt_step")
        floor = ckpt_floor(progress)

        def older_attempt(node: str) -> bool:
            proc = self.jobs.process(job.name, node)
            return proc is not None and proc.attempt != attempt

        first = first_step_past(
            self.jobs.ranks(job.name),
            nodes=nodes,
            floor=floor,
            old_pids=set(progress.get("old_pids", [])),
            stale=older_attempt,
        )
        if first is None:
            timeout_s = self.jobs.config.progress_timeout_s
            if ctx.now - float(progress["started_at"]) > timeout_s:
                self.jobs.set_state(job.name, JobState.CRASHED, reason="no progress after restart")
                raise PermanentError(
                    f"attempt {attempt} showed no step past {floor} within {timeout_s:g} s"
                )
            return Outcome(
                message=f"attempt {attempt} started; waiting for a step past checkpoint {ckpt}",
                output=progress,
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        current = self.jobs.get(job.name)
        if current is not None and current.state != JobState.RUNNING:
            self.jobs.set_state(job.name, JobState.RUNNING)
        phases = self._phases(ctx, progress, now=ctx.now)
        return restart_confirmed(
            ctx,
            progress,
            first=first,
            phases=phases,
            observe=self.observe,
            what=f"attempt {attempt}",
        )

    def _phases(
        self, ctx: ActionContext, progress: dict[str, Any], *, now: float
    ) -> dict[str, float]:
        return recovery_phases(ctx, progress, now=now)


@dataclass
class GrowHandler(JobStep):
    """`grow` (the tick plans it, controller.growplan): bring a job that runs shrunk
    (`shrink: world`) back to its full size on its current nodes plus the free spares the
    plan named (params {"job", "attempt", "spares"}). A proactive checkpoint first (the
    checkpoint step's logic, bounded by checkpoint_timeout_s); only if it commits, the job is
    placed on its nodes plus the spares and restarted from it at full size (the restart
    step's logic). Without a commit, or with a spare taken meanwhile, or the job no longer
    running the planned attempt, the step ends `skipped` and the job runs on as it was. The
    new attempt is no restart: neither counted nor held to max_restarts. Done: a
    `grown back to N ranks` entry on the incident whose step shrank the job.

    With `spare_check`, the spares join only after a passing preflight, before the
    checkpoint (so a grow that cannot happen never stops the job): a failing one is drained
    with the reason and the next free spare (same selector) stands in; too few passing:
    `skipped`. The spares that passed are kept in the output (`spares`, `gated`)."""

    open_incident_nodes: Callable[[], set[str]]
    poll_interval_s: float = 0.5
    kind: str = "grow"
    remediation: bool = True
    # Given: a spare joins only after a passing preflight (controller.actions.sparecheck)
    spare_check: SparePreflight | None = None
    _checkpoint: CheckpointHandler = field(init=False)
    _restart: RestartHandler = field(init=False)

    def __post_init__(self) -> None:
        self._checkpoint = CheckpointHandler(self.jobs, poll_interval_s=self.poll_interval_s)
        self._restart = RestartHandler(
            self.jobs,
            poll_interval_s=self.poll_interval_s,
            kind="grow",
            open_incident_nodes=self.open_incident_nodes,
            counts_restart=False,
        )

    def run_job(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        key = ctx.action.idempotency_key
        spec = self.jobs.spec(job)
        planned = [str(s) for s in ctx.params.get("spares", [])]
        gated = progress.get("gated") is True
        spares = [str(s) for s in progress.get("spares", planned)] if gated else planned
        base: dict[str, Any] = {
            "job": job.name,
            "spares": spares,
            "ranks_from": int(progress.get("ranks_from", len(job.nodes) * job.nproc_per_node)),
            "ranks_to": spec.world_size,
        }
        if gated:
            base["gated"] = True
        ckpt = dict(progress.get("checkpoint", {}))
        # the placement (or the attempt) is already done: a re-run after a controller restart
        placed = job.attempt_key == key or (bool(spares) and set(spares) <= set(job.nodes))
        wait = _await_unknown(
            self.jobs, (*job.nodes, *spares), progress=progress, poll_after_s=self.poll_interval_s
        )
        if wait is not None:
            return wait
        if not placed:
            gating = self.spare_check is not None and not gated
            why = self._not_now(ctx, job, spares, spares_free=not gating)
            if why is not None:
                return Outcome(message=f"skipped: not grown ({why})", output=base, skipped=True)
            if gating:
                checked = self._gate(ctx, job, spec, base=base, progress=progress)
                if checked is not None:
                    return checked
                spares = base["spares"]
            if ckpt.get("phase") != "done":
                step = self._checkpoint.run_job(ctx, job, ckpt)
                ckpt = step.output
                if not step.done:
                    return Outcome(
                        message=f"growing job {job.name} back to {spec.world_size} ranks:"
                        f" {step.message}",
                        output={**base, "checkpoint": ckpt},
                        done=False,
                        poll_after_s=step.poll_after_s,
                    )
                if not ckpt.get("proactive"):
                    return Outcome(
                        message=f"skipped: not grown, the checkpoint did not commit"
                        f" ({step.message}); job {job.name} runs on at"
                        f" {base['ranks_from']} ranks",
                        output={**base, "checkpoint": ckpt},
                        skipped=True,
                    )
            why = self._not_now(ctx, job, spares)
            if why is not None:
                return Outcome(message=f"skipped: not grown ({why})", output=base, skipped=True)
            nodes = [*job.nodes, *(s for s in spares if s not in job.nodes)]
            self.jobs.place(
                job.name, nodes=nodes, nproc_per_node=spec.nproc_per_node, assign=spares, release=[]
            )
            refreshed = self.jobs.get(job.name)
            assert refreshed is not None
            job = refreshed
        restart_progress = dict(progress.get("restart", {}))
        previous = {"checkpoint": ckpt} if ckpt.get("proactive") else {}
        step = self._restart.run_job(
            replace(ctx, progress=restart_progress, previous=previous), job, restart_progress
        )
        output = {**base, "checkpoint": ckpt, "restart": step.output}
        if not step.done:
            return Outcome(
                message=f"growing job {job.name} back to {spec.world_size} ranks: {step.message}",
                output=output,
                done=False,
                poll_after_s=step.poll_after_s,
            )
        current = self.jobs.get(job.name) or job
        ranks = len(current.nodes) * current.nproc_per_node
        text = (
            f"job {job.name} grown back to {ranks} ranks on {', '.join(current.nodes)}"
            f" (from {base['ranks_from']}, checkpoint {ckpt.get('step')})"
        )
        self._note_grown(job.name, key=key, text=text, ranks=ranks, now=ctx.now)
        log.info(
            "event=job_grown job=%s ranks_from=%d ranks_to=%d attempt=%d nodes=%s key=%s",
            job.name,
            base["ranks_from"],
            ranks,
            current.attempt,
            ",".join(current.nodes),
            key,
        )
        return Outcome(message=f"{text}; {step.message}", output=output)

    def _gate(
        self,
        ctx: ActionContext,
        job: JobRecord,
        spec: JobSpec,
        *,
        base: dict[str, Any],
        progress: dict[str, Any],
    ) -> Outcome | None:
        """Put the planned spares (then the other free ones, for any that fail) through the
        preflight gate. None once enough passed (`base` then holds them, gated); else the
        Outcome: waiting for a preflight, or skipped with too few passing."""
        planned: list[str] = list(base["spares"])
        busy = self.open_incident_nodes()
        others = self.jobs.spares(
            spec.spare_selector, open_incident_nodes=busy, exclude=(*job.nodes, *planned)
        )
        free = [n for n in planned if self._free(job, n, busy=busy)]
        checks: dict[str, Any] = {PROGRESS_KEY: progress.get(PROGRESS_KEY, {})}
        ready, checking = gate_spares(
            self.spare_check, [*free, *others], need=len(planned), ctx=ctx, progress=checks
        )
        base[PROGRESS_KEY] = checks[PROGRESS_KEY]
        if checking is not None:
            return Outcome(
                message=f"growing job {job.name} back to {spec.world_size} ranks: {checking}",
                output=base,
                done=False,
                poll_after_s=min(self.poll_interval_s, _UNKNOWN_POLL_S),
            )
        if len(ready) < len(planned):
            failed = [n for n in planned if n not in ready]
            return Outcome(
                message=f"skipped: not grown (spare(s) {', '.join(failed)} failed the preflight"
                f" or were taken, and too few others passed); job {job.name} runs on at"
                f" {base['ranks_from']} ranks",
                output=base,
                skipped=True,
            )
        base.update(spares=ready[: len(planned)], gated=True)
        if ready[: len(planned)] != planned:
            log.info(
                "event=grow_spares_gated job=%s planned=%s spares=%s",
                job.name,
                ",".join(planned),
                ",".join(base["spares"]),
            )
        return None

    def _not_now(
        self, ctx: ActionContext, job: JobRecord, spares: list[str], *, spares_free: bool = True
    ) -> str | None:
        """Why the planned grow cannot go on, or None; with `spares_free` False the spares
        are not looked at (the preflight gate picks among the free ones)."""
        attempt = ctx.params.get("attempt")
        if job.attempt != attempt:
            return f"job {job.name} is at attempt {job.attempt}, the grow was for {attempt}"
        if job.state != JobState.RUNNING:
            return f"job {job.name} is {job.state}"
        if not spares:
            return "no spare named"
        if not spares_free:
            return None
        busy = self.open_incident_nodes()
        for node in spares:
            if not self._free(job, node, busy=busy):
                return f"spare {node} is no longer free"
        return None

    def _free(self, job: JobRecord, node: str, *, busy: set[str]) -> bool:
        """`node` may join the job: a free, healthy spare (or already the job's)."""
        rec = self.jobs.nodes.node_record(node)
        if rec is not None and rec.job == job.name:
            return True
        return not (
            rec is None
            or rec.role != "spare"
            or rec.job
            or not self.jobs.healthy(node, open_incident_nodes=busy)
        )

    def _note_grown(self, job: str, *, key: str, text: str, ranks: int, now: float) -> None:
        """`grown back to N ranks` on the incident that shrank the job (once per grow key)."""
        store = self.jobs.store
        incident_id = store.actions.last_shrink_incident(job)
        if incident_id is None or store.incidents.get(incident_id) is None:
            return
        if any(e.data.get("key") == key for e in store.incidents.timeline(incident_id)):
            return
        store.incidents.add_timeline(
            incident_id,
            ts=now,
            kind="job_grown",
            message=text,
            data={"key": key, "job": job, "ranks": ranks},
        )


@dataclass
class StopHandler(JobStep):
    """`stop`: stop the job on every node (grace), wait until none reports it (bounded). A
    node not reporting gets the stop with the response to its next report; one unknown after
    a controller restart is waited for (bounded by the same limit)."""

    poll_interval_s: float = 0.5
    kind: str = "stop"
    remediation: bool = True

    def run_job(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        if "sent_at" not in progress:
            self.jobs.set_state(
                job.name, JobState.STOPPING, reason=str(ctx.params.get("actor", ""))
            )
            nodes = [
                n
                for n in dict.fromkeys((*job.attempt_nodes, *job.nodes))
                if self.jobs.runs_on(job.name, n)
                or (n in job.attempt_nodes and not self.jobs.reporting(n))
            ]
            for node in nodes:
                self.jobs.nodes.queue_command(
                    node,
                    StopJobArgs(job=job.name, grace_s=self.jobs.config.stop_grace_s),
                    command_id=f"stop-{ctx.action.idempotency_key}-{node}",
                )
            progress = {"sent_at": ctx.now, "nodes": nodes, "job": job.name}
        waiting = [
            n
            for n in progress["nodes"]
            if (self.jobs.reporting(n) and self.jobs.runs_on(job.name, n))
            or self.jobs.presence(n) == "unknown"
        ]
        limit_s = self.jobs.config.stop_grace_s + self.jobs.config.stop_timeout_s
        if waiting and ctx.now - float(progress["sent_at"]) < limit_s:
            return Outcome(
                message=f"stopping job {job.name} on {', '.join(waiting)}",
                output=progress,
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        self.jobs.set_state(job.name, JobState.STOPPED, reason="stopped on request")
        self.jobs.place(
            job.name,
            nodes=job.nodes,
            nproc_per_node=job.nproc_per_node,
            assign=[],
            release=list(job.nodes),
        )
        late = f" ({', '.join(waiting)} did not confirm)" if waiting else ""
        return Outcome(message=f"job {job.name} stopped{late}", output=progress)


def bounded_text(text: str, *, limit_chars: int, where: str = "") -> str:
    """`text` cut to `limit_chars` (the head: rank 0 first, the most recent call first), with a
    marker saying how much was cut and where the whole text is."""
    if len(text) <= limit_chars:
        return text
    cut = len(text) - limit_chars
    tail = f"; the whole dump is in {where}" if where else ""
    return f"{text[:limit_chars]}\n[... {cut} chars cut{tail} ...]"


@dataclass
class CollectStacksHandler(JobStep):
    """`collect_stacks`: ask each reporting node of the job for its ranks' Python stacks and
    keep what comes back in the output and in the step's timeline entry (`stacks`: node ->
    text, bounded per node and in total, cut with a marker); never fails the plan
    (diagnosis only)."""

    poll_interval_s: float = 0.5
    max_chars: int = 8000  # per node
    max_total_chars: int = 64000  # over every node: a timeline entry must stay small
    kind: str = "collect_stacks"
    remediation: bool = True

    def run_job(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome:
        if "sent_at" not in progress:
            nodes = [n for n in job.attempt_nodes if self.jobs.reporting(n)]
            for node in nodes:
                self.jobs.nodes.queue_command(
                    node,
                    CollectStacksArgs(job=job.name),
                    command_id=f"stacks-{ctx.action.idempotency_key}-{node}",
                )
            progress = {"sent_at": ctx.now, "nodes": nodes, "job": job.name}
        done: dict[str, CommandRecord] = {}
        for node in progress["nodes"]:
            cmd = self.jobs.nodes.command_status(f"stacks-{ctx.action.idempotency_key}-{node}")
            if cmd is not None and cmd.done_at is not None:
                done[node] = cmd
        missing = [n for n in progress["nodes"] if n not in done]
        timeout_s = self.jobs.config.stacks_timeout_s
        if missing and ctx.now - float(progress["sent_at"]) < timeout_s:
            return Outcome(
                message=f"collecting stacks from {len(progress['nodes'])} node(s)",
                output=progress,
                done=False,
                poll_after_s=self.poll_interval_s,
            )
        per_node = min(self.max_chars, self.max_total_chars // max(1, len(done)))
        stacks: dict[str, str] = {}
        summary: dict[str, str] = {}
        for node, cmd in done.items():
            text = cmd.data.get("stacks")
            where = cmd.data.get("log_path")
            summary[node] = ("" if cmd.ok else "failed: ") + cmd.result[:500]
            if isinstance(text, str) and text:
                stacks[node] = bounded_text(
                    text,
                    limit_chars=per_node,
                    where=f"{node}:{where}" if isinstance(where, str) else "",
                )
        late = f"; no answer from {', '.join(missing)}" if missing else ""
        got = sum(1 for n in done if n in stacks)
        return Outcome(
            message=f"stacks from {got} of {len(progress['nodes'])} node(s){late}",
            output={**progress, "stacks": stacks, "results": summary},
        )


__all__ = [
    "CheckpointHandler",
    "JobStep",
    "bounded_text",
    "CollectStacksHandler",
    "GrowHandler",
    "ReplaceHandler",
    "RestartHandler",
    "StopHandler",
    "swap_or_shrink",
]
