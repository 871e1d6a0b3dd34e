"""The replace step's swap for a killed rank (docs/controller.md, "In-process recovery"): when
a rank of a job whose spec says `recovery.in_process` exits non-zero on a healthy node (kill
-9, an OOM kill), that node's slot goes to a spare's ready warm standby, so the restart step's
fast path (controller.actions.inprocess) re-forms the world in process exactly as for a lost
node. The crashed node is healthy: it is not drained, it leaves the job and joins the spare
pool (role spare), so the pool keeps its size.

    decided -> placed            (or no swap: the reason, the fast path's fallback reason)

decided: the crashed node and the spare are stored in the step's progress before anything
moves, so a controller killed at any point applies that same swap, never a second one.
placed: one transaction moves the job (the spare joins it, the crashed node leaves it as a
spare); a re-run finds it placed and answers the same.

Anything missing (no ranks exited, ranks exited on several nodes, several ranks per node, the
crashed node unhealthy, a peer no longer running, no free spare with a ready standby of the
job's module, none passing its preflight) swaps nothing: the restart runs in full, as for any
crashed job, the reason in the timeline.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trainguard.controller.actions.base import ActionContext, Outcome
from trainguard.controller.actions.inprocess import SWAP_SKIPPED_KEY, job_module, standby_unready
from trainguard.controller.actions.sparecheck import PROGRESS_KEY as SPARES_KEY
from trainguard.controller.actions.sparecheck import SparePreflight
from trainguard.controller.jobstate import JobState

if TYPE_CHECKING:  # types only: the job manager imports the store and the live state
    from trainguard.controller.jobs import JobManager, JobSpec
    from trainguard.controller.records import JobRecord

__all__ = ["DECISION_KEY", "StandbySwap"]

log = logging.getLogger("trainguard.controller.standbyswap")

# The replace step's progress keeps the decision under this key (its output, when nothing
# was swapped, says why under inprocess.SWAP_SKIPPED_KEY: the fast path's fallback reason).
DECISION_KEY = "standby_swap"

# A step waiting for a spare's preflight looks again this often, s.
_PREFLIGHT_POLL_S = 1.0


@dataclass
class StandbySwap:
    """`run` answers the replace step for a crashed in-process job on healthy nodes; None for
    any other job (the step's own "needs no replacement" stands)."""

    jobs: JobManager
    # Given: the spare joins only after a passing preflight (as the replace step's swap)
    spare_check: SparePreflight | None = None

    def run(
        self,
        ctx: ActionContext,
        job: JobRecord,
        progress: dict[str, Any],
        *,
        base: dict[str, Any],
        open_nodes: set[str],
    ) -> Outcome | None:
        if SPARES_KEY in progress:  # the spares' preflights under way
            base[SPARES_KEY] = progress[SPARES_KEY]
        decided = progress.get(DECISION_KEY)
        if isinstance(decided, dict):
            return self._apply(ctx, job, decided, base=base, open_nodes=open_nodes)
        spec = self.jobs.spec(job)
        if not spec.recovery.in_process or job.state != JobState.CRASHED:
            return None
        crashed, why = self._crashed(job, open_nodes=open_nodes)
        if not crashed:
            return self._skip(job, base=base, reason=why)
        spares, why = self._standby_spares(job, spec, open_nodes=open_nodes)
        if not spares:
            return self._skip(job, base=base, reason=why)
        spare = spares[0]
        if self.spare_check is not None:
            gate = self.spare_check.check(
                spares, need=1, now=ctx.now, key=ctx.action.idempotency_key, progress=base
            )
            if gate.waiting:
                return Outcome(
                    message=f"waiting for the preflight of spare {', '.join(gate.waiting)}, whose"
                    f" warm standby takes the rank that exited on {crashed}",
                    output=base,
                    done=False,
                    poll_after_s=_PREFLIGHT_POLL_S,
                )
            if not gate.ready:
                failed = "; ".join(f"{n}: {w}" for n, w in gate.failed.items())
                return self._skip(
                    job,
                    base=base,
                    reason=f"no spare with a ready warm standby passed its preflight ({failed})",
                )
            spare = gate.ready[0]
        base[DECISION_KEY] = {"crashed": crashed, "spare": spare, "decided_at": ctx.now}
        log.info(
            "event=standby_swap_decided job=%s crashed=%s spare=%s key=%s",
            job.name,
            crashed,
            spare,
            ctx.action.idempotency_key,
        )
        # stored before the job moves: the next run applies exactly this swap
        return Outcome(
            message=f"a rank exited on {crashed} (the node is healthy): its slot goes to the"
            f" warm standby on {spare} for the in-process recovery; {crashed} leaves job"
            f" {job.name} and joins the spares",
            output=base,
            done=False,
            poll_after_s=0.0,
        )

    def _crashed(self, job: JobRecord, *, open_nodes: set[str]) -> tuple[str, str]:
        """(the node whose rank exited, "") or ("", why the swap does not apply). The exits
        are the live view's: after a controller restart they are gone, and the job restarts
        in full."""
        exited = sorted(
            {
                str(x["node"])
                for x in self.jobs.exits(job.name)
                if x["attempt"] == job.attempt and x["code"] != 0 and not x["stopped"]
            }
        )
        if not exited:
            return "", f"no rank of attempt {job.attempt} is known to have exited non-zero"
        if len(exited) > 1:
            return "", (
                f"ranks exited on {len(exited)} nodes ({', '.join(exited)}): a spare's standby"
                " takes one node's rank"
            )
        node = exited[0]
        if node not in job.nodes:
            return "", f"{node}, where a rank exited, is no longer a node of job {job.name}"
        if job.nproc_per_node != 1:
            return "", f"{job.nproc_per_node} ranks per node: a spare's standby is one rank"
        if not self.jobs.healthy(node, open_incident_nodes=open_nodes):
            return "", f"{node}, where a rank exited, is not healthy (an open incident)"
        # the others must be trained ranks waiting for a new world (a start that failed has
        # none reporting yet: it restarts in full, its node staying in the job)
        live = {n for n, r in self.jobs.ranks(job.name) if r.phase != "exit"}
        gone = [n for n in job.nodes if n != node and n not in live]
        if gone:
            return "", f"{', '.join(gone)} report(s) no rank of the job: no survivor to rejoin"
        return node, ""

    def _standby_spares(
        self, job: JobRecord, spec: JobSpec, *, open_nodes: set[str]
    ) -> tuple[list[str], str]:
        """The free spares keeping a ready warm standby of the job's module (sorted), or
        ([], why none)."""
        free = self.jobs.spares(
            spec.spare_selector, open_incident_nodes=open_nodes, exclude=job.nodes
        )
        if not free:
            return [], f"no free spare (selector {spec.spare_selector or 'any'})"
        module = job_module(spec)
        ready: list[str] = []
        why: list[str] = []
        for node in free:
            unready = standby_unready(self.jobs, node, module=module)
            if unready is None:
                ready.append(node)
            else:
                why.append(unready)
        return ready, "; ".join(why)

    def _apply(
        self,
        ctx: ActionContext,
        job: JobRecord,
        decided: dict[str, Any],
        *,
        base: dict[str, Any],
        open_nodes: set[str],
    ) -> Outcome:
        """Move the job as decided (one transaction; already done on a re-run)."""
        crashed, spare = str(decided["crashed"]), str(decided["spare"])
        base[DECISION_KEY] = decided
        if spare not in job.nodes:
            spec = self.jobs.spec(job)
            free = self.jobs.spares(
                spec.spare_selector, open_incident_nodes=open_nodes, exclude=job.nodes
            )
            if crashed not in job.nodes or spare not in free:
                return self._skip(
                    job,
                    base=base,
                    reason=f"spare {spare} or {crashed}'s slot was taken before the swap",
                )
            nodes = [spare if n == crashed else n for n in job.nodes]
            placed = self.jobs.place(
                job.name,
                nodes=nodes,
                nproc_per_node=job.nproc_per_node,
                assign=[spare],
                release=[crashed],
                to_spares=[crashed],
            )
        else:
            placed = job
        if placed.state == JobState.CRASHED:
            self.jobs.set_state(
                job.name,
                JobState.RESTARTING,
                reason=f"a rank exited on {crashed}: the standby on {spare} takes its slot",
            )
        log.info(
            "event=standby_swapped job=%s crashed=%s spare=%s nodes=%s key=%s",
            job.name,
            crashed,
            spare,
            ",".join(placed.nodes),
            ctx.action.idempotency_key,
        )
        return Outcome(
            message=f"replaced {crashed} -> {spare} (its warm standby takes the rank that"
            f" exited); job {job.name} now on {', '.join(placed.nodes)}; {crashed} is a spare",
            output={
                **base,
                "nodes": list(placed.nodes),
                "mode": "spare",
                "replaced": {crashed: spare},
                "to_spares": [crashed],
            },
        )

    @staticmethod
    def _skip(job: JobRecord, *, base: dict[str, Any], reason: str) -> Outcome:
        log.info("event=standby_swap_skipped job=%s reason=%r", job.name, reason)
        return Outcome(
            message=f"job {job.name} needs no replacement: {', '.join(job.nodes)}; no standby"
            f" takes the rank that exited ({reason})",
            output={**base, "nodes": list(job.nodes), "mode": "none", SWAP_SKIPPED_KEY: reason},
        )
