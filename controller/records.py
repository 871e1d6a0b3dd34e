"""The records the controller keeps in its store and works with: a node, a job, an agent
command, a command's result, an action to record, a node's report freshness. Plain frozen
dataclasses with no behaviour; the store (controller/store/) reads and writes them, and the
code that decides (jobs, incidents, actions, safety) imports them from here, never from the
storage package. The read models the API shows (incidents, actions, silences, the audit log)
are in controller/views.py; the store returns those too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# an action row in one of these states is finished: it is never run again
TERMINAL_ACTION_STATES = ("succeeded", "failed", "skipped")


@dataclass(frozen=True)
class NodeRecord:
    name: str
    role: str
    state: str
    labels: dict[str, str] = field(default_factory=dict)
    last_report_at: float | None = None
    instance: str | None = None
    agent_version: str = ""
    drain_reason: str | None = None
    job: str | None = None


@dataclass(frozen=True)
class JobRecord:
    """One row of the job table (the spec is the submitted JSON, validated by controller.jobs).

    `nodes`/`nproc_per_node` are the placement the next attempt starts on; `attempt_nodes` the
    nodes the current attempt was started on (what a restart must stop). `attempt_key` is the
    idempotency key of the step that began the current attempt, so a step re-run after a crash
    finds its attempt instead of beginning another.
    """

    name: str
    spec: dict[str, Any]
    state: str
    nodes: tuple[str, ...]
    attempt: int
    nproc_per_node: int
    min_nodes: int
    restarts: int
    created_at: float
    updated_at: float
    attempt_key: str | None = None
    attempt_nodes: tuple[str, ...] = ()
    rdzv_port: int | None = None
    ckpt_step: int | None = None
    last_step: int | None = None
    hwm_step: int | None = None
    started_at: float | None = None
    attempt_started_at: float | None = None
    ended_at: float | None = None
    productive_s: float = 0.0
    sampled_at: float | None = None
    state_reason: str = ""


@dataclass(frozen=True)
class CommandRecord:
    id: str
    node: str
    kind: str
    args: dict[str, Any]
    created_at: float
    delivered_at: float | None = None
    done_at: float | None = None
    ok: bool | None = None
    result: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # the result's data beyond the message


@dataclass(frozen=True)
class CommandResultRow:
    """A `command_result` event as the commands table keeps it."""

    command_id: str
    ok: bool
    message: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class NewAction:
    """An action row to insert (the intent, written before anything runs)."""

    kind: str
    target: str
    idempotency_key: str
    seq: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    state: str = "pending"
    result: str = ""


@dataclass(frozen=True)
class FreshNode:
    """In-memory freshness flushed in batches (the report path never writes per report)."""

    name: str
    last_report_at: float
    instance: str
    agent_version: str
    labels: dict[str, str]


__all__ = [
    "TERMINAL_ACTION_STATES",
    "CommandRecord",
    "CommandResultRow",
    "FreshNode",
    "JobRecord",
    "NewAction",
    "NodeRecord",
]
