"""Shared controller value types: what a rule is about (Target) and what the engine decided.

The rules engine produces Decisions; the incident manager consumes them. Both sides import
only this module from each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# "controller": the controller itself (a rule it disabled for overrunning its budget)
Scope = Literal["gpu", "nvlink", "ib_port", "node", "rank", "job", "controller"]
Severity = Literal["info", "warning", "critical"]
DecisionState = Literal["pending", "firing", "resolved"]


@dataclass(frozen=True, order=True)
class Target:
    """What a rule instance is about. Unused coordinates are None.

    gpu: node+gpu; nvlink: node+gpu+link; ib_port: node+device+port; node: node;
    rank: job+rank (+ node where the rank runs); job: job; controller: nothing.
    """

    scope: Scope
    node: str | None = None
    gpu: int | None = None
    link: int | None = None
    device: str | None = None
    port: int | None = None
    job: str | None = None
    rank: int | None = None

    @property
    def key(self) -> str:
        """Stable text key, e.g. "gpu:node-1:3", "ib_port:node-2:mlx5_0:1", "rank:job-a:5"."""
        parts: list[str] = [self.scope]
        if self.scope == "rank":
            parts += [str(self.job), str(self.rank)]
        elif self.scope == "job":
            parts += [str(self.job)]
        elif self.scope == "controller":
            pass
        else:
            parts.append(str(self.node))
            if self.scope in ("gpu", "nvlink"):
                parts.append(str(self.gpu))
            if self.scope == "nvlink":
                parts.append(str(self.link))
            if self.scope == "ib_port":
                parts += [str(self.device), str(self.port)]
        return ":".join(parts)

    @classmethod
    def from_key(cls, key: str) -> Target:
        """The Target whose `key` this is (a rank's node is not in its key: None here)."""
        scope, *parts = key.split(":")
        if scope == "rank" and len(parts) == 2:
            return cls("rank", job=parts[0], rank=int(parts[1]))
        if scope == "job" and len(parts) == 1:
            return cls("job", job=parts[0])
        if scope == "controller" and not parts:
            return cls("controller")
        if scope == "node" and len(parts) == 1:
            return cls("node", node=parts[0])
        if scope == "gpu" and len(parts) == 2:
            return cls("gpu", node=parts[0], gpu=int(parts[1]))
        if scope == "nvlink" and len(parts) == 3:
            return cls("nvlink", node=parts[0], gpu=int(parts[1]), link=int(parts[2]))
        if scope == "ib_port" and len(parts) == 3:
            return cls("ib_port", node=parts[0], device=parts[1], port=int(parts[2]))
        raise ValueError(f"not a target key: {key!r}")

    def describe(self) -> str:
        """Human text: "node-1 gpu 3", "node-2 mlx5_0 port 1", "job-a rank 5 (node-3)"."""
        if self.scope == "gpu":
            return f"{self.node} gpu {self.gpu}"
        if self.scope == "nvlink":
            return f"{self.node} gpu {self.gpu} nvlink {self.link}"
        if self.scope == "ib_port":
            return f"{self.node} {self.device} port {self.port}"
        if self.scope == "node":
            return f"{self.node}"
        if self.scope == "rank":
            where = f" ({self.node})" if self.node else ""
            return f"{self.job} rank {self.rank}{where}"
        if self.scope == "controller":
            return "controller"
        return f"job {self.job}"


@dataclass(frozen=True)
class Decision:
    """The engine's verdict for one (rule, target) this tick.

    pending: condition true but `for:` not yet elapsed (no incident yet);
    firing: condition true for at least `for:` (open/keep the incident);
    resolved: condition no longer true for a (rule, target) that was pending/firing.
    """

    rule: str
    target: Target
    state: DecisionState
    severity: Severity
    actions: tuple[str, ...] = ()  # e.g. ("notify", "checkpoint", "drain", "replace", "restart")
    summary: str = ""  # one line for people: "node-2 gpu 3: uncorrectable ECC errors (value 1)"
    value: float | None = None  # the condition's left-hand value, for the timeline
    since: float | None = None  # when the condition first became true (unix s)
    labels: dict[str, str] = field(default_factory=dict)
    cooldown_s: float = 0.0  # from the rule: no new incident for this (rule,target) within
