"""What a report may say about a job: the report path's scope check (docs/security.md, "What a
node may say about which job").

A node's report speaks only about what runs on that node. For a job the controller manages
(a job table row, or a job its scheduler backend runs: `SchedulerScope.job_nodes`) a rank
state or an event about the job is accepted only

- from a node of the job: its current attempt's nodes or its placement (the job table), or
  the scheduler's allocation;
- for a rank that can be placed on that node: below the job's full world size, and no more
  ranks of the job in one report than a node runs processes;
- within plausible bounds of the job's own progress (`Progress.limit`): a step, checkpoint
  step, NaN step or rollback target far past the highest step the job was seen at is
  refused, not trusted.

A refused item is dropped before anything reads the report (the job manager, the live
view, the SignalState, the store): it never drives remediation. Its event id is still
acknowledged, so the agent does not resend it. Each refusal is counted (a metric with a
reason label) and audited, at most once a minute per (node, job, reason). A job the
controller does not manage keeps today's behaviour: what its ranks show is held for the
views, and since it is no managed job's name, it drives nothing of one.

The check is O(items in the report): a dict lookup per job named, a set lookup per node.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from trainguard.controller.records import JobRecord
from trainguard.protocol import Event, RankState, Report

__all__ = [
    "FAR_FACTOR",
    "FAR_MIN_STEPS",
    "FAR_WINDOW_S",
    "REASONS",
    "UNKNOWN_RATE_STEPS_PER_S",
    "JobScope",
    "Placement",
    "Progress",
    "Refusal",
    "SchedulerScope",
]

log = logging.getLogger("trainguard.controller")

# "Far" (Progress.limit): a claimed step is plausible up to
#   top + max(FAR_MIN_STEPS, FAR_FACTOR * rate * (now - top_at + FAR_WINDOW_S))
# where top is the highest step accepted for the job, top_at when it was first seen, and
# rate the job's observed step rate (steps/s; UNKNOWN_RATE_STEPS_PER_S until two samples at
# least a second apart give one). Training moves forward step by step, so a real step stays
# close to the last one; a restore goes back, never forward. The window covers a report
# delayed or a controller that did not look for a while; the factor a job that speeds up.
FAR_FACTOR = 4.0
FAR_WINDOW_S = 30.0
FAR_MIN_STEPS = 1000
UNKNOWN_RATE_STEPS_PER_S = 100.0
_RATE_SAMPLE_S = 1.0  # shortest gap between two samples of the step rate
_RATE_WEIGHT = 0.3  # weight of a new rate sample in the moving average

# why an item was refused (the metric's reason label)
NODE_NOT_IN_JOB = "node_not_in_job"
RANK_NOT_ON_NODE = "rank_not_on_node"
STEP_IMPLAUSIBLE = "step_implausible"
REASONS = (NODE_NOT_IN_JOB, RANK_NOT_ON_NODE, STEP_IMPLAUSIBLE)

# event data fields that claim a step of the job
_STEP_FIELDS = ("step", "to_step")


class SchedulerScope(Protocol):
    """The scheduler backend's part: the nodes it runs a job on."""

    def job_nodes(self, job: str) -> frozenset[str] | None:
        """The nodes the scheduler runs (or last ran) job `job` on; None: not a job it runs."""


@dataclass(frozen=True)
class Placement:
    """Where a managed job may run: the nodes, and (job table jobs) its rank bounds."""

    nodes: frozenset[str]
    world_size: int | None = None  # ranks are below it; None: the scheduler's, not known
    per_node: int | None = None  # most ranks a node runs; None: not known


@dataclass(frozen=True)
class Refusal:
    """One item of a report refused by the scope check."""

    node: str
    job: str
    reason: str
    what: str  # "rank 3", "event nan_loss #17"
    detail: str


@dataclass
class Progress:
    """A managed job's observed progress: the bound on what step it can plausibly be at."""

    top: int | None = None
    top_at: float = 0.0
    rate: float | None = None  # steps/s
    mark_step: int = 0
    mark_at: float = 0.0

    def limit(self, now: float) -> int | None:
        """The highest plausible step at `now` (None: nothing seen yet, anything goes)."""
        if self.top is None:
            return None
        rate = self.rate if self.rate is not None else UNKNOWN_RATE_STEPS_PER_S
        allowance = FAR_FACTOR * rate * (max(0.0, now - self.top_at) + FAR_WINDOW_S)
        return self.top + max(FAR_MIN_STEPS, math.ceil(allowance))

    def observe(self, step: int, now: float) -> None:
        """An accepted step of the job at `now`."""
        if self.top is None:
            self.top, self.top_at = step, now
            self.mark_step, self.mark_at = step, now
            return
        if step > self.top:
            self.top, self.top_at = step, now
        gap_s = now - self.mark_at
        if gap_s >= _RATE_SAMPLE_S:
            sample = max(0, self.top - self.mark_step) / gap_s
            if self.rate is None:
                self.rate = sample
            else:
                self.rate += _RATE_WEIGHT * (sample - self.rate)
            self.mark_step, self.mark_at = self.top, now


@dataclass
class _Scoped:
    """A managed job's cached placement and progress."""

    record: JobRecord | None
    placement: Placement
    progress: Progress = field(default_factory=Progress)


def _placement(rec: JobRecord) -> Placement:
    spec = rec.spec
    spec_nodes = spec.get("nodes")
    nproc = spec.get("nproc_per_node")
    nproc = nproc if isinstance(nproc, int) and nproc > 0 else rec.nproc_per_node
    cap = spec.get("max_nproc_per_node")
    per_node = max(cap if isinstance(cap, int) and cap > 0 else nproc, rec.nproc_per_node)
    full = len(spec_nodes) if isinstance(spec_nodes, list) else len(rec.nodes)
    world = max(full * nproc, len(rec.nodes) * rec.nproc_per_node)
    return Placement(
        nodes=frozenset((*rec.nodes, *rec.attempt_nodes)), world_size=world, per_node=per_node
    )


def _seed(rec: JobRecord) -> Progress:
    """The progress a job table row remembers (a controller restart loses the live one)."""
    steps = [s for s in (rec.hwm_step, rec.last_step, rec.ckpt_step) if s is not None]
    if not steps:
        return Progress()
    at = rec.sampled_at if rec.sampled_at is not None else rec.updated_at
    top = max(steps)
    return Progress(top=top, top_at=at, mark_step=top, mark_at=at)


class JobScope:
    """The scope check of the report path. Not thread-safe: the report path calls it under
    the live state's lock."""

    def __init__(
        self,
        *,
        job_record: Callable[[str], JobRecord | None],
        scheduler: SchedulerScope | None = None,
    ) -> None:
        self._job_record = job_record
        self._scheduler = scheduler
        self._scoped: dict[str, _Scoped] = {}

    def _scope(self, job: str) -> _Scoped | None:
        """The job's placement and progress; None when the controller does not manage it."""
        rec = self._job_record(job)
        held = self._scoped.get(job)
        if rec is not None:
            if held is not None and held.record is rec:
                return held
            if held is None or held.record is None or held.record.created_at != rec.created_at:
                held = self._scoped[job] = _Scoped(rec, _placement(rec), _seed(rec))
            else:  # the same job, placed anew or moved on: the progress stays
                held.record, held.placement = rec, _placement(rec)
            return held
        nodes = self._scheduler.job_nodes(job) if self._scheduler is not None else None
        if nodes is None:
            if held is not None:
                del self._scoped[job]
            return None
        if held is None or held.record is not None:
            held = self._scoped[job] = _Scoped(None, Placement(nodes=nodes))
        elif held.placement.nodes != nodes:
            held.placement = Placement(nodes=nodes)
        return held

    def check_ranks(self, report: Report, *, now: float, refused: list[Refusal]) -> Report:
        """`report` without the rank states it may not give (appended to `refused`); the
        same object when every rank is in scope. Accepted ranks advance their job's
        progress."""
        node = report.node
        keep: list[RankState] | None = None
        counts: dict[str, int] = {}
        scopes: dict[str, _Scoped | None] = {}
        for i, r in enumerate(report.ranks):
            job = r.job
            if job in scopes:
                scoped = scopes[job]
            else:
                scoped = scopes[job] = self._scope(job)
            why = None if scoped is None else self._rank_refusal(node, r, scoped, counts, now)
            if why is None:
                if scoped is not None:
                    step = r.step if r.ckpt_step is None else max(r.step, r.ckpt_step)
                    scoped.progress.observe(step, now)
                if keep is not None:
                    keep.append(r)
                continue
            refused.append(Refusal(node, job, why[0], f"rank {r.rank}", why[1]))
            if keep is None:
                keep = list(report.ranks[:i])
        if keep is None:
            return report
        return replace(report, ranks=tuple(keep))

    def _rank_refusal(
        self, node: str, r: RankState, scoped: _Scoped, counts: dict[str, int], now: float
    ) -> tuple[str, str] | None:
        place = scoped.placement
        if node not in place.nodes:
            return NODE_NOT_IN_JOB, f"{node} is not a node of job {r.job}"
        if place.world_size is not None and r.rank >= place.world_size:
            return RANK_NOT_ON_NODE, f"rank {r.rank} is past world size {place.world_size}"
        if place.per_node is not None:
            n = counts[r.job] = counts.get(r.job, 0) + 1
            if n > place.per_node:
                return RANK_NOT_ON_NODE, f"more than {place.per_node} ranks on {node}"
        limit = scoped.progress.limit(now)
        if limit is not None:
            if r.step > limit:
                return STEP_IMPLAUSIBLE, f"step {r.step} is past plausible step {limit}"
            if r.ckpt_step is not None and r.ckpt_step > limit:
                return STEP_IMPLAUSIBLE, f"ckpt_step {r.ckpt_step} past plausible step {limit}"
        return None

    def check_events(
        self, node: str, events: Sequence[Event], *, now: float, refused: list[Refusal]
    ) -> list[Event]:
        """The events among `events` (new ones, in order) the node may give; the others are
        appended to `refused`."""
        out: list[Event] | None = None
        for i, e in enumerate(events):
            why = None
            if e.job:
                scoped = self._scope(e.job)
                if scoped is not None:
                    why = self._event_refusal(node, e, scoped, now)
            if why is None:
                if out is not None:
                    out.append(e)
                continue
            refused.append(Refusal(node, e.job or "", why[0], f"event {e.kind} #{e.id}", why[1]))
            if out is None:
                out = list(events[:i])
        return list(events) if out is None else out

    def _event_refusal(
        self, node: str, e: Event, scoped: _Scoped, now: float
    ) -> tuple[str, str] | None:
        place = scoped.placement
        if node not in place.nodes:
            return NODE_NOT_IN_JOB, f"{node} is not a node of job {e.job}"
        if e.rank is not None and place.world_size is not None and e.rank >= place.world_size:
            return RANK_NOT_ON_NODE, f"rank {e.rank} is past world size {place.world_size}"
        limit = scoped.progress.limit(now)
        if limit is not None and e.data:
            for name in _STEP_FIELDS:
                step = e.data.get(name)
                if isinstance(step, int) and step > limit:
                    return STEP_IMPLAUSIBLE, f"{name} {step} is past plausible step {limit}"
        return None
