"""What every backend's restart step shares, written once: the checkpoint it resumes from,
the in-process rollback that makes a rollback step moot, the first step past the checkpoint
that confirms it, and its result (the phases measured, the lost steps, the done output).
The torchrun restart (controller.actions.jobsteps.RestartHandler) and the Slurm requeue
(controller.backends.slurm) differ in how they get the job going again, not in these."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING, Any

from trainguard.controller.actions.base import ActionContext, Outcome
from trainguard.controller.actions.restartphase import RestartPhase

if TYPE_CHECKING:  # types only: the job manager imports the store and the live state
    from trainguard.controller.jobs import JobManager
    from trainguard.protocol import RankState

# Restart phases measured into trainguard_controller_remediation_phase_seconds.
PhaseObserver = Callable[[dict[str, float], "int | None"], None]
# A rollback the trainer made this long before the incident opened still counts as its.
_ROLLBACK_BEFORE_INCIDENT_S = 30.0


def restart_baseline(jobs: JobManager, job: str, ctx: ActionContext) -> dict[str, Any]:
    """A restart's starting point, kept in its progress: ckpt_step (the checkpoint step's
    proactive checkpoint, else the newest committed one), last_step (the step reached before:
    the steps past ckpt_step are lost) and old_pids (ranks with one of these are the stopped
    attempt's, not the new one's)."""
    step, ckpt = jobs.latest_steps(job)
    previous = ctx.previous.get("checkpoint", {})
    if isinstance(previous.get("step"), int):
        ckpt = previous["step"]
    if isinstance(previous.get("last_step"), int):
        step = previous["last_step"]
    return {
        "ckpt_step": ckpt,
        "last_step": step,
        "old_pids": sorted({r.pid for _, r in jobs.ranks(job) if r.pid}),
    }


def rolled_back_in_process(jobs: JobManager, job: str, ctx: ActionContext) -> Outcome | None:
    """A `skipped` outcome when the trainer already rolled the job back in process (for this
    incident); None when the rollback step must restart it."""
    rolled = [
        to
        for ts, to in jobs.rollbacks(job)
        if ctx.incident is None or ts >= ctx.incident.opened_at - _ROLLBACK_BEFORE_INCIDENT_S
    ]
    if not rolled:
        return None
    return Outcome(
        message=f"skipped: the trainer already rolled back in process (to step {rolled[-1]})",
        skipped=True,
    )


def ckpt_floor(progress: dict[str, Any]) -> int:
    """The step a restarted rank must pass: the checkpoint it resumed from (0: none)."""
    ckpt = progress.get("ckpt_step")
    return ckpt if isinstance(ckpt, int) else 0


def first_step_past(
    ranks: Iterable[tuple[str, RankState]],
    *,
    nodes: Collection[str],
    floor: int,
    old_pids: Collection[int],
    stale: Callable[[str], bool] = lambda node: False,
) -> int | None:
    """The lowest step past `floor` that a rank of the new run reports (on `nodes`, not one
    of `old_pids`, not on a node `stale` says runs something older, not exiting); None while
    none has."""
    first: int | None = None
    for node, rank in ranks:
        if node not in nodes or (rank.pid and rank.pid in old_pids) or stale(node):
            continue
        if rank.step > floor and rank.phase != "exit":
            first = rank.step if first is None else min(first, rank.step)
    return first


def recovery_phases(
    ctx: ActionContext, progress: dict[str, Any], *, now: float
) -> dict[str, float]:
    """A restart's phases: detect = incident opened - condition since; checkpoint = the
    checkpoint step; drain = checkpoint done (or incident opened) -> the replace step
    began; restart = stop sent -> first step past the checkpoint; mttr = condition since
    -> that first step. Every backend's restart step reports these."""
    phases: dict[str, float] = {}
    restart_s = now - float(progress.get("stop_sent_at", progress["started_at"]))
    phases["restart"] = restart_s
    if ctx.incident is None:
        return phases
    opened = ctx.incident.opened_at
    since_raw = ctx.params.get("since")
    since = float(since_raw) if isinstance(since_raw, int | float) else opened
    phases["detect"] = max(0.0, opened - since)
    ckpt = ctx.previous.get("checkpoint", {})
    if "finished_at" in ckpt and "started_at" in ckpt:
        phases["checkpoint"] = float(ckpt["finished_at"]) - float(ckpt["started_at"])
    drained = ctx.previous.get("drain")
    replace = ctx.previous.get("replace", {})
    if drained is not None and "started_at" in replace:
        begin = float(ckpt.get("finished_at", opened))
        phases["drain"] = max(0.0, float(replace["started_at"]) - begin)
    phases["mttr"] = max(0.0, now - since)
    return phases


def restart_confirmed(
    ctx: ActionContext,
    progress: dict[str, Any],
    *,
    first: int,
    phases: dict[str, float],
    observe: PhaseObserver,
    what: str,
    where: str = "",
) -> Outcome:
    """The done result of a restart whose new run reached step `first` past its checkpoint:
    the phases and the lost steps observed (metrics), said in the message
    ("<what> trains past checkpoint C<where> (step N); ...") and kept in the output."""
    last = progress.get("last_step")
    lost = max(0, last - ckpt_floor(progress)) if isinstance(last, int) else None
    observe(phases, lost)
    text = ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
    lost_text = f"; lost steps {lost}" if lost is not None else ""
    return Outcome(
        message=f"{what} trains past checkpoint {progress.get('ckpt_step')}{where}"
        f" (step {first}); {text}{lost_text}",
        output={
            **progress,
            "phase": RestartPhase.DONE.value,
            "first_step": first,
            "restarted_at": ctx.now,
            "phases_s": phases,
            "lost_steps": lost,
        },
    )


__all__ = [
    "PhaseObserver",
    "ckpt_floor",
    "first_step_past",
    "recovery_phases",
    "restart_baseline",
    "restart_confirmed",
    "rolled_back_in_process",
]
