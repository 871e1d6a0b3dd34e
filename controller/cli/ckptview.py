"""How `agentctl describe job` shows a job's checkpoint interval advice: the current and the
optimal interval side by side, each with its expected waste, the inputs that gave them, and
where the interval comes from (fixed, auto: the controller's, with its changes; the REST view
holds the same numbers in seconds and fractions)."""

from __future__ import annotations

from typing import Any

__all__ = ["for_humans"]


def _duration(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    s = float(seconds)
    if s < 60:
        return f"{s:.3g}s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    if s < 86400:
        return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"
    return f"{s / 86400:.1f}d"


def _interval(seconds: Any, steps: Any, waste: Any) -> str:
    text = _duration(seconds)
    if isinstance(steps, int):
        text += f" (every {steps} steps)"
    if isinstance(waste, int | float):
        text += f", expected waste {waste:.1%}"
    return text


def _advice(a: dict[str, Any]) -> dict[str, str]:
    current = (
        _interval(a.get("current_s"), a.get("current_every_steps"), a.get("current_waste"))
        if a.get("current_s") is not None
        else "- (no periodic checkpoints reported)"
    )
    return {
        "current": current,
        "optimal": _interval(
            a.get("optimal_s"), a.get("optimal_every_steps"), a.get("optimal_waste")
        )
        + f" (Daly; Young {_duration(a.get('young_s'))})",
        "checkpoint_cost": _duration(a.get("checkpoint_s")),
        "restart_time": _duration(a.get("restart_s")),
        "mtbf": f"{_duration(a.get('mtbf_s'))} (node {_duration(a.get('node_mtbf_s'))})",
    }


def _source(data: dict[str, Any]) -> str:
    source = data.get("checkpoint_interval_source") or ""
    every = data.get("checkpoint_every_steps")
    steps = f", every {every} steps" if isinstance(every, int) else ""
    if source == "auto":
        changes = data.get("checkpoint_interval_changes") or []
        told = f", {len(changes)} change(s)" if changes else ", not changed yet"
        return f"auto (set by the controller{steps}{told})"
    if source == "fixed":
        return f"fixed (job spec{steps})"
    return "the program's own"


def for_humans(kind: str, data: Any) -> Any:
    """`data` as `describe` prints it: a job's `checkpoint_interval` in words, with its source;
    else as is."""
    if kind != "job" or not isinstance(data, dict):
        return data
    advice = data.get("checkpoint_interval")
    if not isinstance(advice, dict):
        return data
    return {**data, "checkpoint_interval": {"source": _source(data), **_advice(advice)}}
