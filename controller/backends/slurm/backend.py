"""The Slurm backend: Slurm runs the jobs, trainguard remediates them through Slurm.

- Nodes: an agent's node name is the Slurm NodeName (`node_names` maps where they differ).
  drain = `scontrol update nodename=X state=drain reason="trainguard: <rule> incident <id>"`
  (DOWN for a node whose agent is silent: a dead node cannot end its job steps); undrain =
  `state=resume`, only for a drain trainguard made (its reason starts "trainguard:") unless
  forced. A sync (every `sync_interval_s`) mirrors Slurm's drain/down states and reasons into
  trainguard's node table, so drains made by others (admin, NHC) show with their reason, and
  the spare reservation's nodes show as spares.
- Jobs: learned from the trainer heartbeats (the trainer names a Slurm job `slurm-<id>`; a
  job named otherwise is matched to `squeue --json` by name and nodes). The proactive
  checkpoint and stack dumps go through the agents exactly as for torchrun jobs.
- Spares: the nodes of a reservation general work cannot use (`spare_reservation`). replace =
  take a spare out of the reservation for the job; a node the lifecycle repairs comes back
  into it as a spare (return_to_pool, the reservation created again when it had gone);
  restart = `scontrol requeuehold`, wait until Slurm no longer runs the job anywhere (so the
  drained node is out of it), pin the job to the new node set (`nodelist=`), `release` and
  `starttime=now` (a requeued job would otherwise wait cred_expire), then wait for a step
  past the checkpoint. A rule's restart of
  a job that crash-loops without checkpoint progress (controller.actions.restartloop) leaves
  it held (`requeuehold` / `hold`) with the reason in its comment instead, never released.

Every Slurm call is an argument list with a timeout (controller.backends.slurm.cli); a failed
one fails the step with Slurm's own message (transient: retried, then paged; .failures).
This class is the SchedulerBackend over its parts: what is known of Slurm and the names on
both sides (.mirror: SlurmMirror, with the sync thread), where a job may run next (.spares:
SlurmSpares), and the restart's requeue/release/confirm phases (.requeue: SlurmRequeue).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from trainguard.clock import Clock
from trainguard.controller.actions.base import ActionContext, Outcome, PermanentError
from trainguard.controller.actions.drain import DrainState
from trainguard.controller.actions.jobsteps import CheckpointHandler, CollectStacksHandler
from trainguard.controller.actions.recovery import PhaseObserver, rolled_back_in_process
from trainguard.controller.actions.restartloop import LOOP_KEY, RestartLoop, restart_loop
from trainguard.controller.actions.sparecheck import PROGRESS_KEY, SparePreflight
from trainguard.controller.backends.base import BackendDeps, Capability
from trainguard.controller.backends.config import SlurmBackendConfig
from trainguard.controller.backends.slurm.cli import SlurmCli, SlurmCommands, SlurmJob
from trainguard.controller.backends.slurm.failures import as_step_error
from trainguard.controller.backends.slurm.mirror import (
    REASON_PREFIX,
    SlurmMirror,
    node_state_of,
    trainguard_reason,
)
from trainguard.controller.backends.slurm.requeue import POLL_S, SlurmRequeue
from trainguard.controller.backends.slurm.spares import SlurmSpares
from trainguard.controller.jobs import JobManager
from trainguard.controller.livestate import LiveState
from trainguard.controller.records import JobRecord
from trainguard.controller.views import JobView

log = logging.getLogger("trainguard.controller.slurm")

# The most characters of the comment trainguard writes on a job it held.
_COMMENT_MAX = 500


class SlurmBackend:
    """SchedulerBackend over Slurm's client commands."""

    name = "slurm"
    capabilities = frozenset(
        {
            Capability.CHECKPOINT,
            Capability.REPLACE,
            Capability.RESTART,
            Capability.ROLLBACK,
            Capability.STOP,
            Capability.COLLECT_STACKS,
            Capability.REQUEUE,
            Capability.SCHEDULER_SIDE_DRAIN,
            Capability.EXTERNAL_JOB_VIEWS,
        }
    )

    def __init__(
        self,
        *,
        config: SlurmBackendConfig,
        commands: SlurmCommands,
        live: LiveState,
        jobs: JobManager,
        clock: Clock,
        node_silent_after_s: float,
        spare_wait_s: float,
        progress_timeout_s: float,
        open_incident_nodes: Callable[[], set[str]],
        observe: PhaseObserver,
        spare_check: SparePreflight | None = None,
    ) -> None:
        self.config = config
        self.commands = commands
        self._live = live
        self._jobs = jobs
        self._clock = clock
        self._spare_wait_s = spare_wait_s
        self.mirror = SlurmMirror(config=config, commands=commands, live=live)
        self.spares = SlurmSpares(
            mirror=self.mirror,
            live=live,
            node_silent_after_s=node_silent_after_s,
            open_incident_nodes=open_incident_nodes,
            spare_check=spare_check,
        )
        self._requeue = SlurmRequeue(
            mirror=self.mirror,
            spares=self.spares,
            jobs=jobs,
            progress_timeout_s=progress_timeout_s,
            observe=observe,
        )
        self._checkpoint = CheckpointHandler(jobs)
        self._stacks = CollectStacksHandler(jobs)

    # --- reading Slurm, lifecycle -----------------------------------------------------------

    def refresh(self) -> None:
        """Read Slurm now and mirror it (SlurmMirror.refresh). Raises SlurmError."""
        self.mirror.refresh()

    def start(self) -> None:
        self.mirror.start()

    def close(self) -> None:
        self.mirror.close()

    # --- nodes ------------------------------------------------------------------------------

    def drain(
        self,
        node: str,
        *,
        reason: str,
        key: str,
        rule: str | None = None,
        incident_id: int | None = None,
    ) -> tuple[DrainState, dict[str, Any]]:
        sname = self.mirror.slurm_name(node)
        text = trainguard_reason(reason=reason, rule=rule, incident_id=incident_id)
        with self.mirror.lock:
            self.mirror.fresh()
            current = self.mirror.node(sname)
            if (
                current is not None
                and (current.drain or current.down)
                and not current.reason.startswith(REASON_PREFIX)
            ):
                # drained by someone else: leave their reason (and their undrain) alone
                _, why = node_state_of(current)
                return "drained", {"note": f"already out of service in Slurm: {why}"}
            down = self.config.down_silent_nodes and self.spares.silent(node)
            with as_step_error(f"draining {node} in Slurm"):
                self.commands.drain(sname, reason=text, down=down)
                self.mirror.refresh()
            now_node = self.mirror.node(sname)
        busy = now_node is not None and now_node.busy
        verb = "DOWN (its agent is silent)" if down else "DRAIN"
        note = f"Slurm {verb}, reason {text!r}"
        if busy:
            note += "; Slurm still runs a job there until it is requeued"
        log.info(
            "event=slurm_drain node=%s slurm_node=%s down=%s reason=%r", node, sname, down, text
        )
        return "drained", {"note": note, "slurm_node": sname, "reason": text}

    def poll(self, node: str, *, key: str, progress: dict[str, Any]) -> DrainState:
        return "drained"  # drain() completes at once: Slurm takes no new work there

    def undrain(self, node: str, *, key: str, force: bool = False) -> None:
        sname = self.mirror.slurm_name(node)
        with self.mirror.lock:
            self.mirror.fresh()
            current = self.mirror.node(sname)
            if current is not None and not (current.drain or current.down):
                self._live.set_node_state(node, "active", reason=None)
                return
            if current is not None and not current.reason.startswith(REASON_PREFIX) and not force:
                _, why = node_state_of(current)
                raise PermanentError(
                    f"{node} was taken out of service in Slurm by someone else ({why});"
                    " trainguard undoes only its own drains (undrain with force to override)"
                )
            with as_step_error(f"resuming {node} in Slurm"):
                self.commands.resume(sname)
                self.mirror.refresh()
        log.info("event=slurm_resume node=%s slurm_node=%s force=%s", node, sname, force)

    def return_to_pool(self, node: str, *, role: str) -> None:
        self.spares.put_in_pool(node, role=role)

    # --- jobs -------------------------------------------------------------------------------

    def _resolve(self, ctx: ActionContext) -> str | None:
        """The Slurm job id a step works on: pinned by this step or an earlier one of the
        plan, else the params' job, else the job Slurm runs on the params' node, else the
        job the node's ranks report."""
        sources = (ctx.progress, *ctx.previous.values())
        for src in sources:
            jid = src.get("slurm_job_id")
            if isinstance(jid, str) and jid:
                return jid
        for src in (*sources, ctx.params):
            name = src.get("job")
            if isinstance(name, str) and name and (jid := self.mirror.job_id(name)) is not None:
                return jid
        node = ctx.params.get("node")
        if not isinstance(node, str) or not node:
            return None
        found = self.mirror.active_job_on(self.mirror.slurm_name(node))
        if found is not None:
            return found
        name = self._live.node_job(node)
        return self.mirror.job_id(name) if name else None

    def _record(self, job_id: str) -> JobRecord:
        """The Slurm job as a job-table record, for the step handlers shared with torchrun."""
        job = self.mirror.job(job_id)
        name = self.mirror.job_name(job_id)
        nodes = tuple(self.mirror.agent_nodes(job))
        state = "running" if job.state == "RUNNING" else job.state.lower()
        return JobRecord(
            name=name,
            spec={},
            state=state,
            nodes=nodes,
            attempt=job.restart_cnt,
            nproc_per_node=1,
            min_nodes=len(nodes),
            restarts=job.restart_cnt,
            created_at=0.0,
            updated_at=0.0,
            attempt_nodes=nodes,
        )

    def _with_id(self, outcome: Outcome, job_id: str) -> Outcome:
        return Outcome(
            message=f"Slurm job {job_id}: {outcome.message}",
            output={**outcome.output, "slurm_job_id": job_id} if outcome.output else {},
            done=outcome.done,
            poll_after_s=outcome.poll_after_s,
            skipped=outcome.skipped,
        )

    def _no_job(self, ctx: ActionContext) -> Outcome:
        where = ctx.params.get("node") or ctx.params.get("job") or ctx.action.target
        return Outcome(message=f"skipped: no Slurm job runs on {where}", skipped=True)

    def checkpoint(self, ctx: ActionContext) -> Outcome:
        self.mirror.fresh()
        job_id = self._resolve(ctx)
        if job_id is None:
            return self._no_job(ctx)
        self.mirror.mark_acted(job_id)
        record = self._record(job_id)
        return self._with_id(self._checkpoint.run_job(ctx, record, dict(ctx.progress)), job_id)

    def grow(self, ctx: ActionContext) -> Outcome:
        # no Capability.GROW: the controller plans no grow and its grow step answers skipped
        # before it asks here; a direct call says the same
        return Outcome(
            message="skipped: growing a shrunk job back is not supported by the Slurm backend",
            skipped=True,
        )

    def collect_stacks(self, ctx: ActionContext) -> Outcome:
        self.mirror.fresh()
        job_id = self._resolve(ctx)
        if job_id is None:
            return self._no_job(ctx)
        record = self._record(job_id)
        return self._with_id(self._stacks.run_job(ctx, record, dict(ctx.progress)), job_id)

    def replace(self, ctx: ActionContext) -> Outcome:
        if "nodes" in ctx.progress and "slurm_job_id" in ctx.progress:
            return Outcome(message="already replaced", output=dict(ctx.progress))
        self.mirror.fresh()
        job_id = self._resolve(ctx)
        if job_id is None:
            return self._no_job(ctx)
        self.mirror.mark_acted(job_id)
        job = self.mirror.job(job_id)
        started_at = float(ctx.progress.get("started_at", ctx.now))
        base = {
            "job": self.mirror.job_name(job_id),
            "slurm_job_id": job_id,
            "started_at": started_at,
        }
        nodes = self.spares.job_nodes(job)
        sick = ctx.params.get("node") if isinstance(ctx.params.get("node"), str) else None
        bad = self.spares.bad(nodes, sick)
        if not bad:
            return Outcome(
                message=f"Slurm job {job_id} needs no replacement: {', '.join(nodes)}",
                output={**base, "nodes": nodes, "mode": "none"},
            )
        if PROGRESS_KEY in ctx.progress:
            base[PROGRESS_KEY] = ctx.progress[PROGRESS_KEY]
        spares, checking = self.spares.pick(ctx, base, exclude=set(nodes), need=len(bad))
        if checking is not None:
            if "wait_since" in ctx.progress:
                base["wait_since"] = ctx.progress["wait_since"]
            return Outcome(
                message=f"Slurm job {job_id}: {checking}",
                output=base,
                done=False,
                poll_after_s=POLL_S,
            )
        swap = self.spares.take(job, bad=bad, nodes=nodes, spares=spares)
        if swap:
            placed = [swap.get(n, n) for n in nodes]
            text = ", ".join(f"{b} -> {s}" for b, s in swap.items())
            return Outcome(
                message=f"Slurm job {job_id}: replaced {text} (out of reservation"
                f" {self.config.spare_reservation}); next run on {', '.join(placed)}",
                output={**base, "nodes": placed, "mode": "spare", "replaced": swap},
            )
        waited_since = float(ctx.progress.get("wait_since", ctx.now))
        if ctx.now - waited_since >= self._spare_wait_s:
            raise PermanentError(
                f"no spare in reservation {self.config.spare_reservation} for"
                f" {', '.join(bad)} within {self._spare_wait_s:g} s; a person must add capacity"
            )
        return Outcome(
            message=f"no usable spare in reservation {self.config.spare_reservation} for"
            f" {', '.join(bad)}: waiting up to {self._spare_wait_s:g} s, then paging",
            output={**base, "wait_since": waited_since},
            done=False,
            poll_after_s=5.0,
        )

    def restart(self, ctx: ActionContext) -> Outcome:
        return self._restart(ctx, same_nodes=False)

    def rollback(self, ctx: ActionContext) -> Outcome:
        if "phase" not in ctx.progress:
            rolled = rolled_back_in_process(self._jobs, str(ctx.params.get("job", "")), ctx)
            if rolled is not None:
                return rolled
        return self._restart(ctx, same_nodes=True)

    def _restart(self, ctx: ActionContext, *, same_nodes: bool) -> Outcome:
        """One phase of the restart (SlurmRequeue), by the phase its progress holds; or,
        once the restart-loop breaker decided, the job left held."""
        progress = dict(ctx.progress)
        phase = progress.get("phase")
        self.mirror.fresh()
        loop = progress.get(LOOP_KEY)
        if isinstance(loop, dict):  # decided (maybe before a controller restart)
            return self._hold(ctx, progress, RestartLoop.from_output(loop))
        if phase is None:
            job_id = self._resolve(ctx)
            if job_id is None:
                return self._no_job(ctx)
            self.mirror.mark_acted(job_id)
            job = self.mirror.job(job_id)
            name = self.mirror.job_name(job_id)
            if ctx.incident is not None:  # an operator's restart is never held
                found = restart_loop(
                    self._jobs,
                    name,
                    now=ctx.now,
                    ckpt_now=self._jobs.latest_steps(name)[1],
                    exclude=ctx.action.id,
                    last_exit=ctx.incident.summary,
                )
                if found is not None:
                    # stored before it acts: a controller killed in between holds it once
                    log.warning(
                        "event=restart_loop job=%s slurm_job=%s restarts=%d",
                        name,
                        job_id,
                        len(found.restarts),
                    )
                    return Outcome(
                        message=f"Slurm job {job_id}: {found.reason()}: holding it",
                        output={
                            "job": name,
                            "slurm_job_id": job_id,
                            "decided_at": ctx.now,
                            LOOP_KEY: found.to_output(),
                        },
                        done=False,
                        poll_after_s=0.0,
                    )
            return self._requeue.requeue(ctx, progress, job=job, same_nodes=same_nodes)
        job = self.mirror.job(str(progress["slurm_job_id"]))
        if phase == "requeued":
            return self._requeue.release(ctx, job, progress)
        return self._requeue.confirm(ctx, job, progress)

    def _hold(self, ctx: ActionContext, progress: dict[str, Any], loop: RestartLoop) -> Outcome:
        """The breaker's effect under Slurm: the job is left held (`requeuehold` stops a
        running or finished one and holds it; `hold` a pending one) with the reason in its
        comment, never released; then the step fails with the evidence (the incident pages).
        Idempotent: a held job is not held again, the comment is the same."""
        job_id = str(progress["slurm_job_id"])
        comment = f"{REASON_PREFIX} {loop.reason()}"[:_COMMENT_MAX]
        try:
            job = self.mirror.job(job_id)
            if job.state == "COMPLETING":  # Slurm is ending it: hold it once it is pending
                waited_s = ctx.now - float(progress.get("decided_at", ctx.now))
                if waited_s <= self.config.requeue_timeout_s:
                    return Outcome(
                        message=f"Slurm job {job_id} completing; holding it once it is pending",
                        output=progress,
                        done=False,
                        poll_after_s=POLL_S,
                    )
            with as_step_error(f"holding Slurm job {job_id}"):
                if job.state == "PENDING":
                    if not job.held:
                        self.commands.hold(job_id)
                elif job.state != "COMPLETING":
                    self.commands.requeue_hold(job_id)
                self.commands.set_comment(job_id, comment)
                self.mirror.refresh()
        except PermanentError as e:
            raise PermanentError(f"{loop.evidence()}\n(holding Slurm job {job_id}: {e})") from None
        log.warning(
            "event=slurm_job_held job=%s slurm_job=%s reason=%r", loop.job, job_id, loop.reason()
        )
        raise PermanentError(
            f"{loop.evidence()}\nSlurm job {job_id} is left held (comment {comment!r});"
            f" `scontrol release {job_id}` lets Slurm run it again"
        )

    def stop(self, ctx: ActionContext) -> Outcome:
        self.mirror.fresh()
        job_id = self._resolve(ctx)
        if job_id is None:
            return self._no_job(ctx)
        job = self.mirror.job(job_id)
        if "sent_at" not in ctx.progress:
            with as_step_error(f"cancelling Slurm job {job_id}"):
                self.commands.cancel(job_id)
            progress = {
                "sent_at": ctx.now,
                "slurm_job_id": job_id,
                "job": self.mirror.job_name(job_id),
            }
        else:
            progress = dict(ctx.progress)
        if job.finished or (job.state == "PENDING" and "sent_at" in ctx.progress):
            return Outcome(message=f"Slurm job {job_id} {job.state.lower()}", output=progress)
        return Outcome(
            message=f"cancelling Slurm job {job_id} ({job.state.lower()})",
            output=progress,
            done=False,
            poll_after_s=POLL_S,
        )

    # --- views ------------------------------------------------------------------------------

    def job_nodes(self, job: str) -> frozenset[str] | None:
        return self.mirror.job_nodes(job)

    def job_views(self, *, now: float) -> list[JobView]:
        views = []
        for job in self.mirror.shown_jobs():
            name = self.mirror.job_name(job.id)
            step, ckpt = self._jobs.latest_steps(name)
            ranks = self._jobs.ranks(name)
            views.append(
                JobView(
                    name=name,
                    state=job.state.lower(),
                    nodes=tuple(self.spares.job_nodes(job)),
                    attempt=job.restart_cnt,
                    last_step=step,
                    ckpt_step=ckpt,
                    restarts=job.restart_cnt,
                    ranks=len(ranks),
                    world_size=max((r.world_size for _, r in ranks), default=0),
                    state_reason=_state_reason(job),
                    started_at=job.start_time or None,
                    scheduler="slurm",
                    scheduler_job_id=job.id,
                )
            )
        return views


def _state_reason(job: SlurmJob) -> str:
    """Slurm's reason for the job's state, with trainguard's comment when it held the job."""
    reason = job.state_reason if job.state_reason != "None" else ""
    if job.comment.startswith(REASON_PREFIX) and job.held:
        return f"{reason}: {job.comment}" if reason else job.comment
    return reason


def build(deps: BackendDeps) -> SlurmBackend:
    """The registry's factory: Slurm's client commands as `backend.slurm` configures them
    (or `deps.slurm_runner`)."""
    config = deps.config
    sc = config.backend.slurm
    runner = deps.slurm_runner or SlurmCli(
        bin_dir=sc.bin_dir, slurm_conf=sc.slurm_conf, timeout_s=sc.command_timeout_s
    )
    return SlurmBackend(
        config=sc,
        commands=SlurmCommands(runner),
        live=deps.live,
        jobs=deps.jobs,
        clock=deps.clock,
        node_silent_after_s=config.node_silent_after_s,
        spare_wait_s=config.jobs.spare_wait_s,
        progress_timeout_s=config.jobs.progress_timeout_s,
        open_incident_nodes=deps.open_incident_nodes,
        observe=deps.observe,
        spare_check=deps.spare_check(),
    )


__all__ = ["REASON_PREFIX", "SlurmBackend", "build", "node_state_of", "trainguard_reason"]
