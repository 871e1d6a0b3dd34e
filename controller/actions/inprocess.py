"""In-process recovery, the restart step's fast path (docs/controller.md, "In-process
recovery"): for a job whose spec says `recovery.in_process`, after the replace step swapped a
lost node for a spare (or a killed rank's healthy node for a spare's standby:
controller.actions.standbyswap), the healthy ranks stay in their processes and re-form the
world under the next attempt epoch with the spare's warm standby, instead of a full restart.

    decided -> sent -> done            (or -> fallback, from any of them)

decided: the new world is planned (`plan_world`) and stored before any command is sent, so
a controller killed at any point re-sends the same decision (command ids derived from the
step's key), never a second one. sent: stop_job to the lost node, `rejoin` to each
survivor's agent, `assign_standby` to each spare's; once every agent acknowledged, the job's
attempt becomes the new epoch (the survivors' launches already report it, so fencing leaves
them alone); waiting until every rank of the new world reports a trained step under it.
fallback: anything that fails (no ready standby, a command refused, a rank exiting, the
deadline) hands the step back to the full restart from the checkpoint, the reason said in
the incident timeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainguard.command_args import AssignStandbyArgs, RejoinArgs, RejoinRank, StopJobArgs
from trainguard.controller.actions.base import ActionContext, Outcome
from trainguard.controller.actions.recovery import PhaseObserver, recovery_phases
from trainguard.controller.jobstate import JobState
from trainguard.membership import Membership

if TYPE_CHECKING:  # types only: the job manager imports the store and the live state
    from trainguard.controller.jobs import JobManager, JobSpec
    from trainguard.controller.records import JobRecord
    from trainguard.protocol import RankState

__all__ = [
    "PROGRESS_KEY",
    "SWAP_SKIPPED_KEY",
    "InProcessRecovery",
    "WorldPlan",
    "job_module",
    "plan_world",
    "standby_unready",
]

log = logging.getLogger("trainguard.controller.inprocess")

# The restart step's progress keeps the in-process path's state under this key.
PROGRESS_KEY = "in_process"
# The replace step's output says under this key why a killed rank's node was not swapped for
# a spare's standby (controller.actions.standbyswap): the reason this path falls back on.
SWAP_SKIPPED_KEY = "standby_swap_skipped"


@dataclass(frozen=True)
class WorldPlan:
    """The re-formed world: who gets which membership, through which agent."""

    epoch: int
    rejoin: dict[str, dict[int, Membership]]  # survivor node -> current rank -> membership
    assign: dict[str, Membership]  # spare node -> its standby's membership
    lost: list[str]  # the nodes whose ranks are replaced
    step: int  # the lowest step a survivor had reached: the new world trains past it

    def to_output(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "rejoin": {
                node: {str(rank): m.to_json() for rank, m in ranks.items()}
                for node, ranks in self.rejoin.items()
            },
            "assign": {node: m.to_json() for node, m in self.assign.items()},
            "lost": list(self.lost),
            "step": self.step,
        }

    @classmethod
    def from_output(cls, raw: Mapping[str, Any]) -> WorldPlan:
        return cls(
            epoch=int(raw["epoch"]),
            rejoin={
                node: {int(rank): Membership.from_json(m) for rank, m in ranks.items()}
                for node, ranks in raw["rejoin"].items()
            },
            assign={node: Membership.from_json(m) for node, m in raw["assign"].items()},
            lost=list(raw["lost"]),
            step=int(raw["step"]),
        )

    def where(self) -> dict[int, str]:
        """New rank -> the node it runs on."""
        out = {m.rank: node for node, ranks in self.rejoin.items() for m in ranks.values()}
        out.update({m.rank: node for node, m in self.assign.items()})
        return out


def job_module(spec: JobSpec) -> str:
    """The entry module a standby must have imported for the job: `-m pkg.mod` names it; a
    program path `dir/train.py` runs as module `train` (the standby's cwd holds it)."""
    if spec.command[0] == "-m":
        return spec.command[1]
    name = spec.command[0].rsplit("/", 1)[-1]
    return name[:-3] if name.endswith(".py") else name


def standby_unready(jobs: JobManager, node: str, *, module: str) -> str | None:
    """Why `node` cannot give the job a rank now (no standby, another module's, not ready);
    None: its warm standby is ready for `module`."""
    standby = jobs.standby(node)
    if standby is None:
        return f"spare {node} reports no warm standby"
    if standby.module != module:
        return f"spare {node}'s standby runs module {standby.module!r}, not {module!r}"
    if not standby.ready:
        return f"spare {node}'s warm standby is not ready"
    return None


def plan_world(
    *,
    ranks: Sequence[tuple[str, RankState]],
    replaced: Mapping[str, str],
    world_size: int,
    epoch: int,
    address: Callable[[str], str],
    store_port: int,
    timeout_s: float,
) -> WorldPlan | str:
    """The next world, or why there is none. Survivors (ranks reported on nodes not lost)
    keep their ranks; each spare's standby takes a lost rank (one rank per node: a spare
    keeps one standby); when rank 0 was lost, the first survivor becomes rank 0 and the
    standby takes its old rank, because rank 0 runs the new world's store (host_store) and
    a survivor is already up. Pure."""
    survivors: dict[int, str] = {}
    for node, r in ranks:
        if node in replaced or r.phase == "exit" or r.rank >= world_size:
            continue
        if r.world_size != world_size:
            return f"rank {r.rank} on {node} reports world size {r.world_size}, not {world_size}"
        survivors[r.rank] = node
    if not survivors:
        return "no surviving rank reports"
    lost_slots = [r for r in range(world_size) if r not in survivors]
    spares = list(replaced.values())
    if len(lost_slots) != len(spares):
        return (
            f"{len(lost_slots)} rank(s) to replace ({lost_slots}) but {len(spares)} spare(s):"
            " a spare's standby is one rank"
        )
    slot_of: dict[str, int] = dict(zip(spares, lost_slots, strict=True))
    new_rank = {old: old for old in survivors}
    if 0 in lost_slots:
        first = min(survivors)
        new_rank[first] = 0
        slot_of[next(s for s, slot in slot_of.items() if slot == 0)] = first
    host = survivors[min(survivors, key=lambda old: new_rank[old])]

    def member(rank: int) -> Membership:
        return Membership(
            rank=rank,
            world_size=world_size,
            store_host=address(host),
            store_port=store_port,
            epoch=epoch,
            timeout_s=timeout_s,
            host_store=rank == 0,
        )

    rejoin: dict[str, dict[int, Membership]] = {}
    for old, node in sorted(survivors.items()):
        rejoin.setdefault(node, {})[old] = member(new_rank[old])
    steps = [r.step for n, r in ranks if n not in replaced and r.rank in survivors]
    return WorldPlan(
        epoch=epoch,
        rejoin=rejoin,
        assign={spare: member(slot) for spare, slot in slot_of.items()},
        lost=list(replaced),
        step=min(steps),
    )


@dataclass
class InProcessRecovery:
    """The restart step's fast path; `run` returns None when the full restart must go on
    (the path does not apply, or it fell back: progress[PROGRESS_KEY] says why)."""

    jobs: JobManager
    observe: PhaseObserver = field(default=lambda phases, lost: None)
    # the step re-reads memory only (commands acknowledged, ranks' epochs): polled often, since
    # each poll it waits out adds to the recovery
    poll_interval_s: float = 0.1

    def run(self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any]) -> Outcome | None:
        state = progress.get(PROGRESS_KEY)
        if state is None:
            spec = self.jobs.spec(job)
            if not spec.recovery.in_process or "replace" not in ctx.previous:
                return None  # not a recovery from a lost node (a start, an operator's restart)
            return self._decide(ctx, job, spec, progress)
        phase = state.get("phase")
        if phase == "decided":
            return self._send(ctx, job, progress, state)
        if phase == "sent":
            return self._confirm(ctx, job, progress, state)
        return None  # fallback (or done: the step finished with it)

    # -- decided ---------------------------------------------------------------------------

    def _decide(
        self, ctx: ActionContext, job: JobRecord, spec: JobSpec, progress: dict[str, Any]
    ) -> Outcome | None:
        plan = self._plan(ctx, job, spec)
        if isinstance(plan, str):
            self._fall_back(ctx, job, progress, reason=plan)
            return None
        progress[PROGRESS_KEY] = {
            "phase": "decided",
            "plan": plan.to_output(),
            "decided_at": ctx.now,
            "from_attempt": job.attempt,
            # lost work: the newest step any rank reached (the lost one's included) against
            # the newest a survivor holds (the state every rank continues from)
            "last_step": max((r.step for _, r in self.jobs.ranks(job.name)), default=None),
            "survivor_step": max(
                (r.step for n, r in self.jobs.ranks(job.name) if n not in plan.lost),
                default=None,
            ),
        }
        log.info(
            "event=inprocess_decided job=%s epoch=%d lost=%s spares=%s key=%s",
            job.name,
            plan.epoch,
            ",".join(plan.lost),
            ",".join(plan.assign),
            ctx.action.idempotency_key,
        )
        # stored before any command is sent: the next run sends exactly this decision
        return Outcome(
            message=f"in-process recovery: {', '.join(plan.lost)}'s rank(s) go to the warm"
            f" standby on {', '.join(plan.assign)}; survivors rejoin under epoch {plan.epoch}",
            output=progress,
            done=False,
            poll_after_s=0.0,
        )

    def _plan(self, ctx: ActionContext, job: JobRecord, spec: JobSpec) -> WorldPlan | str:
        replace = ctx.previous.get("replace", {})
        swapped = replace.get("replaced")
        if replace.get("mode") != "spare" or not isinstance(swapped, dict) or not swapped:
            skipped = replace.get(SWAP_SKIPPED_KEY)  # a killed rank's swap did not apply: why
            if isinstance(skipped, str) and skipped:
                return skipped
            return "no spare was swapped in for a lost node (the replace step did not)"
        if job.nproc_per_node != 1:
            return f"{job.nproc_per_node} ranks per node: a spare's standby is one rank"
        module = job_module(spec)
        for spare in swapped.values():
            why = standby_unready(self.jobs, spare, module=module)
            if why is not None:
                return why
        cfg = self.jobs.config
        epoch = job.attempt + 1
        return plan_world(
            ranks=self.jobs.ranks(job.name),
            replaced=swapped,
            world_size=len(job.nodes) * job.nproc_per_node,
            epoch=epoch,
            address=self.jobs.address,
            store_port=cfg.in_process_store_port_base + epoch % cfg.in_process_store_port_span,
            timeout_s=cfg.in_process_rejoin_timeout_s,
        )

    # -- sent ------------------------------------------------------------------------------

    def _send(
        self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any], state: dict[str, Any]
    ) -> Outcome:
        """Queue the stored decision's commands; their ids come from the step's key, so a
        re-run after a crash queues the same ones (a repeated id is a no-op)."""
        plan = WorldPlan.from_output(state["plan"])
        spec = self.jobs.spec(job)
        key = ctx.action.idempotency_key
        nodes = self.jobs.nodes
        for node in plan.lost:
            # the drain stopped it already; a rank of the lost node that lingers must die now,
            # not at a checkpoint step its lost peers can never agree on
            nodes.queue_command(
                node, StopJobArgs(job=job.name, grace_s=0.0), command_id=_cmd("stop", key, node)
            )
        for node, ranks in plan.rejoin.items():
            args = RejoinArgs(
                job=job.name,
                epoch=plan.epoch,
                ranks=tuple(
                    RejoinRank(rank=rank, membership=m.to_json()) for rank, m in ranks.items()
                ),
            )
            nodes.queue_command(node, args, command_id=_cmd("rejoin", key, node))
        for node, m in plan.assign.items():
            assign = AssignStandbyArgs(
                job=job.name,
                epoch=plan.epoch,
                membership=m.to_json(),
                module=job_module(spec),
                env=dict(spec.env),
                ckpt_dir=spec.ckpt_dir,
            )
            nodes.queue_command(node, assign, command_id=_cmd("assign", key, node))
        state.update(phase="sent", sent_at=ctx.now)
        return Outcome(
            message=f"rejoin sent to {', '.join(plan.rejoin)}, the standby on"
            f" {', '.join(plan.assign)} assigned; waiting for every rank to train under epoch"
            f" {plan.epoch}",
            output=progress,
            done=False,
            poll_after_s=self.poll_interval_s,
        )

    def _confirm(
        self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any], state: dict[str, Any]
    ) -> Outcome | None:
        plan = WorldPlan.from_output(state["plan"])
        key = ctx.action.idempotency_key
        acked = True
        for kind, targets in (("rejoin", plan.rejoin), ("assign", plan.assign)):
            for node in targets:
                rec = self.jobs.nodes.command_status(_cmd(kind, key, node))
                if rec is None or rec.done_at is None:
                    acked = False
                elif not rec.ok:
                    what = "assign_standby" if kind == "assign" else kind
                    reason = f"{what} on {node} failed: {rec.result or 'no detail'}"
                    self._fall_back(ctx, job, progress, reason=reason)
                    return None
        if acked and not state.get("attempt_begun"):
            # every agent runs the new epoch now: the job's attempt follows (fencing then
            # stops anything of the old one), keyed so a re-run begins nothing twice
            current, _ = self.jobs.begin_attempt(job.name, key=_attempt_key(key))
            state["attempt_begun"] = True
            if current.attempt != plan.epoch:
                reason = f"the job's attempt is {current.attempt}, not the planned {plan.epoch}"
                self._fall_back(ctx, job, progress, reason=reason)
                return None
        where = plan.where()
        involved = set(where.values())
        for x in self.jobs.exits(job.name):
            if (
                x["node"] in involved
                and x["ts"] >= float(state["sent_at"])
                and x["code"] != 0
                and not x["stopped"]
            ):
                reason = f"a rank exited on {x['node']} (code {x['code']}) while rejoining"
                self._fall_back(ctx, job, progress, reason=reason)
                return None
        trained = {
            r.rank
            for node, r in self.jobs.ranks(job.name)
            if r.epoch == plan.epoch
            and where.get(r.rank) == node
            and r.step > plan.step
            and r.phase != "exit"
        }
        if acked and trained == set(where):
            return self._done(ctx, job, progress, state, plan)
        waited_s = ctx.now - float(state["sent_at"])
        deadline_s = self.jobs.config.in_process_deadline_s
        if waited_s > deadline_s:
            missing = sorted(set(where) - trained)
            reason = (
                f"rank(s) {missing} showed no step past {plan.step} under epoch {plan.epoch}"
                f" within {deadline_s:g} s"
            )
            self._fall_back(ctx, job, progress, reason=reason)
            return None
        return Outcome(
            message=f"waiting for every rank to train under epoch {plan.epoch}"
            f" ({len(trained)} of {len(where)})",
            output=progress,
            done=False,
            poll_after_s=self.poll_interval_s,
        )

    def _done(
        self,
        ctx: ActionContext,
        job: JobRecord,
        progress: dict[str, Any],
        state: dict[str, Any],
        plan: WorldPlan,
    ) -> Outcome:
        current = self.jobs.get(job.name)
        if current is not None and current.state != JobState.RUNNING:
            self.jobs.set_state(job.name, JobState.RUNNING)
        timing = {**progress, "started_at": state["decided_at"], "stop_sent_at": state["sent_at"]}
        phases = recovery_phases(ctx, timing, now=ctx.now)
        phases["restart"] = ctx.now - float(state["decided_at"])
        last, kept = state.get("last_step"), state.get("survivor_step")
        lost = max(0, last - kept) if isinstance(last, int) and isinstance(kept, int) else None
        self.observe(phases, lost)
        state.update(phase="done", done_at=ctx.now)
        text = ", ".join(f"{k} {v:.1f} s" for k, v in phases.items())
        log.info(
            "event=inprocess_recovered job=%s epoch=%d %s lost_steps=%s key=%s",
            job.name,
            plan.epoch,
            text.replace(", ", " ").replace(" s", "_s"),
            lost,
            ctx.action.idempotency_key,
        )
        lost_text = f"; lost steps {lost}" if lost is not None else ""
        return Outcome(
            message=f"recovered in process: epoch {plan.epoch} trains past step {plan.step}"
            f" with the standby on {', '.join(plan.assign)} (no relaunch); {text}{lost_text}",
            output={
                **progress,
                "mode": "in_process",
                "attempt": plan.epoch,
                "restarted_at": ctx.now,
                "phases_s": phases,
                "lost_steps": lost,
            },
        )

    # -- fallback --------------------------------------------------------------------------

    def _fall_back(
        self, ctx: ActionContext, job: JobRecord, progress: dict[str, Any], *, reason: str
    ) -> None:
        """Record why, and hand the step to the full restart. Once commands went out, the
        job's attempt is raised to the planned epoch first, so the restart's attempt is newer
        than anything the rejoin may have started (its stop phase stops those)."""
        state = progress.get(PROGRESS_KEY) or {}
        if state.get("phase") == "sent" and not state.get("attempt_begun"):
            self.jobs.begin_attempt(job.name, key=_attempt_key(ctx.action.idempotency_key))
            state["attempt_begun"] = True
        progress[PROGRESS_KEY] = {**state, "phase": "fallback", "reason": reason}
        log.warning(
            "event=inprocess_fallback job=%s reason=%r key=%s",
            job.name,
            reason,
            ctx.action.idempotency_key,
        )


def _cmd(kind: str, key: str, node: str) -> str:
    return f"inproc-{kind}-{key}-{node}"


def _attempt_key(key: str) -> str:
    return f"{key}/in-process"
