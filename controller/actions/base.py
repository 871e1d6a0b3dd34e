"""The action framework's contracts: errors, the handler Protocol, its context and outcome,
and the registry that maps an action kind to its handler.

A handler does one step of a remediation plan (an ActionKind: notify, drain, checkpoint, ...).
It may finish at once, ask to be polled again (`Outcome(done=False)`, e.g. a drain waiting for
the job to stop), or raise TransientError (retried with backoff) / PermanentError (fail + escalate).
Kinds without an implementation are registered as unavailable: their steps end `skipped`
with a timeline entry saying so, and a later implementation registers through the same
registry without changing the plan or the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.controller.actionkinds import ActionKind
from trainguard.controller.views import ActionView, IncidentView


class ActionError(Exception):
    """Base for handler errors; `str(e)` goes to the timeline, so never put secrets in it."""


class TransientError(ActionError):
    """Worth retrying: timeouts, connection errors, HTTP 5xx/429, a node not reachable yet."""


class PermanentError(ActionError):
    """Retrying cannot help (HTTP 4xx, bad parameters): fail now and escalate to a person."""


@dataclass(frozen=True)
class ActionContext:
    """Everything a handler may read for one attempt; handlers never query the store."""

    action: ActionView
    incident: IncidentView | None
    now: float
    attempt: int  # 1-based; polls of a running step do not count as attempts
    # Outputs of earlier succeeded steps of the same incident, by kind (a checkpoint step's
    # {"step": N} reaches the restart step this way).
    previous: dict[str, dict[str, Any]] = field(default_factory=dict)
    # This step's own output so far (a polling step keeps its command id here).
    progress: dict[str, Any] = field(default_factory=dict)
    recovering: bool = False  # re-run of a step that was running when the controller died

    @property
    def params(self) -> dict[str, Any]:
        return self.action.params


@dataclass(frozen=True)
class Outcome:
    """What one run of a step achieved."""

    message: str = ""
    output: dict[str, Any] = field(default_factory=dict)
    done: bool = True  # False: still in progress; poll again after poll_after_s
    poll_after_s: float = 1.0
    skipped: bool = False  # done, but nothing was (or could be) done: e.g. unavailable kind


class ActionHandler(Protocol):
    kind: str
    # Remediation steps run in plan order and a failed one cancels the remediation steps
    # after it; notification steps are not remediation and never hold others up.
    remediation: bool

    def idempotent(self, params: dict[str, Any]) -> bool:
        """True when re-running a step that may already have happened is harmless for its
        idempotency key (decides what happens to `running` rows after a crash)."""

    def run(self, ctx: ActionContext) -> Outcome: ...


class UnavailableHandler:
    """A kind the controller knows but cannot perform yet: the step ends `skipped`."""

    remediation = False

    def __init__(self, kind: str, *, reason: str = "") -> None:
        self.kind = kind
        self._reason = reason or f"action {kind!r} is not available in this controller"

    def idempotent(self, params: dict[str, Any]) -> bool:
        return True

    def run(self, ctx: ActionContext) -> Outcome:
        return Outcome(message=f"skipped: {self._reason}", skipped=True)


class HandlerRegistry:
    """Action kind -> handler. Every ActionKind starts unavailable until a handler registers;
    kinds outside the table resolve to an UnavailableHandler too."""

    def __init__(self) -> None:
        self._handlers: dict[str, ActionHandler] = {}
        for kind in ActionKind:
            self._handlers[kind.value] = UnavailableHandler(kind.value)

    def register(self, handler: ActionHandler) -> None:
        """Make `handler` the one for its kind; a kind of the table must keep the table's
        `remediation` (the worker and the incidents read it from the handler)."""
        kind = ActionKind.parse(handler.kind)
        if kind is not None and handler.remediation != kind.remediation:
            raise ValueError(
                f"handler for {kind.value!r}: remediation={handler.remediation},"
                f" the action kind table says {kind.remediation}"
            )
        self._handlers[handler.kind] = handler

    def get(self, kind: str) -> ActionHandler:
        handler = self._handlers.get(kind)
        if handler is None:
            return UnavailableHandler(kind, reason=f"unknown action kind {kind!r}")
        return handler

    def available(self, kind: str) -> bool:
        return not isinstance(self._handlers.get(kind), UnavailableHandler | type(None))

    def kinds(self) -> list[str]:
        return sorted(self._handlers)


__all__ = [
    "ActionContext",
    "ActionError",
    "ActionHandler",
    "HandlerRegistry",
    "Outcome",
    "PermanentError",
    "TransientError",
    "UnavailableHandler",
]
