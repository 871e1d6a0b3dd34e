"""Which shrunk jobs grow back now: a pure planner the controller tick runs over plain
snapshots of its jobs, nodes, open steps and incidents (the tick writes one `grow` step per
plan; controller.actions.jobsteps.GrowHandler does it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "GROW_SETTLE_S",
    "Grow",
    "GrowIncident",
    "GrowJob",
    "GrowNode",
    "GrowStep",
    "grow_key",
    "plan_grows",
]

# A shrunk attempt must have trained this long past its confirmed restart before it is
# stopped again to grow: a spare that flaps back in the moment the job restarted does not
# cost the job a second restart right away.
GROW_SETTLE_S = 2.0
# The incident states that mean remediation may still act on the job's nodes.
_BUSY_INCIDENT_STATES = ("open", "acting")


def grow_key(job: str, attempt: int) -> str:
    """The grow step's idempotency key: at most one grow per job and attempt."""
    return f"grow:{job}:{attempt}"


@dataclass(frozen=True)
class GrowJob:
    """A job of the job table, as the planner needs it."""

    name: str
    state: str
    attempt: int
    nodes: tuple[str, ...]
    nproc_per_node: int
    full_world_size: int  # what the spec asks for
    shrink: str  # JobSpec.shrink
    spare_selector: dict[str, str] = field(default_factory=dict)
    # its backend declares Capability.GROW (a Slurm job is never grown back)
    growable: bool = True
    # unix s the step that began the current attempt confirmed training past its checkpoint
    # (None: not confirmed yet)
    confirmed_at: float | None = None

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc_per_node


@dataclass(frozen=True)
class GrowNode:
    name: str
    role: str  # "active" | "spare"
    state: str  # a NodeState value
    reporting: bool
    labels: dict[str, str] = field(default_factory=dict)
    job: str | None = None  # the job the node is assigned to


@dataclass(frozen=True)
class GrowStep:
    """An open (pending or running) action step: its kind and what it is about."""

    kind: str
    job: str | None = None
    node: str | None = None


@dataclass(frozen=True)
class GrowIncident:
    state: str
    job: str | None = None
    node: str | None = None


@dataclass(frozen=True)
class Grow:
    """Grow `job` (at `attempt`) back to `ranks` ranks by adding `spares`."""

    job: str
    attempt: int
    spares: tuple[str, ...]
    ranks_from: int
    ranks_to: int

    @property
    def key(self) -> str:
        return grow_key(self.job, self.attempt)


def plan_grows(
    *,
    jobs: Sequence[GrowJob],
    nodes: Sequence[GrowNode],
    spares: Sequence[GrowNode],
    open_steps: Sequence[GrowStep],
    incidents: Sequence[GrowIncident],
    now: float,
) -> list[Grow]:
    """The grows to start now, at most one per job, each with spares no other grow takes.

    A job grows when its spec says `shrink: world`, it runs below its full size, it is
    `running` with its current attempt confirmed (trained past its checkpoint) for
    GROW_SETTLE_S, every node of it reports, no step is open on it or its nodes, no incident
    is open or acting on it or its nodes, and enough spares are free: role spare, active,
    reporting, no job, no open incident, carrying every label of its spare_selector."""
    by_name = {n.name: n for n in nodes}
    busy_incident_nodes = {
        i.node for i in incidents if i.node is not None and i.state != "resolved"
    }
    taken: set[str] = set()
    out: list[Grow] = []
    for job in sorted(jobs, key=lambda j: j.name):
        if not _may_grow(job, by_name=by_name, open_steps=open_steps, incidents=incidents):
            continue
        if job.confirmed_at is None or now - job.confirmed_at < GROW_SETTLE_S:
            continue
        missing = job.full_world_size - job.world_size
        if missing % job.nproc_per_node:
            continue  # the spec's processes per node cannot make up the full size
        need = missing // job.nproc_per_node
        free = [
            s.name
            for s in sorted(spares, key=lambda s: s.name)
            if s.name not in taken
            and s.role == "spare"
            and s.state == "active"
            and s.reporting
            and s.job is None
            and s.name not in busy_incident_nodes
            and all(s.labels.get(k) == v for k, v in job.spare_selector.items())
        ]
        if len(free) < need:
            continue
        chosen = tuple(free[:need])
        taken.update(chosen)
        out.append(
            Grow(
                job=job.name,
                attempt=job.attempt,
                spares=chosen,
                ranks_from=job.world_size,
                ranks_to=job.full_world_size,
            )
        )
    return out


def _may_grow(
    job: GrowJob,
    *,
    by_name: dict[str, GrowNode],
    open_steps: Sequence[GrowStep],
    incidents: Sequence[GrowIncident],
) -> bool:
    if job.shrink != "world" or not job.growable or job.state != "running":
        return False
    if job.nproc_per_node <= 0 or job.world_size >= job.full_world_size:
        return False
    members = set(job.nodes)
    if any(n not in by_name or not by_name[n].reporting for n in members):
        return False
    for step in open_steps:
        if step.job == job.name or (step.node is not None and step.node in members):
            return False
    for inc in incidents:
        if inc.state not in _BUSY_INCIDENT_STATES:
            continue
        if inc.job == job.name or (inc.node is not None and inc.node in members):
            return False
    return True
