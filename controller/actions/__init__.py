"""Action steps the controller takes for incidents and operators: the framework (base,
worker), notifications (Slack, PagerDuty, webhooks) and node draining."""

from trainguard.controller.actions.base import (
    DISRUPTIVE_KINDS,
    KNOWN_KINDS,
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
    "DISRUPTIVE_KINDS",
    "KNOWN_KINDS",
    "ActionContext",
    "ActionError",
    "ActionHandler",
    "HandlerRegistry",
    "Outcome",
    "PermanentError",
    "TransientError",
    "UnavailableHandler",
]
