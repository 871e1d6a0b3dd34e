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
  take a spare out of the reservation for the job; restart = `scontrol requeuehold`, wait
  until Slurm no longer runs the job anywhere (so the drained node is out of it), pin the
  job to the new node set (`nodelist=`), `release` and `starttime=now` (a requeued job would
  otherwise wait cred_expire), then wait for a step past the checkpoint.

Every Slurm call is an argument list with a timeout (controller.backends.slurm.cli); a failed
one fails the step with Slurm's own message (transient: retried, then paged).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from trainguard.bounds import clip_drain_reason
from trainguard.clock import Clock
from trainguard.controller.actions.base import (
    ActionContext,
    Outcome,
    PermanentError,
    TransientError,
)
from trainguard.controller.actions.drain import DrainState
from trainguard.controller.actions.jobsteps import CheckpointHandler, CollectStacksHandler
from trainguard.controller.actions.recovery import (
    PhaseObserver,
    ckpt_floor,
    first_step_past,
    recovery_phases,
    restart_baseline,
    restart_confirmed,
    rolled_back_in_process,
)
from trainguard.controller.backends.base import BackendDeps, Capability
from trainguard.controller.backends.config import SlurmBackendConfig
from trainguard.controller.backends.slurm.cli import (
    SlurmCli,
    SlurmCommands,
    SlurmError,
    SlurmJob,
    SlurmNode,
)
from trainguard.controller.jobs import JobManager
from trainguard.controller.livestate import LiveState
from trainguard.controller.records import JobRecord
from trainguard.controller.views import JobView

log = logging.getLogger("trainguard.controller.slurm")

REASON_PREFIX = "trainguard:"
_SLURM_JOB_NAME = re.compile(r"slurm-(\d+)")
_POLL_S = 0.5


def trainguard_reason(*, reason: str, rule: str | None, incident_id: int | None) -> str:
    """The Slurm drain reason trainguard writes (and later recognises as its own), cut to the
    drain reason bound: it is one argument of `scontrol`."""
    if rule and incident_id is not None:
        return clip_drain_reason(f"{REASON_PREFIX} {rule} incident {incident_id}")
    return clip_drain_reason(f"{REASON_PREFIX} {reason}")


def node_state_of(node: SlurmNode) -> tuple[str, str | None]:
    """trainguard's (state, drain reason) for a Slurm node: draining while Slurm still runs a
    job there, drained once it does not; a reason set by others says who set it."""
    if not (node.drain or node.down):
        return "active", None
    state = "draining" if node.drain and not node.down and node.busy else "drained"
    reason = node.reason or ("down" if node.down else "drained")
    if not reason.startswith(REASON_PREFIX):
        what = "down" if node.down else "drain"
        reason = f"{reason} (Slurm {what}, set by {node.reason_user or 'unknown'})"
    return state, reason


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
    ) -> None:
        self.config = config
        self.commands = commands
        self._live = live
        self._jobs = jobs
        self._clock = clock
        self._silent_after_s = node_silent_after_s
        self._spare_wait_s = spare_wait_s
        self._progress_timeout_s = progress_timeout_s
        self._open_incident_nodes = open_incident_nodes
        self._observe = observe
        self._to_slurm = dict(config.node_names)
        self._to_agent = {v: k for k, v in config.node_names.items()}
        self._checkpoint = CheckpointHandler(jobs)
        self._stacks = CollectStacksHandler(jobs)
        self._lock = threading.RLock()
        self._nodes: dict[str, SlurmNode] = {}  # by Slurm name
        self._slurm_jobs: dict[str, SlurmJob] = {}  # by id
        self._spares: tuple[str, ...] | None = None  # Slurm names; None: never read
        self._names: dict[str, str] = {}  # Slurm job id -> the job name its heartbeats carry
        self._acted: set[str] = set()  # Slurm job ids a step worked on (shown while they live)
        # job id -> the nodes (Slurm names) it last ran on: squeue shows none once Slurm
        # requeued it (a node failure), and a replacement starts from that set
        self._allocations: dict[str, tuple[str, ...]] = {}
        # heartbeat job name -> the agent nodes its Slurm job runs on (`job_nodes`): replaced
        # whole by each refresh, read without the lock by the report path
        self._scope_nodes: dict[str, frozenset[str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_sync_error: str | None = None

    # --- names ------------------------------------------------------------------------------

    def slurm_name(self, node: str) -> str:
        return self._to_slurm.get(node, node)

    def agent_name(self, node: str) -> str:
        return self._to_agent.get(node, node)

    # --- reading Slurm ----------------------------------------------------------------------

    @contextmanager
    def _slurm(self, what: str) -> Iterator[None]:
        """Slurm's failure as the step's: transient (retried, then paged) or permanent."""
        try:
            yield
        except SlurmError as e:
            log.warning("event=slurm_command_failed what=%s error=%s", what, e)
            if e.transient:
                raise TransientError(f"{what}: {e}") from None
            raise PermanentError(f"{what}: {e}") from None

    def refresh(self) -> None:
        """Read nodes, jobs and the spare reservation from Slurm; mirror the nodes into
        trainguard's node table. Raises SlurmError."""
        nodes = self.commands.nodes()
        jobs = self.commands.jobs()
        spares = self.commands.reservation_nodes(self.config.spare_reservation)
        with self._lock:
            self._nodes = nodes
            self._slurm_jobs = jobs
            self._spares = spares or ()
            for job in jobs.values():
                if job.state == "RUNNING" and job.nodes:
                    self._allocations[job.id] = job.nodes
            for gone in set(self._allocations) - set(jobs):
                del self._allocations[gone]
            self._learn_names()
            self._scope_nodes = self._job_scopes()
        self._mirror()

    def _learn_names(self) -> None:
        """Map the job names seen in heartbeats to Slurm job ids. Caller holds the lock."""
        with self._live.lock:
            seen = {name: set(s.nodes) for name, s in self._live.jobs_seen.items()}
        for name, nodes in seen.items():
            m = _SLURM_JOB_NAME.fullmatch(name)
            if m is not None:
                self._names[m.group(1)] = name
                continue
            slurm_nodes = {self.slurm_name(n) for n in nodes}
            for job in self._slurm_jobs.values():
                if job.name == name and job.active and slurm_nodes & set(job.nodes):
                    self._names[job.id] = name

    def _job_scopes(self) -> dict[str, frozenset[str]]:
        """Heartbeat job name -> agent nodes, for each Slurm job not finished: its allocation,
        else the one it last ran on, else the nodes it is pinned to. Caller holds the lock."""
        out: dict[str, frozenset[str]] = {}
        for job in self._slurm_jobs.values():
            if job.finished:
                continue
            if job.state == "RUNNING" and job.nodes:
                slurm_nodes: Sequence[str] = job.nodes
            else:
                slurm_nodes = self._allocations.get(job.id) or job.required_nodes or ()
            nodes = frozenset(self.agent_name(n) for n in slurm_nodes)
            for name in {f"slurm-{job.id}", self._names.get(job.id)}:
                if name is not None:
                    out[name] = out.get(name, frozenset()) | nodes
        return out

    def job_nodes(self, job: str) -> frozenset[str] | None:
        return self._scope_nodes.get(job)  # no lock: the report path holds the live state's

    def _mirror(self) -> None:
        """Slurm's drain/down state and reason -> the node table; the reservation -> roles."""
        with self._lock:
            nodes = dict(self._nodes)
            spares = set(self._spares or ())
            have_spares = self._spares is not None
        for rec in self._live.all_nodes():
            sn = nodes.get(self.slurm_name(rec.name))
            if sn is None:
                continue  # an agent on a host Slurm does not schedule
            state, reason = node_state_of(sn)
            if (rec.state, rec.drain_reason) != (state, reason):
                self._live.set_node_state(rec.name, state, reason=reason)
            role = "spare" if sn.name in spares else "active"
            if have_spares and rec.role != role:
                with self._live.lock:
                    self._live.put_node(self._live.store.nodes.update(rec.name, role=role))
                log.info("event=node_role node=%s role=%s source=slurm", rec.name, role)

    def _fresh(self) -> None:
        with self._slurm("reading Slurm (sinfo/squeue/scontrol)"):
            self.refresh()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._sync_loop, name="slurm-sync", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.command_timeout_s * 3 + 1)

    def _sync_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
                if self.last_sync_error is not None:
                    log.info("event=slurm_sync_ok")
                self.last_sync_error = None
            except SlurmError as e:
                if str(e) != self.last_sync_error:
                    log.warning("event=slurm_sync_failed error=%s", e)
                self.last_sync_error = str(e)
            except Exception:  # the sync must outlive a bug in one round
                log.exception("event=slurm_sync_error")
            self._stop.wait(self.config.sync_interval_s)

    # --- nodes ------------------------------------------------------------------------------

    def _silent(self, node: str) -> bool:
        age = self._live.report_age_s(node)
        return age is None or age > self._silent_after_s

    def drain(
        self,
        node: str,
        *,
        reason: str,
        key: str,
        rule: str | None = None,
        incident_id: int | None = None,
    ) -> tuple[DrainState, dict[str, Any]]:
        sname = self.slurm_name(node)
        text = trainguard_reason(reason=reason, rule=rule, incident_id=incident_id)
        with self._lock:
            self._fresh()
            current = self._nodes.get(sname)
            if (
                current is not None
                and (current.drain or current.down)
                and not current.reason.startswith(REASON_PREFIX)
            ):
                # drained by someone else: leave their reason (and their undrain) alone
                _, why = node_state_of(current)
                return "drained", {"note": f"already out of service in Slurm: {why}"}
            down = self.config.down_silent_nodes and self._silent(node)
            with self._slurm(f"draining {node} in Slurm"):
                self.commands.drain(sname, reason=text, down=down)
                self.refresh()
            now_node = self._nodes.get(sname)
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
        sname = self.slurm_name(node)
        with self._lock:
            self._fresh()
            current = self._nodes.get(sname)
            if current is not None and not (current.drain or current.down):
                self._live.set_node_state(node, "active", reason=None)
                return
            if current is not None and not current.reason.startswith(REASON_PREFIX) and not force:
                _, why = node_state_of(current)
                raise PermanentError(
                    f"{node} was taken out of service in Slurm by someone else ({why});"
                    " trainguard undoes only its own drains (undrain with force to override)"
                )
            with self._slurm(f"resuming {node} in Slurm"):
                self.commands.resume(sname)
                self.refresh()
        log.info("event=slurm_resume node=%s slurm_node=%s force=%s", node, sname, force)

    def _usable(self, node: str) -> bool:
        """The agent reports and Slurm may schedule on the node."""
        sn = self._nodes.get(self.slurm_name(node))
        return sn is not None and sn.usable and not self._silent(node)

    # --- jobs -------------------------------------------------------------------------------

    def job_name(self, job_id: str) -> str:
        with self._lock:
            return self._names.get(job_id, f"slurm-{job_id}")

    def job_id(self, name: str) -> str | None:
        m = _SLURM_JOB_NAME.fullmatch(name)
        if m is not None:
            return m.group(1)
        with self._lock:
            for job_id, known in self._names.items():
                if known == name:
                    return job_id
        return None

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
            if isinstance(name, str) and name and (jid := self.job_id(name)) is not None:
                return jid
        node = ctx.params.get("node")
        if not isinstance(node, str) or not node:
            return None
        sname = self.slurm_name(node)
        with self._lock:
            for job in self._slurm_jobs.values():
                if job.active and sname in job.nodes:
                    return job.id
        name = self._live.node_job(node)
        return self.job_id(name) if name else None

    def _job(self, job_id: str) -> SlurmJob:
        with self._lock:
            job = self._slurm_jobs.get(job_id)
        if job is None:
            raise PermanentError(f"Slurm job {job_id} is not in squeue (gone or purged)")
        return job

    def _agent_nodes(self, job: SlurmJob) -> list[str]:
        return [self.agent_name(n) for n in job.nodes]

    def _record(self, job_id: str) -> JobRecord:
        """The Slurm job as a job-table record, for the step handlers shared with torchrun."""
        job = self._job(job_id)
        name = self.job_name(job_id)
        nodes = tuple(self._agent_nodes(job))
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
        self._fresh()
        job_id = self._resolve(ctx)
        if job_id is None:
            return self._no_job(ctx)
        self._acted.add(job_id)
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
        self._fresh()
        job_id = self._resolve(ctx)
        if job_id is None:
            return self._no_job(ctx)
        record = self._record(job_id)
        return self._with_id(self._stacks.run_job(ctx, record, dict(ctx.progress)), job_id)

    def _bad(self, job: SlurmJob, nodes: list[str], sick: str | None) -> list[str]:
        return [n for n in nodes if n == sick or not self._usable(n)]

    def _job_nodes(self, job: SlurmJob) -> list[str]:
        """The job's node set: its allocation while it runs, else the one it last ran on,
        else the nodes it was pinned to, else where its ranks reported from."""
        if job.state == "RUNNING" and job.nodes:
            return self._agent_nodes(job)
        # completing: squeue shows only the nodes still cleaning up
        with self._lock:
            last = self._allocations.get(job.id)
        if last:
            return [self.agent_name(n) for n in last]
        if job.required_nodes:
            return [self.agent_name(n) for n in job.required_nodes]
        with self._live.lock:
            seen = self._live.jobs_seen.get(self.job_name(job.id))
            return sorted(seen.nodes) if seen is not None else []

    def _spare_candidates(self, exclude: set[str]) -> list[str]:
        """Spares (agent names) a job may take now: in the reservation, idle and usable in
        Slurm, their agent healthy with no open incident."""
        open_nodes = self._open_incident_nodes()
        with self._lock:
            spares = list(self._spares or ())
            nodes = dict(self._nodes)
        out = []
        for sname in spares:
            node = self.agent_name(sname)
            sn = nodes.get(sname)
            if node in exclude or sn is None or not sn.usable or sn.busy:
                continue
            if self._silent(node) or node in open_nodes:
                continue
            out.append(node)
        return sorted(out)

    def _take_spares(self, job: SlurmJob, *, bad: list[str], nodes: list[str]) -> dict[str, str]:
        """Swap each bad node for a spare taken out of the reservation; {} when too few."""
        spares = self._spare_candidates(exclude=set(nodes))
        if len(spares) < len(bad):
            return {}
        swap = dict(zip(bad, spares, strict=False))
        with self._lock:
            left = [s for s in (self._spares or ()) if self.agent_name(s) not in swap.values()]
        with self._slurm(f"taking {', '.join(swap.values())} out of the spare reservation"):
            self.commands.set_reservation_nodes(self.config.spare_reservation, left)
            self.refresh()
        log.info(
            "event=slurm_spare_taken job=%s swap=%s reservation_left=%s",
            job.id,
            ",".join(f"{b}->{s}" for b, s in swap.items()),
            ",".join(left) or "-",
        )
        return swap

    def replace(self, ctx: ActionContext) -> Outcome:
        if "nodes" in ctx.progress and "slurm_job_id" in ctx.progress:
            return Outcome(message="already replaced", output=dict(ctx.progress))
        self._fresh()
        job_id = self._resolve(ctx)
        if job_id is None:
            return self._no_job(ctx)
        self._acted.add(job_id)
        job = self._job(job_id)
        started_at = float(ctx.progress.get("started_at", ctx.now))
        base = {"job": self.job_name(job_id), "slurm_job_id": job_id, "started_at": started_at}
        nodes = self._job_nodes(job)
        sick = ctx.params.get("node") if isinstance(ctx.params.get("node"), str) else None
        bad = self._bad(job, nodes, sick)
        if not bad:
            return Outcome(
                message=f"Slurm job {job_id} needs no replacement: {', '.join(nodes)}",
                output={**base, "nodes": nodes, "mode": "none"},
            )
        swap = self._take_spares(job, bad=bad, nodes=nodes)
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
        progress = dict(ctx.progress)
        phase = progress.get("phase")
        if phase is None:
            return self._requeue(ctx, progress, same_nodes=same_nodes)
        self._fresh()
        job = self._job(str(progress["slurm_job_id"]))
        if phase == "requeued":
            return self._release(ctx, job, progress)
        return self._confirm(ctx, job, progress)

    def _requeue(
        self, ctx: ActionContext, progress: dict[str, Any], *, same_nodes: bool
    ) -> Outcome:
        self._fresh()
        job_id = self._resolve(ctx)
        if job_id is None:
            return self._no_job(ctx)
        self._acted.add(job_id)
        job = self._job(job_id)
        name = self.job_name(job_id)
        nodes = self._job_nodes(job)
        target = ctx.previous.get("replace", {}).get("nodes")
        if not isinstance(target, list) or not target:
            target = list(nodes)
            if not same_nodes:
                sick = ctx.params.get("node") if isinstance(ctx.params.get("node"), str) else None
                bad = self._bad(job, nodes, sick)
                if bad:
                    swap = self._take_spares(job, bad=bad, nodes=nodes)
                    if not swap:
                        raise PermanentError(
                            f"Slurm job {job_id} cannot restart: {', '.join(bad)} unusable and"
                            f" no spare in reservation {self.config.spare_reservation}"
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
        target_slurm = {self.slurm_name(n) for n in target}
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
                poll_after_s=_POLL_S,
            )
        with self._slurm(f"requeueing Slurm job {job_id}"):
            if job.state == "PENDING":
                self.commands.hold(job_id)
                verb = "held (it was pending)"
            elif job.state == "COMPLETING":
                # Slurm is taking it down already (its own requeue after a node failure):
                # hold it once it is pending
                verb = "completing (Slurm is ending it)"
                progress["hold_when_pending"] = True
            else:
                self.commands.requeue_hold(job_id)
                verb = f"requeued (held) from {job.state.lower()}"
        log.info("event=slurm_requeue job=%s slurm_job=%s from=%s", name, job_id, job.state)
        return Outcome(
            message=f"Slurm job {job_id} {verb}; waiting until Slurm no longer runs it, then"
            f" releasing it on {', '.join(target)}",
            output=progress,
            done=False,
            poll_after_s=_POLL_S,
        )

    def _release(self, ctx: ActionContext, job: SlurmJob, progress: dict[str, Any]) -> Outcome:
        waited_s = ctx.now - float(progress["stop_sent_at"])
        if job.state != "PENDING":
            if job.finished:
                # requeuehold of a finished job leaves it pending; one that finished after
                # the requeue (a race with its own exit) is requeued again
                with self._slurm(f"requeueing Slurm job {job.id}"):
                    self.commands.requeue_hold(job.id)
            if waited_s > self.config.requeue_timeout_s:
                raise PermanentError(
                    f"Slurm job {job.id} still {job.state} on {job_nodes_text(job)}"
                    f" {waited_s:.0f} s after the requeue ({job.state_reason})"
                )
            return Outcome(
                message=f"Slurm job {job.id} is {job.state.lower()} on {job_nodes_text(job)};"
                " waiting until Slurm no longer runs it",
                output=progress,
                done=False,
                poll_after_s=_POLL_S,
            )
        target = [self.slurm_name(n) for n in progress["nodes"]]
        if job.node_count and len(target) != job.node_count:
            # (pending, squeue counts the nodes the job asks for)
            raise PermanentError(
                f"Slurm job {job.id} needs {job.node_count} node(s); the new set"
                f" {', '.join(target) or '(none)'} has {len(target)}"
            )
        with self._slurm(f"releasing Slurm job {job.id} on {','.join(target)}"):
            if progress.pop("hold_when_pending", False):
                self.commands.hold(job.id)
            self.commands.set_job_nodes(job.id, target)
            self.commands.release(job.id)
            self.commands.start_now(job.id)
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
            poll_after_s=_POLL_S,
        )

    def _confirm(self, ctx: ActionContext, job: SlurmJob, progress: dict[str, Any]) -> Outcome:
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
                poll_after_s=_POLL_S,
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

    def stop(self, ctx: ActionContext) -> Outcome:
        self._fresh()
        job_id = self._resolve(ctx)
        if job_id is None:
            return self._no_job(ctx)
        job = self._job(job_id)
        if "sent_at" not in ctx.progress:
            with self._slurm(f"cancelling Slurm job {job_id}"):
                self.commands.cancel(job_id)
            progress = {"sent_at": ctx.now, "slurm_job_id": job_id, "job": self.job_name(job_id)}
        else:
            progress = dict(ctx.progress)
        if job.finished or (job.state == "PENDING" and "sent_at" in ctx.progress):
            return Outcome(message=f"Slurm job {job_id} {job.state.lower()}", output=progress)
        return Outcome(
            message=f"cancelling Slurm job {job_id} ({job.state.lower()})",
            output=progress,
            done=False,
            poll_after_s=_POLL_S,
        )

    # --- views ------------------------------------------------------------------------------

    def job_views(self, *, now: float) -> list[JobView]:
        with self._lock:
            jobs = [
                j for j in self._slurm_jobs.values() if j.id in self._names or j.id in self._acted
            ]
        views = []
        for job in jobs:
            name = self.job_name(job.id)
            step, ckpt = self._jobs.latest_steps(name)
            ranks = self._jobs.ranks(name)
            views.append(
                JobView(
                    name=name,
                    state=job.state.lower(),
                    nodes=tuple(self._job_nodes(job)),
                    attempt=job.restart_cnt,
                    last_step=step,
                    ckpt_step=ckpt,
                    restarts=job.restart_cnt,
                    ranks=len(ranks),
                    world_size=max((r.world_size for _, r in ranks), default=0),
                    state_reason=job.state_reason if job.state_reason != "None" else "",
                    started_at=job.start_time or None,
                    scheduler="slurm",
                    scheduler_job_id=job.id,
                )
            )
        return views


def job_nodes_text(job: SlurmJob) -> str:
    return ",".join(job.nodes) or "no nodes"


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
    )


__all__ = ["REASON_PREFIX", "SlurmBackend", "build", "node_state_of", "trainguard_reason"]
