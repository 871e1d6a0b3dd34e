"""Action steps the controller takes for incidents and operators: the framework (base:
handlers and their registry; worker: runs stored steps exactly once), notifications (Slack,
PagerDuty, webhooks), node draining, the job steps (jobsteps, recovery, restartphase). Which
kinds exist and what each is: controller.actionkinds."""

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
