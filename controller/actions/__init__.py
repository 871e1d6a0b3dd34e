"""Action steps the controller takes for incidents and operators: the framework (kinds,
base, worker), notifications (Slack, PagerDuty, webhooks) and node draining."""

from trainguard.controller.actionkinds import ActionKind
from trainguard.controller.actions.base import (
    ActionContext,
    ActionError,
    ActionHandler,
    HandlerRegistry,
    Outcome,
    PermanentError,
    TransientError,
    UnavailableHandler,
)

__all__ = [
    "ActionContext",
    "ActionError",
    "ActionHandler",
    "ActionKind",
    "HandlerRegistry",
    "Outcome",
    "PermanentError",
    "TransientError",
    "UnavailableHandler",
]
