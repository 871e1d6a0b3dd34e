"""Jobs: the job spec, the job table's lifecycle, the live view of each job's ranks and
processes (from agent reports), ETTR accounting, and the operations the remediation steps
(controller.actions.jobsteps) use: spare selection, placement, attempts and commands.

States (controller.jobstate.JobState; every change is checked against its TRANSITIONS):
pending (submitted) -> starting (start_job sent for an attempt) -> running (a rank of the
attempt reports) -> restarting (a remediation or operator restart is under way) ->
starting ...; crashed (a process exited non-zero without being asked: the
`job_process_failed` rule restarts it); waiting (no spare yet); stopping -> stopped;
completed (every node's processes exited 0 unasked); failed (gave up: max_restarts, no spare,
a restart that never progressed); held (the restart-loop breaker: crash-looped without
checkpoint progress, controller.actions.restartloop).

ETTR = productive_s / (end or now - started_at): productive time accrues between two samples
while the job is running and its highest step advanced past every step it had reached
before (re-done steps after a restore are not productive).

Node presence, as the steps see it (`presence`): reporting, silent, or unknown: after the
controller (re)starts, a node it has not heard from yet is unknown for up to
jobs.resume_grace_s (its stored report age says nothing about whether it is alive now), and
the steps wait for it instead of guessing. Fencing (`attempt_fence`): one live attempt per
job, so attempt N+1 starts only when every node of attempt N confirmed its stop or has been
silent past jobs.attempt_lease_s; a node that reports an older attempt than the job's is told
so in the report's response (`stale_attempts`).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from trainguard.bounds import MAX_RANKS_PER_REPORT, bad_name_reason
from trainguard.command_args import CommandArgs, check_job_command
from trainguard.controller.actionkinds import ActionKind
from trainguard.controller.ckptspec import CheckpointSpec, check_env_checkpoint_settings
from trainguard.controller.config import JobsConfig
from trainguard.controller.jobstate import JobState, check_job_transition
from trainguard.controller.records import CommandRecord, JobRecord, NodeRecord
from trainguard.controller.recoveryspec import RecoverySpec
from trainguard.controller.store import Store
from trainguard.controller.views import JobView
from trainguard.protocol import (
    Event,
    EventKind,
    JobProcess,
    RankState,
    Report,
    StandbyState,
    TrainerEdge,
    to_wire,
)
from trainguard.strict import Invalid, build

log = logging.getLogger("trainguard.controller.jobs")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# The agent sets these for every launch (agent.jobs.RESERVED_ENV); one more is ours: the
# rollback's skip window, set by the controller on a rollback restart only.
RESUME_SKIP_ENV = "TRAINGUARD_RESUME_SKIP_BATCHES"
_RESERVED_ENV = frozenset(
    {
        "TRAINGUARD_JOB",
        "TRAINGUARD_ATTEMPT",
        "TRAINGUARD_NODE",
        "TRAINGUARD_AGENT_SOCKET",
        "TRAINGUARD_CONTROL_DIR",
        "TRAINGUARD_CKPT_DIR",
        "TRAINGUARD_LAUNCH_ID",
        RESUME_SKIP_ENV,
    }
)
# A sample gap longer than this is not counted as productive even if steps advanced (the
# controller was down or the job was not observed).
_MAX_PRODUCTIVE_GAP_S = 10.0
# JobSpec.shrink: "pack" keeps the world size (more processes per node), "world" runs fewer
# ranks and grows back when a spare is free.
SHRINK_MODES = ("pack", "world")
# How a step sees a node: "unknown" only after a controller (re)start, until the node reports
# or jobs.resume_grace_s passes.
Presence = Literal["reporting", "silent", "unknown"]
# JobProcess states in which processes of an attempt may still run
_LIVE_PROCESS_STATES = frozenset({"starting", "running", "stopping"})


@dataclass(frozen=True)
class JobSpec:
    """A training job: what to run, where, and how it may be remediated.

    World size = len(nodes) * nproc_per_node. With too few spares, `shrink` says how the job
    may run on fewer nodes (at least `min_nodes`): "pack" keeps the world size by running
    more processes per node, which needs `max_nproc_per_node` headroom (e.g. GPUs per node);
    "world" runs fewer ranks (the trainer resumes a checkpoint at another world size) and
    grows back to the full size when a spare is free again.
    """

    name: str
    # the training program and its arguments, or "-m", a module and its arguments (torchrun
    # runs it: check_job_command)
    command: list[str]
    nodes: list[str]  # initial placement, in node-rank order
    nproc_per_node: int = 1
    min_nodes: int | None = None  # fewest nodes the job may run on; None = len(nodes)
    max_nproc_per_node: int | None = None  # per-node capacity for a shrink; None = nproc
    spare_selector: dict[str, str] = field(default_factory=dict)  # labels a spare must have
    ckpt_dir: str | None = None  # exported to ranks as TRAINGUARD_CKPT_DIR
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 10  # controller restarts (any cause) before the job is failed
    rdzv_port: int | None = None  # None: jobs.rdzv_port_base + attempt % rdzv_port_span
    # Batches a controller rollback skips after the restored checkpoint; None = just past the
    # step that went non-finite (nan step - checkpoint step).
    rollback_skip_batches: int | None = None
    spare_wait_s: float | None = None  # None: jobs.spare_wait_s
    cwd: str | None = None
    python: str | None = None
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    shrink: str = "pack"  # SHRINK_MODES: how the job may run on fewer nodes
    # the periodic interval (fixed or auto) and retention tiers (controller.ckptspec)
    checkpoint: CheckpointSpec | None = None
    # how a lost node is recovered: in process first, when the loop can rejoin
    # (controller.recoveryspec)
    recovery: RecoverySpec = field(default_factory=RecoverySpec)

    def __post_init__(self) -> None:
        bad = bad_name_reason(self.name)
        if bad is not None:
            raise Invalid("name", bad)
        check_job_command(self.command)
        if not self.nodes:
            raise Invalid("nodes", "must name at least one node")
        for i, node in enumerate(self.nodes):
            bad = bad_name_reason(node)
            if bad is not None:
                raise Invalid(f"nodes[{i}]", bad)
        if len(set(self.nodes)) != len(self.nodes):
            raise Invalid("nodes", "must be distinct node names")
        if not 1 <= self.nproc_per_node <= MAX_RANKS_PER_REPORT:
            raise Invalid(
                "nproc_per_node",
                f"must be in [1, {MAX_RANKS_PER_REPORT}], got {self.nproc_per_node}",
            )
        if self.min_nodes is not None and not 1 <= self.min_nodes <= len(self.nodes):
            raise Invalid("min_nodes", f"must be within 1..{len(self.nodes)}, got {self.min_nodes}")
        if self.shrink not in SHRINK_MODES:
            modes = ", ".join(SHRINK_MODES)
            raise Invalid("shrink", f"must be one of {modes}, got {self.shrink!r}")
        if self.shrink == "world" and self.floor >= len(self.nodes):
            raise Invalid(
                "shrink", "'world' needs min_nodes below the number of nodes (the fewest to run on)"
            )
        if self.max_nproc_per_node is not None and self.max_nproc_per_node < self.nproc_per_node:
            raise Invalid("max_nproc_per_node", "must be >= nproc_per_node")
        if self.max_restarts < 0:
            raise Invalid("max_restarts", f"must be >= 0, got {self.max_restarts}")
        if self.rdzv_port is not None and not 1 <= self.rdzv_port <= 65535:
            raise Invalid("rdzv_port", f"must be a TCP port, got {self.rdzv_port}")
        if self.rollback_skip_batches is not None and self.rollback_skip_batches < 0:
            raise Invalid("rollback_skip_batches", "must be >= 0")
        if self.spare_wait_s is not None and not (
            math.isfinite(self.spare_wait_s) and self.spare_wait_s >= 0
        ):
            raise Invalid("spare_wait_s", "must be a finite number >= 0")
        for name, value in self.env.items():
            if not _ENV_NAME.fullmatch(name):
                raise Invalid(f"env.{name}", "not a valid environment variable name")
            if name in _RESERVED_ENV:
                raise Invalid(f"env.{name}", "is set by trainguard (use ckpt_dir for the dir)")
            if "\0" in value:
                raise Invalid(f"env.{name}", "contains a NUL byte")
        if "is_host" in self.rdzv_conf:
            raise Invalid("rdzv_conf.is_host", "the controller chooses the rendezvous host")
        check_env_checkpoint_settings(self.env, self.checkpoint)

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc_per_node

    @property
    def floor(self) -> int:
        return self.min_nodes if self.min_nodes is not None else len(self.nodes)

    @property
    def capacity_per_node(self) -> int:
        return self.max_nproc_per_node or self.nproc_per_node


def shrink_plan(*, world_size: int, healthy: int, min_nodes: int, max_nproc: int) -> int | None:
    """The largest node count in [min_nodes, healthy] that runs `world_size` ranks with equal
    processes per node within `max_nproc`; None when there is none (no shrink)."""
    for n in range(healthy, min_nodes - 1, -1):
        if n >= 1 and world_size % n == 0 and world_size // n <= max_nproc:
            return n
    return None


class NodeAccess(Protocol):
    """What the job manager needs from the controller's node inventory and command queue."""

    def node_record(self, node: str) -> NodeRecord | None: ...

    def all_nodes(self) -> list[NodeRecord]: ...

    def report_age_s(self, node: str) -> float | None: ...

    def queue_command(self, node: str, args: CommandArgs, *, command_id: str) -> None: ...

    def command_status(self, command_id: str) -> CommandRecord | None: ...

    def refresh_node(self, node: str) -> None:
        """Re-read a node row the job manager changed in the store."""


def _checkpoint_cost_s(data: Mapping[str, Any]) -> float | None:
    """A commit event's cost to the loop: `block_s` (an async save's snapshot), else
    `duration_s` (a trainer that does not say how long it blocked: the save in full)."""
    for key in ("block_s", "duration_s"):
        value = data.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            if math.isfinite(value) and value >= 0:
                return float(value)
    return None


@dataclass
class _Live:
    """What the agents report now about one job (in memory; rebuilt from reports)."""

    ranks: dict[str, tuple[RankState, ...]] = field(default_factory=dict)  # node -> ranks
    procs: dict[str, JobProcess] = field(default_factory=dict)  # node -> its launch
    exits: list[dict[str, Any]] = field(default_factory=list)  # recent job_exit events
    nan_steps: list[tuple[float, int]] = field(default_factory=list)  # (ts, step)
    rollbacks: list[tuple[float, int]] = field(default_factory=list)  # (ts, to_step)
    ckpt_failed: list[tuple[float, str]] = field(default_factory=list)  # (ts, request_id)
    # (step, s): what each committed checkpoint cost the loop, per rank's commit event
    ckpt_costs: list[tuple[int, float]] = field(default_factory=list)
    # seconds the job's saves held its loop since this controller started (per step, the
    # slowest rank's): the checkpoint overhead of controller.failurecost
    ckpt_block_total_s: float = 0.0
    # the highest step and newest checkpoint any rank reported, kept after the ranks are
    # gone: a job outside the job table (Slurm) has no stored values to fall back on
    top_step: int | None = None
    top_ckpt: int | None = None
    # node -> the attempts its latest report shows live processes of (a node may report
    # more than one attempt of a job: `procs` keeps one)
    live_attempts: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Fence:
    """Where the stop of attempt `attempt` stands on the nodes that ran it (`attempt_fence`).

    stopped: reported since the stop, no process of the attempt (or an older one) alive.
    lapsed: silent past jobs.attempt_lease_s (dead or cut off: safe, see docs/jobs.md), or
    silent and not a node that ran the attempt (it is replaced, not waited for).
    running: still report a live process of the attempt (or an older one).
    unconfirmed: reporting, but no report since the stop yet; unknown: not heard from since
    the controller started (within jobs.resume_grace_s); leased: silent, within the lease.
    overdue: the running nodes that have been reporting for stop_grace_s + stop_timeout_s
    since the stop (or since they came back), so they had the stop and did not obey it.
    """

    attempt: int
    stopped: tuple[str, ...] = ()
    lapsed: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    unconfirmed: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    leased: tuple[str, ...] = ()
    overdue: tuple[str, ...] = ()

    @property
    def clear(self) -> bool:
        """Attempt attempt+1 may start: every node stopped or lapsed."""
        return not (self.running or self.unconfirmed or self.unknown or self.leased)

    def waiting_text(self) -> str:
        parts = []
        if self.running:
            parts.append(f"attempt {self.attempt} to stop on {', '.join(self.running)}")
        if self.unconfirmed:
            parts.append(f"a report since the stop from {', '.join(self.unconfirmed)}")
        if self.unknown:
            parts.append(f"{', '.join(self.unknown)} to report again after the controller restart")
        if self.leased:
            parts.append(f"the lease of silent {', '.join(self.leased)} to run out (or a report)")
        return "; ".join(parts)


_KEEP_EVENTS = 64


def stored_state(job: JobRecord) -> JobState:
    """A job-table record's state as the enum (every state the table stores is one)."""
    state = JobState.parse(job.state)
    if state is None:
        raise ValueError(f"job {job.name}: stored state {job.state!r} is not a job state")
    return state


def _active(job: JobRecord) -> bool:
    state = JobState.parse(job.state)
    return state is not None and state.active


class JobManager:
    """The job table plus the live view; thread-safe (report thread, tick, action worker)."""

    def __init__(
        self,
        *,
        store: Store,
        nodes: NodeAccess,
        config: JobsConfig,
        node_silent_after_s: float,
        clock_now: Callable[[], float],
        on_state: Callable[[str, tuple[str, ...], str], None] = lambda job, nodes, state: None,
    ) -> None:
        self.store = store
        self.nodes = nodes
        self.config = config
        self.node_silent_after_s = node_silent_after_s
        self._now = clock_now
        self._on_state = on_state
        self._lock = threading.RLock()
        self._live: dict[str, _Live] = {}
        self._jobs: dict[str, JobRecord] = {j.name: j for j in store.jobs.all()}
        self._node_job_ranks: dict[str, set[str]] = {}  # node -> jobs it reported ranks for
        self._node_procs: dict[str, set[str]] = {}  # node -> jobs it reported processes of
        # presence: this process's start, and when the controller last heard any node before
        # it (the newest stored report): a node silent already then is silent now
        self.started_at = clock_now()
        stored = [n.last_report_at for n in nodes.all_nodes() if n.last_report_at]
        self._horizon: float | None = max(stored) if stored else None
        # node -> (last report to this process, when it began reporting after a gap)
        self._heard: dict[str, tuple[float, float]] = {}
        # node -> its warm standby as its latest report says (controller.actions.inprocess)
        self._standby: dict[str, StandbyState] = {}
        for j in self._jobs.values():
            self._on_state(j.name, j.nodes, j.state)

    # --- the job table ------------------------------------------------------------------------

    def get(self, name: str) -> JobRecord | None:
        with self._lock:
            return self._jobs.get(name)

    def records(self) -> list[JobRecord]:
        with self._lock:
            return [self._jobs[n] for n in sorted(self._jobs)]

    def spec(self, job: JobRecord) -> JobSpec:
        return build(JobSpec, job.spec, source=f"job {job.name}")

    def submit(self, spec: JobSpec, *, now: float) -> JobRecord | None:
        """Store a new job (pending); None if a job of that name is still active."""
        rec = self.store.jobs.submit(
            spec.name,
            spec=to_wire(spec),
            nodes=spec.nodes,
            nproc_per_node=spec.nproc_per_node,
            min_nodes=spec.floor,
            ts=now,
            replace_states=tuple(s.value for s in JobState if s.finished),
        )
        if rec is not None:
            self._remember(rec)
        return rec

    def _remember(self, rec: JobRecord) -> JobRecord:
        with self._lock:
            old = self._jobs.get(rec.name)
            self._jobs[rec.name] = rec
        if old is None or (old.state, old.nodes) != (rec.state, rec.nodes):
            self._on_state(rec.name, rec.nodes, rec.state)
        return rec

    def set_state(self, name: str, state: JobState, *, reason: str = "") -> JobRecord:
        """Move the job to `state` (InvalidJobTransition when the table does not allow the
        move from its current state; KeyError for an unknown job)."""
        wanted = JobState(state)
        current = self.get(name)
        if current is None:
            raise KeyError(name)
        check_job_transition(name, stored_state(current), wanted)
        now = self._now()
        changes: dict[str, Any] = {"state": wanted.value, "state_reason": reason}
        if wanted.finished:
            changes["ended_at"] = now
            # the ranks' last steps, which the tick (only for live jobs) would never store:
            # a job that ends between two ticks keeps where it ended, not where it was
            step, ckpt = self.latest_steps(name)
            if step is not None and step != current.last_step:
                changes["last_step"] = step
            if ckpt is not None and ckpt != current.ckpt_step:
                changes["ckpt_step"] = ckpt
        if wanted is JobState.RUNNING and current.started_at is None:
            # the restart step can see the first attempt train before the tick does
            changes["started_at"] = now
        rec = self._remember(self.store.jobs.update(name, **changes))
        log.info(
            "event=job_state job=%s state=%s attempt=%d reason=%s",
            name,
            wanted.value,
            rec.attempt,
            reason or "-",
        )
        return rec

    def begin_attempt(
        self, name: str, *, key: str, counts_restart: bool = True
    ) -> tuple[JobRecord, bool]:
        job = self.get(name)
        spec_port = job.spec.get("rdzv_port") if job is not None else None
        if job is not None and job.attempt_key != key:
            # the store moves the job to starting when this key begins a new attempt
            check_job_transition(name, stored_state(job), JobState.STARTING)

        def port(attempt: int) -> int:
            if isinstance(spec_port, int):
                return spec_port
            return self.config.rdzv_port_base + attempt % self.config.rdzv_port_span

        rec, began = self.store.jobs.begin_attempt(
            name, key=key, rdzv_port=port, ts=self._now(), counts_restart=counts_restart
        )
        self._remember(rec)
        if began:
            log.info(
                "event=job_attempt job=%s attempt=%d nodes=%s key=%s",
                name,
                rec.attempt,
                ",".join(rec.attempt_nodes),
                key,
            )
        return rec, began

    def place(
        self,
        name: str,
        *,
        nodes: Sequence[str],
        nproc_per_node: int,
        assign: Sequence[str],
        release: Sequence[str],
        to_spares: Sequence[str] = (),
    ) -> JobRecord:
        """Move the job to `nodes` (controller.store.jobs.set_placement): `assign` join it,
        `release` leave it, those of them in `to_spares` joining the spare pool."""
        rec = self.store.jobs.set_placement(
            name,
            nodes=nodes,
            nproc_per_node=nproc_per_node,
            assign=assign,
            release=release,
            to_spares=to_spares,
        )
        for n in (*assign, *release):
            self.nodes.refresh_node(n)
        return self._remember(rec)

    def job_of_node(self, node: str) -> JobRecord | None:
        """The active job placed on (or still running on) `node`."""
        with self._lock:
            for j in self._jobs.values():
                if _active(j) and (node in j.nodes or node in j.attempt_nodes):
                    return j
            for name in self._node_job_ranks.get(node, ()):
                found = self._jobs.get(name)
                if found is not None and _active(found):
                    return found
        return None

    def resolve(self, params: dict[str, Any]) -> JobRecord | None:
        """The job a step is about: params["job"], else the job on params["node"]."""
        name = params.get("job")
        if isinstance(name, str) and name:
            return self.get(name)
        node = params.get("node")
        return self.job_of_node(node) if isinstance(node, str) and node else None

    # --- nodes --------------------------------------------------------------------------------

    def presence(self, node: str) -> Presence:
        """reporting (a report within node_silent_after_s), silent, or unknown: not heard
        from since this controller started, within jobs.resume_grace_s of the start, and not
        already silent when the controller last heard any node before it."""
        age = self.nodes.report_age_s(node)
        with self._lock:
            heard = node in self._heard
        if heard:
            return "reporting" if age is not None and age <= self.node_silent_after_s else "silent"
        now = self._now()
        if age is None or now - self.started_at >= self.config.resume_grace_s:
            return "silent"
        if self._horizon is not None and self._horizon - (now - age) > self.node_silent_after_s:
            return "silent"
        return "unknown"

    def reporting(self, node: str) -> bool:
        return self.presence(node) == "reporting"

    def silent(self, node: str) -> bool:
        return self.presence(node) == "silent"

    def unknown(self, nodes: Iterable[str], *, spares: bool = False) -> list[str]:
        """The nodes among `nodes` (with `spares`, also the free hot spares) that are unknown
        (`presence`): a step that acts on them waits. Free after the resume grace."""
        if self._now() - self.started_at >= self.config.resume_grace_s:
            return []
        names = list(dict.fromkeys(nodes))
        if spares:
            names += [
                r.name
                for r in self.nodes.all_nodes()
                if r.role == "spare" and not r.job and r.name not in names
            ]
        return [n for n in names if self.presence(n) == "unknown"]

    def address(self, node: str) -> str:
        rec = self.nodes.node_record(node)
        addr = rec.labels.get("address") if rec is not None else None
        return addr or node

    def healthy(
        self, node: str, *, open_incident_nodes: set[str], unknown_counts: bool = False
    ) -> bool:
        """Active, reporting and free of open incidents; with `unknown_counts`, a node not
        heard from yet since this controller started (presence unknown) counts too."""
        rec = self.nodes.node_record(node)
        if rec is None or rec.state != "active" or node in open_incident_nodes:
            return False
        presence = self.presence(node)
        return presence == "reporting" or (unknown_counts and presence == "unknown")

    def spares(
        self,
        selector: dict[str, str],
        *,
        open_incident_nodes: set[str],
        exclude: Iterable[str],
        unknown_counts: bool = False,
    ) -> list[str]:
        """Hot spares a job may take: role spare, active, reporting (with `unknown_counts`:
        or not heard from yet since the start), no open incident, no job, carrying every
        selector label. Sorted by name (deterministic)."""
        excluded = set(exclude)
        out = []
        for rec in self.nodes.all_nodes():
            if rec.role != "spare" or rec.name in excluded or rec.job:
                continue
            if not self.healthy(
                rec.name, open_incident_nodes=open_incident_nodes, unknown_counts=unknown_counts
            ):
                continue
            if any(rec.labels.get(k) != v for k, v in selector.items()):
                continue
            out.append(rec.name)
        return sorted(out)

    def drain_floor_reason(self, node: str, *, open_incident_nodes: set[str]) -> str | None:
        """Why draining `node` would leave its job below min_nodes with no spare to take its
        place (the safety budget asks before planning a drain); None when it may drain. A
        node that no longer reports has already left the job, so draining it costs nothing.
        Right after a (re)start, nodes not heard from yet count as they stand in the store:
        taking them for lost would turn every remediation planned in the first second into a
        page without a drain; the steps themselves wait for those nodes to report."""
        job = self.job_of_node(node)
        if job is None or self.presence(node) == "silent":
            return None
        others = [
            n
            for n in job.nodes
            if n != node and self.healthy(n, open_incident_nodes=set(), unknown_counts=True)
        ]
        spec = self.spec(job)
        spares = self.spares(
            spec.spare_selector,
            open_incident_nodes=open_incident_nodes,
            exclude=job.nodes,
            unknown_counts=True,
        )
        if len(others) + len(spares) >= spec.floor:
            return None
        return (
            f"draining {node} would leave job {job.name} with {len(others)} node(s), below"
            f" min_nodes {spec.floor}, and no spare; paging instead of draining"
        )

    # --- the live view (report path: cheap, in memory) ----------------------------------------

    def note_report(self, node: str, report: Report, *, now: float) -> None:
        with self._lock:
            heard = self._heard.get(node)
            if heard is None or now - heard[0] > self.node_silent_after_s:
                self._heard[node] = (now, now)  # (back) after a gap: the stop clock restarts
            else:
                self._heard[node] = (now, heard[1])
            if report.standby is None:
                self._standby.pop(node, None)
            else:
                self._standby[node] = report.standby
            had = self._node_job_ranks.get(node, set())
            now_jobs: dict[str, list[RankState]] = {}
            for r in report.ranks:
                now_jobs.setdefault(r.job, []).append(r)
            for job in had - set(now_jobs):
                live = self._live.get(job)
                if live is not None:
                    live.ranks.pop(node, None)
            for job, ranks in now_jobs.items():
                live = self._live.setdefault(job, _Live())
                live.ranks[node] = tuple(ranks)
                for r in ranks:
                    if live.top_step is None or r.step > live.top_step:
                        live.top_step = r.step
                    if r.ckpt_step is not None and (
                        live.top_ckpt is None or r.ckpt_step > live.top_ckpt
                    ):
                        live.top_ckpt = r.ckpt_step
            self._node_job_ranks[node] = set(now_jobs)
            procs = {p.job: p for p in report.jobs}
            attempts: dict[str, tuple[int, ...]] = {}
            for p in report.jobs:
                if p.state in _LIVE_PROCESS_STATES:
                    attempts[p.job] = (*attempts.get(p.job, ()), p.attempt)
            # only the jobs this node's last report had processes of: O(the report), never
            # O(every job a node ever named)
            for job in self._node_procs.get(node, set()) - procs.keys():
                live = self._live.get(job)
                if live is not None:
                    live.procs.pop(node, None)
                    live.live_attempts.pop(node, None)
            for job in procs.keys() - attempts.keys():
                live = self._live.get(job)
                if live is not None:
                    live.live_attempts.pop(node, None)
            self._node_procs[node] = set(procs)
            for job, p in procs.items():
                self._live.setdefault(job, _Live()).procs[node] = p
            for job, live_attempts in attempts.items():
                self._live[job].live_attempts[node] = live_attempts

    def drain_grace_s(self, job: str) -> float | None:
        """The stop grace a drain gives the job's ranks on the drained node: 0 for a job
        recovered in process (a SIGTERM would make every rank agree to stop, the survivors
        too, where the path needs them to see a lost peer; the checkpoint step already
        committed its state); None (the drain's own) otherwise."""
        rec = self.get(job)
        if rec is None or not self.spec(rec).recovery.in_process:
            return None
        return 0.0

    def standby(self, node: str) -> StandbyState | None:
        """The node's warm standby as its latest report said (None: it keeps none), while
        the node reports; None once it is silent."""
        with self._lock:
            found = self._standby.get(node)
        return found if found is not None and self.reporting(node) else None

    def forget_live(self, job: str) -> None:
        """Drop the live view of a job the table does not hold (its name expired: no node
        reported it for a while, controller.jobnames)."""
        with self._lock:
            if job not in self._jobs:
                self._live.pop(job, None)

    def stale_attempts(self, processes: Sequence[JobProcess]) -> dict[str, int] | None:
        """job -> its current attempt, for each job of which `processes` (one report's) show
        a live process of an older attempt; None when there is none. The report path calls
        this: in memory, O(processes)."""
        stale: dict[str, int] | None = None
        with self._lock:
            for p in processes:
                if p.state not in _LIVE_PROCESS_STATES:
                    continue
                rec = self._jobs.get(p.job)
                if rec is not None and p.attempt < rec.attempt:
                    if stale is None:
                        stale = {}
                    stale[p.job] = rec.attempt
        return stale

    def note_events(self, node: str, events: Sequence[Event], *, now: float) -> None:
        for e in events:
            if e.kind == EventKind.JOB_EXIT and e.job:
                self._on_exit(node, e, now=now)
            elif e.job and (
                e.kind in (EventKind.NAN_LOSS, EventKind.GRAD_NORM_SPIKE)
                or (e.kind == EventKind.TRAINER_EVENT and e.message == TrainerEdge.GRAD_NORM_SPIKE)
            ):
                step = e.data.get("step")
                if isinstance(step, int):
                    self._push(e.job, "nan_steps", (now, step))
            elif e.job and (
                e.kind == EventKind.NAN_ROLLBACK
                or (e.kind == EventKind.TRAINER_EVENT and e.message == TrainerEdge.NAN_ROLLBACK)
            ):
                to_step = e.data.get("to_step")
                self._push(e.job, "rollbacks", (now, to_step if isinstance(to_step, int) else -1))
            elif e.kind == EventKind.CHECKPOINT_COMMITTED and e.job:
                cost = _checkpoint_cost_s(e.data)
                step = e.data.get("step")
                if cost is not None and isinstance(step, int):
                    self._note_commit(e.job, step, cost)
            elif e.kind == EventKind.CHECKPOINT_FAILED and e.job:
                rid = e.data.get("request_id")
                if isinstance(rid, str):
                    self._push(e.job, "ckpt_failed", (now, rid))

    def _note_commit(self, job: str, step: int, cost_s: float) -> None:
        with self._lock:
            live = self._live.setdefault(job, _Live())
            before = max((c for st, c in live.ckpt_costs if st == step), default=0.0)
            live.ckpt_block_total_s += max(0.0, cost_s - before)
            live.ckpt_costs.append((step, cost_s))
            del live.ckpt_costs[:-_KEEP_EVENTS]

    def _push(self, job: str, attr: str, item: Any) -> None:
        with self._lock:
            items: list[Any] = getattr(self._live.setdefault(job, _Live()), attr)
            items.append(item)
            del items[:-_KEEP_EVENTS]

    def _on_exit(self, node: str, e: Event, *, now: float) -> None:
        attempt = e.data.get("attempt")
        stopped = bool(e.data.get("stopped", False))
        code = e.code if e.code is not None else 0
        exit_info = {
            "node": node,
            "attempt": attempt,
            "code": code,
            "stopped": stopped,
            "message": e.message,
            "tail": str(e.data.get("output_tail", ""))[-2000:],
            "ts": now,
        }
        assert e.job is not None
        self._push(e.job, "exits", exit_info)
        job = self.get(e.job)
        if job is None or attempt != job.attempt or stopped:
            return
        live = job.state in (JobState.STARTING, JobState.RUNNING)
        if live and code != 0:
            if self._remediation_open(job):
                return  # a drain or restart of the job is stopping its processes
            self.set_state(
                job.name, JobState.CRASHED, reason=f"{node}: attempt {attempt} {e.message or code}"
            )
        elif live and code == 0:
            done = {
                x["node"]
                for x in self.exits(job.name)
                if x["attempt"] == job.attempt and x["code"] == 0 and not x["stopped"]
            }
            if set(job.attempt_nodes) <= done:
                self.set_state(job.name, JobState.COMPLETED, reason="every node exited 0")

    def _remediation_open(self, job: JobRecord) -> bool:
        """A pending or running step that may stop this job's processes (read from the store,
        so it holds across a controller restart)."""
        nodes = {*job.nodes, *job.attempt_nodes}
        for action, _ in self.store.actions.open():
            kind = ActionKind.parse(action.kind)
            if kind is None or not kind.stops_job:
                continue
            if action.params.get("job") == job.name or action.params.get("node") in nodes:
                return True
        return False

    def exits(self, job: str) -> list[dict[str, Any]]:
        with self._lock:
            live = self._live.get(job)
            return list(live.exits) if live else []

    def nan_steps(self, job: str) -> list[tuple[float, int]]:
        with self._lock:
            live = self._live.get(job)
            return list(live.nan_steps) if live else []

    def rollbacks(self, job: str) -> list[tuple[float, int]]:
        with self._lock:
            live = self._live.get(job)
            return list(live.rollbacks) if live else []

    def checkpoint_failed(self, job: str, request_id: str) -> bool:
        with self._lock:
            live = self._live.get(job)
            return live is not None and any(rid == request_id for _, rid in live.ckpt_failed)

    def ranks(self, job: str) -> list[tuple[str, RankState]]:
        """(node, rank state) of every rank the agents report for the job now. A node that
        stopped reporting left its last ranks behind: they are stale, not current."""
        with self._lock:
            live = self._live.get(job)
            if live is None:
                return []
            found = [(n, r) for n, rs in sorted(live.ranks.items()) for r in rs]
        # outside the lock: reporting() takes the controller's lock (the report path takes
        # that one first, then ours)
        fresh = {n for n in {n for n, _ in found} if self.reporting(n)}
        return [(n, r) for n, r in found if n in fresh]

    def process(self, job: str, node: str) -> JobProcess | None:
        with self._lock:
            live = self._live.get(job)
            return live.procs.get(node) if live else None

    def runs_attempt(self, job: str, node: str, *, attempt: int) -> bool:
        """The node's latest report shows a live process of `attempt` of the job, or of an
        older one (or ranks of the job with no process record: assumed live)."""
        with self._lock:
            live = self._live.get(job)
            if live is None:
                return False
            if any(a <= attempt for a in live.live_attempts.get(node, ())):
                return True
            return node not in live.procs and bool(live.ranks.get(node))

    def attempt_fence(
        self, job: str, *, attempt: int, ran: Iterable[str], others: Iterable[str], since: float
    ) -> Fence:
        """Where the stop (sent at `since`) of `attempt` stands: on the nodes that `ran` it
        (stopped, or silent past jobs.attempt_lease_s) and on `others` (the nodes the next
        attempt may use: stopped once they reported since the stop, or silent)."""
        now = self._now()
        limit_s = self.config.stop_grace_s + self.config.stop_timeout_s
        lease_s = self.config.attempt_lease_s
        ran_set = set(ran)
        out: dict[str, list[str]] = {
            k: [] for k in ("stopped", "lapsed", "running", "unconfirmed", "unknown", "leased")
        }
        overdue: list[str] = []
        for node in dict.fromkeys((*ran_set, *others)):
            state = self.presence(node)
            if state == "unknown":
                out["unknown"].append(node)
                continue
            age = self.nodes.report_age_s(node)
            if state == "silent":
                if node in ran_set and age is not None and age <= lease_s:
                    out["leased"].append(node)
                else:
                    out["lapsed"].append(node)
                continue
            if self.runs_attempt(job, node, attempt=attempt):
                out["running"].append(node)
                with self._lock:
                    back_since = self._heard.get(node, (now, now))[1]
                if now - max(since, back_since) >= limit_s:
                    overdue.append(node)
            elif age is not None and now - age < since:
                out["unconfirmed"].append(node)
            else:
                out["stopped"].append(node)
        return Fence(
            attempt=attempt,
            **{k: tuple(sorted(v)) for k, v in out.items()},
            overdue=tuple(sorted(overdue)),
        )

    def runs_on(self, job: str, node: str) -> bool:
        """The node still reports processes (or ranks) of the job."""
        with self._lock:
            live = self._live.get(job)
            if live is None:
                return False
            proc = live.procs.get(node)
            if proc is not None and proc.state != "exited":
                return True
            return proc is None and bool(live.ranks.get(node))

    def latest_steps(self, job: str) -> tuple[int | None, int | None]:
        """(highest step, newest committed checkpoint step) over the reported ranks, falling
        back to the last values stored for the job (for a job outside the job table: the
        highest its ranks ever reported)."""
        ranks = self.ranks(job)
        steps = [r.step for _, r in ranks]
        ckpts = [r.ckpt_step for _, r in ranks if r.ckpt_step is not None]
        rec = self.get(job)
        if rec is None:
            with self._lock:
                live = self._live.get(job)
                top_step, top_ckpt = (live.top_step, live.top_ckpt) if live else (None, None)
            step = max(steps) if steps else top_step
            ckpt = max([*ckpts, *([top_ckpt] if top_ckpt is not None else [])], default=None)
            return step, ckpt
        step = max(steps) if steps else rec.last_step
        stored = rec.ckpt_step
        ckpt = max([*ckpts, *([stored] if stored is not None else [])], default=None)
        return step, ckpt

    def checkpoint_cost_s(self, job: str) -> float | None:
        """What a checkpoint costs the job's loop, s: the mean over its recent commits of the
        slowest rank's cost (a save holds every rank until the slowest is done); None before
        one committed."""
        with self._lock:
            live = self._live.get(job)
            costs = list(live.ckpt_costs) if live else []
        per_step: dict[int, float] = {}
        for step, cost in costs:
            per_step[step] = max(cost, per_step.get(step, 0.0))
        return sum(per_step.values()) / len(per_step) if per_step else None

    def checkpoint_block_total_s(self, job: str) -> float | None:
        """Seconds the job's saves held its loop since this controller started (None before
        one committed)."""
        with self._lock:
            live = self._live.get(job)
            return live.ckpt_block_total_s if live is not None and live.ckpt_costs else None

    def step_time_s(self, job: str) -> float | None:
        """The job's step time, s: the slowest reporting rank's (None before one timed)."""
        times = [r.step_time_s for _, r in self.ranks(job) if r.step_time_s]
        return max(times) if times else None

    def checkpoint_interval_s(self, job: str) -> float | None:
        """The periodic checkpoint interval the ranks report, s (the longest; None without
        periodic checkpoints)."""
        times = [r.ckpt_interval_s for _, r in self.ranks(job) if r.ckpt_interval_s]
        return max(times) if times else None

    def checkpoint_health(self, job: str) -> tuple[float | None, int]:
        """(highest ckpt_age_s, highest ckpt_failures) over the job's reporting ranks."""
        ranks = [r for _, r in self.ranks(job)]
        ages = [r.ckpt_age_s for r in ranks if r.ckpt_age_s is not None]
        return (max(ages) if ages else None), max((r.ckpt_failures for r in ranks), default=0)

    # --- per tick -----------------------------------------------------------------------------

    def tick(self, *, now: float) -> None:
        """Move starting jobs to running, account ETTR, persist steps (few jobs: cheap)."""
        for job in self.records():
            state = JobState.parse(job.state)
            if state is not JobState.STARTING and state is not JobState.RUNNING:
                continue
            step, ckpt = self.latest_steps(job.name)
            changes: dict[str, Any] = {}
            if state is JobState.STARTING and self._attempt_running(job):
                check_job_transition(job.name, state, JobState.RUNNING)
                changes["state"] = JobState.RUNNING.value
            elif state is JobState.STARTING and self._start_overdue(job, now=now):
                self.set_state(
                    job.name,
                    JobState.CRASHED,
                    reason=f"start failed: attempt {job.attempt} on"
                    f" {', '.join(job.attempt_nodes) or '-'} had no rank running after"
                    f" {self.config.start_timeout_s:g} s (jobs.start_timeout_s)",
                )
                continue
            running = state is JobState.RUNNING or "state" in changes
            if running and job.started_at is None:
                # ETTR's wall clock starts with the first productive sample, whichever path
                # marked the job running; productive time before it would push ETTR past 1
                changes["started_at"] = now
            if step is not None and step != job.last_step:
                changes["last_step"] = step
                hwm = job.hwm_step if job.hwm_step is not None else (ckpt or 0)
                if running and job.sampled_at is not None and job.last_step is not None:
                    gap_s = now - job.sampled_at
                    advanced = step - job.last_step
                    new = step - max(job.last_step, hwm)
                    if advanced > 0 and new > 0 and gap_s <= _MAX_PRODUCTIVE_GAP_S:
                        changes["productive_s"] = job.productive_s + gap_s * new / advanced
                if step > hwm:
                    changes["hwm_step"] = step
            if ckpt is not None and ckpt != job.ckpt_step:
                changes["ckpt_step"] = ckpt
            if running:
                changes["sampled_at"] = now
            if changes:
                self._remember(self.store.jobs.update(job.name, **changes))

    def _start_overdue(self, job: JobRecord, *, now: float) -> bool:
        """Starting for longer than start_timeout_s with no step watching the start (a
        restart step bounds its own start by progress_timeout_s)."""
        began = job.attempt_started_at if job.attempt_started_at is not None else job.updated_at
        if now - began <= self.config.start_timeout_s:
            return False
        return not self._remediation_open(job)

    def _attempt_running(self, job: JobRecord) -> bool:
        with self._lock:
            live = self._live.get(job.name)
            if live is None:
                return False
            for node in job.attempt_nodes:
                proc = live.procs.get(node)
                if proc is not None and proc.attempt == job.attempt and proc.state == "running":
                    if live.ranks.get(node):
                        return True
        return False

    # --- views --------------------------------------------------------------------------------

    def ettr(self, job: JobRecord, *, now: float) -> float | None:
        if job.started_at is None:
            return None
        end = job.ended_at if job.ended_at is not None else now
        wall_s = end - job.started_at
        if wall_s <= 0:
            return None
        return max(0.0, min(1.0, job.productive_s / wall_s))

    def view(self, job: JobRecord, *, now: float) -> JobView:
        step, ckpt = self.latest_steps(job.name)
        ckpt_age_s, ckpt_failures = self.checkpoint_health(job.name)
        spec = self.spec(job)
        return JobView(
            name=job.name,
            state=job.state,
            nodes=job.nodes,
            attempt=job.attempt,
            last_step=step,
            ckpt_step=ckpt,
            ckpt_age_s=ckpt_age_s,
            ckpt_failures=ckpt_failures,
            restarts=job.restarts,
            ettr=self.ettr(job, now=now),
            ranks=len(self.ranks(job.name)),
            nproc_per_node=job.nproc_per_node,
            min_nodes=job.min_nodes,
            world_size=len(job.nodes) * job.nproc_per_node,
            full_world_size=spec.world_size,
            state_reason=job.state_reason,
            started_at=job.started_at,
            recovery="in_process" if spec.recovery.in_process else "restart",
        )


__all__ = [
    "RESUME_SKIP_ENV",
    "SHRINK_MODES",
    "Fence",
    "JobManager",
    "JobSpec",
    "NodeAccess",
    "Presence",
    "shrink_plan",
    "stored_state",
]
