"""A Slurm job's restart, in three phases kept in the step's progress: requeue it held
(`scontrol requeuehold`; a pending job is held), release it once Slurm no longer runs it
anywhere (so the drained node is out of it) pinned to the new node set (`nodelist=`,
`release`, `starttime=now`: a requeued job would otherwise wait cred_expire), then confirm
it by a step past the checkpoint.
"""

from __future__ import annotations

import logging
from typing import Any

from trainguard.controller.actions.base import ActionContext, Outcome, PermanentError
from trainguard.controller.actions.recovery import (
    PhaseObserver,
    ckpt_floor,
    first_step_past,
    recovery_phases,
    restart_baseline,
    restart_confirmed,
)
from trainguard.controller.backends.slurm.cli import SlurmJob
from trainguard.controller.backends.slurm.failures import as_step_error
from trainguard.controller.backends.slurm.mirror import SlurmMirror
from trainguard.controller.backends.slurm.spares import SlurmSpares
from trainguard.controller.jobs import JobManager

__all__ = ["POLL_S", "SlurmRequeue", "job_nodes_text"]

log = logging.getLogger("trainguard.controller.slurm")

POLL_S = 0.5


def job_nodes_text(job: SlurmJob) -> str:
    return ",".join(job.nodes) or "no nodes"


class SlurmRequeue:
    """The restart phases: `requeue` (no phase yet), `release` ("requeued"), `confirm`."""

    def __init__(
        self,
        *,
        mirror: SlurmMirror,
        spares: SlurmSpares,
        jobs: JobManager,
        progress_timeout_s: float,
        observe: PhaseObserver,
    ) -> None:
        self._mirror = mirror
        self._spares = spares
        self._jobs = jobs
        self._progress_timeout_s = progress_timeout_s
        self._observe = observe

    def requeue(
        self, ctx: ActionContext, progress: dict[str, Any], *, job: SlurmJob, same_nodes: bool
    ) -> Outcome:
        """Requeue `job` held, its next node set chosen: the replace step's, else its own
        with the unusable nodes swapped for spares (unless `same_nodes`, a rollback)."""
        job_id = job.id
        name = self._mirror.job_name(job_id)
        nodes = self._spares.job_nodes(job)
        target = ctx.previous.get("replace", {}).get("nodes")
        if not isinstance(target, list) or not target:
            target = list(nodes)
            if not same_nodes:
                sick = ctx.params.get("node") if isinstance(ctx.params.get("node"), str) else None
                bad = self._spares.bad(nodes, sick)
                if bad:
                    spares, checking = self._spares.pick(
                        ctx, progress, exclude=set(nodes), need=len(bad)
                    )
                    if checking is not None:
                        return Outcome(
                            message=f"Slurm job {job_id}: {checking}",
                            output=progress,
                            done=False,
                            poll_after_s=POLL_S,
                        )
                    swap = self._spares.take(job, bad=bad, nodes=nodes, spares=spares)
                    if not swap:
                        raise PermanentError(
                            f"Slurm job {job_id} cannot restart: {', '.join(bad)} unusable and"
                            f" no spare in reservation {self._spares.reservation}"
                        )
                    target = [swap.get(n, n) for n in nodes]
        baseline = restart_baseline(self._jobs, name, ctx)
        ckpt = baseline["ckpt_step"]
        progress.update(
            phase="requeued",
            job=name,
            slurm_job_id=job_id,
            nodes=target,
            **baseline,
            stop_sent_at=ctx.now,
            started_at=ctx.now,
            restart_cnt=job.restart_cnt,
        )
        since = ctx.incident.opened_at if ctx.incident is not None else ctx.now
        target_slurm = {self._mirror.slurm_name(n) for n in target}
        if (
            job.state == "RUNNING"
            and job.restart_cnt > 0
            and set(job.nodes) <= target_slurm
            and job.start_time >= since - 1
        ):
            # Slurm requeued it itself (a node failure) and started it on the new set
            progress.update(phase="released", released_at=ctx.now, already=True)
            return Outcome(
                message=f"Slurm job {job_id} already runs again on {job_nodes_text(job)};"
                f" waiting for a step past checkpoint {ckpt}",
                output=progress,
                done=False,
                poll_after_s=POLL_S,
            )
        commands = self._mirror.commands
        with as_step_error(f"requeueing Slurm job {job_id}"):
            if job.state == "PENDING":
                commands.hold(job_id)
                verb = "held (it was pending)"
            elif job.state == "COMPLETING":
                # Slurm is taking it down already (its own requeue after a node failure):
                # hold it once it is pending
                verb = "completing (Slurm is ending it)"
                progress["hold_when_pending"] = True
            else:
                commands.requeue_hold(job_id)
                verb = f"requeued (held) from {job.state.lower()}"
        log.info("event=slurm_requeue job=%s slurm_job=%s from=%s", name, job_id, job.state)
        return Outcome(
            message=f"Slurm job {job_id} {verb}; waiting until Slurm no longer runs it, then"
            f" releasing it on {', '.join(target)}",
            output=progress,
            done=False,
            poll_after_s=POLL_S,
        )

    def release(self, ctx: ActionContext, job: SlurmJob, progress: dict[str, Any]) -> Outcome:
        """Once Slurm no longer runs the job: pin it to the new node set and release it."""
        waited_s = ctx.now - float(progress["stop_sent_at"])
        commands = self._mirror.commands
        if job.state != "PENDING":
            if job.finished:
                # requeuehold of a finished job leaves it pending; one that finished after
                # the requeue (a race with its own exit) is requeued again
                with as_step_error(f"requeueing Slurm job {job.id}"):
                    commands.requeue_hold(job.id)
            if waited_s > self._mirror.config.requeue_timeout_s:
                raise PermanentError(
                    f"Slurm job {job.id} still {job.state} on {job_nodes_text(job)}"
                    f" {waited_s:.0f} s after the requeue ({job.state_reason})"
                )
            return Outcome(
                message=f"Slurm job {job.id} is {job.state.lower()} on {job_nodes_text(job)};"
                " waiting until Slurm no longer runs it",
                output=progress,
                done=False,
                poll_after_s=POLL_S,
            )
        target = [self._mirror.slurm_name(n) for n in progress["nodes"]]
        if job.node_count and len(target) != job.node_count:
            # (pending, squeue counts the nodes the job asks for)
            raise PermanentError(
                f"Slurm job {job.id} needs {job.node_count} node(s); the new set"
                f" {', '.join(target) or '(none)'} has {len(target)}"
            )
        with as_step_error(f"releasing Slurm job {job.id} on {','.join(target)}"):
            if progress.pop("hold_when_pending", False):
                commands.hold(job.id)
            commands.set_job_nodes(job.id, target)
            commands.release(job.id)
            commands.start_now(job.id)
        progress.update(phase="released", pending_at=ctx.now, released_at=ctx.now)
        log.info(
            "event=slurm_release slurm_job=%s nodes=%s requeue_s=%.2f",
            job.id,
            ",".join(target),
            waited_s,
        )
        return Outcome(
            message=f"Slurm job {job.id} left its nodes after {waited_s:.1f} s; released on"
            f" {', '.join(progress['nodes'])}",
            output=progress,
            done=False,
            poll_after_s=POLL_S,
        )

    def confirm(self, ctx: ActionContext, job: SlurmJob, progress: dict[str, Any]) -> Outcome:
        """Done once a rank on the new node set reports a step past the checkpoint."""
        if job.finished:
            raise PermanentError(
                f"Slurm job {job.id} {job.state} ({job.state_reason}) before training"
                " progressed past the checkpoint"
            )
        if job.state == "RUNNING" and "running_at" not in progress:
            progress["running_at"] = ctx.now
        floor = ckpt_floor(progress)
        first = first_step_past(
            self._jobs.ranks(str(progress["job"])),
            nodes=set(progress["nodes"]),
            floor=floor,
            old_pids=set(progress.get("old_pids", [])),
        )
        if first is None:
            waited_s = ctx.now - float(progress["released_at"])
            if waited_s > self._progress_timeout_s:
                raise PermanentError(
                    f"Slurm job {job.id} ({job.state}, {job.state_reason}) showed no step past"
                    f" {floor} within {self._progress_timeout_s:g} s of its release"
                )
            return Outcome(
                message=f"Slurm job {job.id} {job.state.lower()}; waiting for a step past"
                f" checkpoint {progress.get('ckpt_step')}",
                output=progress,
                done=False,
                poll_after_s=POLL_S,
            )
        phases = recovery_phases(ctx, progress, now=ctx.now)
        released = float(progress["released_at"])
        running = float(progress.get("running_at", released))
        if "pending_at" in progress:
            phases["requeue"] = float(progress["pending_at"]) - float(progress["stop_sent_at"])
            phases["allocation"] = max(0.0, running - released)
        phases["launch"] = max(0.0, ctx.now - running)
        return restart_confirmed(
            ctx,
            progress,
            first=first,
            phases=phases,
            observe=self._observe,
            what=f"Slurm job {job.id} (restart {job.restart_cnt})",
            where=f" on {job_nodes_text(job)}",
        )
