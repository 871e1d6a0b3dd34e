"""Read models the API and agentctl show: plain frozen dataclasses, JSON-ready via
`trainguard.protocol.to_wire`. The service facade returns these; the store never leaks rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from trainguard.controller.ckptinterval import IntervalAdvice
from trainguard.controller.failurecost import FailureCost

NodeRole = Literal["active", "spare"]
# controller.nodestate.NodeState's values
NodeState = Literal[
    "active", "draining", "drained", "diagnosing", "repairing", "validating", "retired"
]
IncidentState = Literal["open", "acting", "mitigated", "resolved", "suppressed"]
ActionState = Literal["pending", "running", "succeeded", "failed", "skipped"]


@dataclass(frozen=True)
class UnknownXidView:
    """An XID code a node reported that the XID catalog does not list."""

    code: int
    count: int  # reports since the controller started (or within its replayed history)
    first_at: float  # unix s
    last_at: float  # unix s


@dataclass(frozen=True)
class PreflightView:
    """The result of a node's last preflight (controller.actions.lifecycle)."""

    command_id: str
    passed: bool
    summary: str  # "passed (...)" or "failed: check: detail; ..."
    done_at: float  # unix s
    # one {"name", "passed", "detail", optional "value", "reference"} per check
    checks: tuple[dict[str, Any], ...] = ()
    duration_s: float | None = None


@dataclass(frozen=True)
class HardwareIncidentView:
    """One of a node's hardware incidents (controller.lemons)."""

    id: int
    rule: str
    opened_at: float  # unix s
    summary: str = ""


@dataclass(frozen=True)
class StandbyView:
    module: str  # the job entry module it has imported
    ready: bool


@dataclass(frozen=True)
class NodeView:
    name: str
    role: NodeRole
    state: NodeState
    labels: dict[str, str] = field(default_factory=dict)
    last_report_at: float | None = None  # unix s
    report_age_s: float | None = None
    reporting: bool = False  # fresh report within the silence threshold
    gpus: int = 0
    ib_ports: int = 0
    job: str | None = None  # job this node is assigned to
    open_incidents: int = 0
    drain_reason: str | None = None
    agent_version: str = ""
    # XID codes the node reported that the catalog does not list, the most recent first
    unknown_xids: tuple[UnknownXidView, ...] = ()
    # the last preflight's result; filled by `describe node` (get_node), not by lists
    last_preflight: PreflightView | None = None
    # hardware incidents within lifecycle.lemon_window_s, oldest first; filled by get_node
    hardware_incidents: tuple[HardwareIncidentView, ...] = ()
    # a spare's warm standby as its agent reports it (in-process recovery needs it ready)
    standby: StandbyView | None = None


@dataclass(frozen=True)
class TimelineEntry:
    ts: float
    kind: str  # "opened", "notified", "action_started", "action_succeeded", "resolved", ...
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ActionView:
    id: int
    incident_id: int | None
    kind: str  # "notify", "drain", "undrain", "checkpoint", "replace", "restart", ...
    target: str  # target key or node/job name
    state: ActionState
    attempts: int
    idempotency_key: str
    created_at: float
    updated_at: float
    result: str = ""
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class IncidentView:
    id: int
    rule: str
    target: str  # Target.key
    target_text: str  # Target.describe()
    severity: str
    state: IncidentState
    opened_at: float
    updated_at: float
    resolved_at: float | None = None
    summary: str = ""
    node: str | None = None
    job: str | None = None


@dataclass(frozen=True)
class IncidentDetail:
    incident: IncidentView
    timeline: tuple[TimelineEntry, ...] = ()
    actions: tuple[ActionView, ...] = ()
    # GPU-hours (and money) the incident's restart or rollback cost its job; None without one
    cost: FailureCost | None = None


@dataclass(frozen=True)
class JobView:
    name: str
    state: str  # "pending", "running", "restarting", "stopped", "failed", ...
    nodes: tuple[str, ...] = ()
    attempt: int = 0
    last_step: int | None = None
    ckpt_step: int | None = None  # newest committed checkpoint step reported by the ranks
    # checkpoint health over the job's reporting ranks: the oldest rank's seconds since its
    # newest commit (since its run began while none committed), as of its latest heartbeat,
    # and the most saves any rank failed in a row since then
    ckpt_age_s: float | None = None
    ckpt_failures: int = 0
    restarts: int = 0
    ettr: float | None = None  # effective training time ratio, 0..1
    ranks: int = 0
    nproc_per_node: int = 0  # 0: not a submitted job (only seen in heartbeats)
    min_nodes: int = 0
    world_size: int = 0
    # the world size the job spec asks for; more than world_size while the job runs shrunk
    full_world_size: int = 0
    state_reason: str = ""
    started_at: float | None = None  # unix s, first time the job ran (ETTR's wall clock)
    # what runs the job: "" = trainguard itself (torchrun on the agents), "slurm"; and the
    # job's id there (the Slurm job id)
    scheduler: str = ""
    scheduler_job_id: str = ""
    # the checkpoint interval the job runs with against the optimal one (Young/Daly from the
    # measured checkpoint cost, restart time and MTBF), with the expected waste of each; None
    # before a checkpoint of the job committed
    checkpoint_interval: IntervalAdvice | None = None
    # where the periodic interval comes from: "auto" (the controller sets it at run time,
    # controller.ckptauto), "fixed" (the spec's checkpoint.interval), "" (the program's own);
    # filled by `describe job` (get_job), with the interval in force as the controller set it
    # and auto's changes, newest first
    checkpoint_interval_source: str = ""
    checkpoint_every_steps: int | None = None
    checkpoint_interval_changes: tuple[TimelineEntry, ...] = ()
    # GPU-hours (and money at cost.gpu_hour) its failures cost within economics.mtbf_window_s,
    # and its checkpoints since the controller started; None while there is neither
    failure_cost: FailureCost | None = None
    # how a lost node is recovered: "in_process" (the spec's recovery.in_process: survivors
    # rejoin with a spare's warm standby, the full restart as fallback) or "restart"
    recovery: str = "restart"


@dataclass(frozen=True)
class SilenceView:
    id: int
    rule: str | None
    node: str | None
    created_by: str
    created_at: float
    expires_at: float
    comment: str = ""
    active: bool = True


@dataclass(frozen=True)
class AuditEntry:
    id: int
    ts: float
    actor: str  # token name (never the token itself)
    action: str
    target: str
    detail: dict[str, Any] = field(default_factory=dict)
