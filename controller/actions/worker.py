"""The action worker: runs the steps of every plan in order, with bounded retries.

Per incident, remediation steps run one after another in plan order (a step's output feeds
the later ones); a failed remediation step skips the remediation steps after it. Notification
steps run as soon as they are due and never hold anything up. Transient errors are retried
with exponential backoff up to `max_attempts`; permanent errors fail at once and escalate.

Crash safety: the intent row is committed before a step runs and every state change is one
transaction. After a restart, `recover()` looks at rows left `running`: a step whose handler
is idempotent for its key (drain, undrain, PagerDuty and webhook notifications) is run
again; any other (Slack) is marked failed "interrupted" and escalated, never repeated. Rows
that reached succeeded/failed/skipped are never run again.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

from trainguard.controller.actions.base import (
    ActionContext,
    ActionHandler,
    HandlerRegistry,
    Outcome,
    PermanentError,
    TransientError,
)
from trainguard.controller.config import ActionsConfig
from trainguard.controller.records import TERMINAL_ACTION_STATES
from trainguard.controller.safety import backoff_s
from trainguard.controller.store import Store
from trainguard.controller.store.errors import LeaseLost, StoreUnavailable
from trainguard.controller.views import ActionView

log = logging.getLogger("trainguard.controller.actions")


class ActionListener(Protocol):
    """Told about step progress (the incident manager moves incidents with it)."""

    def on_action_started(
        self, action: ActionView, handler: ActionHandler, *, now: float
    ) -> None: ...

    def on_action_finished(self, action: ActionView, *, now: float) -> None: ...

    def escalate(self, action: ActionView, *, reason: str, now: float) -> None: ...


class ActionCounter(Protocol):
    def count(self, kind: str, result: str) -> None: ...


# Output keys copied into a step's final timeline entry: what a person reading the incident
# needs and would otherwise not see (the API and `agentctl describe incident` show the
# timeline, not action outputs). Handlers keep them bounded.
TIMELINE_OUTPUT_KEYS = ("stacks",)

# Why a step must not run now (it is then skipped with that reason), or None: the incident
# layer's silence check for notifications.
ActionGate = Callable[[ActionView, float], "str | None"]


class ActionRunner:
    def __init__(
        self,
        *,
        store: Store,
        registry: HandlerRegistry,
        config: ActionsConfig,
        listener: ActionListener | None = None,
        counter: ActionCounter | None = None,
        gate: ActionGate | None = None,
    ) -> None:
        self._store = store
        self._gate = gate
        self._registry = registry
        self._config = config
        self.listener = listener
        self._counter = counter
        self._claimed: set[int] = set()
        self._claim_lock = threading.Lock()
        self._pass_lock = threading.Lock()
        # whether an incident's remediation step was open at the last pass (the report
        # service answers spares `report_in_s` meanwhile: a warm standby may be assigned)
        self.remediating = False

    # --- recovery ---------------------------------------------------------------------------

    def recover(self, *, now: float) -> int:
        """Deal with rows left `running` by a previous process; returns how many."""
        count = 0
        for action, _ in self._store.actions.open():
            if action.state != "running":
                continue
            count += 1
            handler = self._registry.get(action.kind)
            timeline_id = action.incident_id
            if handler.idempotent(action.params):
                message = (
                    f"{action.kind} was running when the controller stopped; resuming"
                    f" (idempotent for key {action.idempotency_key})"
                )
                self._store.actions.update(
                    action.id,
                    state="running",
                    ts=now,
                    next_attempt_at=now,
                    timeline=(timeline_id, "action_resumed", message, {"action_id": action.id})
                    if timeline_id is not None
                    else None,
                )
                log.info("event=action_resumed action=%d kind=%s", action.id, action.kind)
            else:
                reason = (
                    f"{action.kind} was interrupted by a controller restart; its backend cannot"
                    " dedupe a repeat, so it is not re-sent (delivered at most once)"
                )
                self._finish(action, state="failed", message=reason, now=now, output=None)
                log.warning("event=action_interrupted action=%d kind=%s", action.id, action.kind)
                if self.listener is not None:
                    self.listener.escalate(action, reason=reason, now=now)
        return count

    # --- running ----------------------------------------------------------------------------

    def next_due_at(self) -> float | None:
        due = [at for _, at in self._store.actions.open()]
        return min(due) if due else None

    def run_due(self, *, now: float, max_passes: int = 10) -> int:
        """Run every step that is due now and not waiting on an earlier step; passes repeat
        (bounded) while steps ran, so rows they added (escalations) are not left waiting."""
        total = 0
        for _ in range(max_passes):
            ran = self._pass(now=now)
            total += ran
            if ran == 0:
                break
        return total

    def _pass(self, *, now: float) -> int:
        with self._pass_lock:
            open_rows = self._store.actions.open()
            due_at = {a.id: at for a, at in open_rows}
            by_incident: dict[int, list[ActionView]] = defaultdict(list)
            ran = 0
            self.remediating = any(
                a.incident_id is not None and self._registry.get(a.kind).remediation
                for a, _ in open_rows
            )
            for action, at in open_rows:
                if action.incident_id is None:
                    if at <= now and self._run_claimed(action, now=now):
                        ran += 1
                else:
                    by_incident[action.incident_id].append(action)
            for incident_id in sorted(by_incident):
                ran += self._run_plan(incident_id, due_at=due_at, now=now)
            return ran

    def run_one(self, action_id: int, *, now: float) -> ActionView:
        """Run one step now (an operator's drain), unless the worker is already on it."""
        action = self._store.actions.get(action_id)
        if action is None:
            raise KeyError(action_id)
        if action.state not in TERMINAL_ACTION_STATES:
            self._run_claimed(action, now=now)
        result = self._store.actions.get(action_id)
        assert result is not None
        return result

    def _run_plan(self, incident_id: int, *, due_at: dict[int, float], now: float) -> int:
        ran = 0
        waiting = False
        failed: ActionView | None = None
        for action in self._store.actions.for_incident(incident_id):
            handler = self._registry.get(action.kind)
            if action.state in TERMINAL_ACTION_STATES:
                if handler.remediation and action.state == "failed":
                    failed = action
                continue
            if handler.remediation:
                if failed is not None:
                    self._finish(
                        action,
                        state="skipped",
                        message=f"skipped: earlier step {failed.kind} (#{failed.id}) failed",
                        now=now,
                        output=None,
                    )
                    continue
                if waiting:
                    continue
            if due_at.get(action.id, now) <= now and self._run_claimed(action, now=now):
                ran += 1
            if handler.remediation:
                after = self._store.actions.get(action.id)
                if after is None or after.state not in TERMINAL_ACTION_STATES:
                    waiting = True
                elif after.state == "failed":
                    failed = after
        return ran

    def _run_claimed(self, action: ActionView, *, now: float) -> bool:
        with self._claim_lock:
            if action.id in self._claimed:
                return False
            self._claimed.add(action.id)
        try:
            fresh = self._store.actions.get(action.id)
            if fresh is None or fresh.state in TERMINAL_ACTION_STATES:
                return False
            self._execute(fresh, now=now)
            return True
        finally:
            with self._claim_lock:
                self._claimed.discard(action.id)

    def _previous_outputs(self, action: ActionView) -> dict[str, dict[str, object]]:
        if action.incident_id is None:
            return {}
        out: dict[str, dict[str, object]] = {}
        for other in self._store.actions.for_incident(action.incident_id):
            if other.id == action.id:
                break
            if other.state == "succeeded":
                out[other.kind] = self._store.actions.output(other.id)
        return out

    def _execute(self, action: ActionView, *, now: float) -> None:
        handler = self._registry.get(action.kind)
        first = action.state == "pending"
        why = self._gate(action, now) if first and self._gate is not None else None
        if why is not None:
            self._finish(action, state="skipped", message=f"skipped: {why}", now=now, output=None)
            return
        attempt = action.attempts + (1 if first else 0)
        incident_id = action.incident_id
        if first:
            self._store.actions.update(
                action.id,
                state="running",
                ts=now,
                attempts_delta=1,
                timeline=(
                    incident_id,
                    "action_started",
                    f"{self._label(action)} started (attempt {attempt})",
                    {"action_id": action.id, "attempt": attempt},
                )
                if incident_id is not None
                else None,
            )
            if self.listener is not None:
                self.listener.on_action_started(action, handler, now=now)
        progress = self._store.actions.output(action.id)
        recovering = not first and not progress
        incident = self._store.incidents.get(incident_id) if incident_id is not None else None
        current = self._store.actions.get(action.id)
        assert current is not None
        ctx = ActionContext(
            action=current,
            incident=incident,
            now=now,
            attempt=attempt,
            previous=self._previous_outputs(action),
            progress=progress,
            recovering=recovering,
        )
        # HA: the step's side effects (an agent command, a webhook, scontrol) follow a store
        # round trip that proves this controller still holds the lease; a deposed leader
        # raises LeaseLost here and does nothing
        self._store.check_fence()
        try:
            outcome = handler.run(ctx)
        except TransientError as e:
            self._transient(current, attempt=attempt, error=str(e), now=now)
            return
        except PermanentError as e:
            self._fail(current, reason=str(e), now=now)
            return
        except (StoreUnavailable, LeaseLost) as e:
            # the store or the lease went while the step ran: the step is not the one that
            # failed; it stays running and is taken up again by whoever leads next
            log.warning(
                "event=action_interrupted action=%d kind=%s reason=%s",
                action.id,
                action.kind,
                type(e).__name__,
            )
            raise
        except Exception as e:
            log.exception("event=action_error action=%d kind=%s", action.id, action.kind)
            self._fail(current, reason=f"internal error: {type(e).__name__}: {e}", now=now)
            return
        self._apply(current, outcome, first=first, now=now)

    def _apply(self, action: ActionView, outcome: Outcome, *, first: bool, now: float) -> None:
        if not outcome.done:
            timeline = None
            if action.incident_id is not None and (first or outcome.message != action.result):
                timeline = (
                    action.incident_id,
                    "action_progress",
                    f"{self._label(action)}: {outcome.message}",
                    {"action_id": action.id},
                )
            self._store.actions.update(
                action.id,
                state="running",
                ts=now,
                result=outcome.message,
                output=outcome.output,
                next_attempt_at=now + outcome.poll_after_s,
                timeline=timeline,
            )
            return
        state = "skipped" if outcome.skipped else "succeeded"
        self._finish(action, state=state, message=outcome.message, now=now, output=outcome.output)

    def _transient(self, action: ActionView, *, attempt: int, error: str, now: float) -> None:
        if attempt >= self._config.max_attempts:
            self._fail(action, reason=f"gave up after {attempt} attempts: {error}", now=now)
            return
        delay_s = backoff_s(
            attempt, initial_s=self._config.backoff_initial_s, max_s=self._config.backoff_max_s
        )
        message = f"{self._label(action)} attempt {attempt} failed: {error}; retry in {delay_s:g} s"
        self._store.actions.update(
            action.id,
            state="pending",
            ts=now,
            result=error,
            next_attempt_at=now + delay_s,
            timeline=(action.incident_id, "action_retry", message, {"action_id": action.id})
            if action.incident_id is not None
            else None,
        )
        if self._counter is not None:
            self._counter.count(action.kind, "retried")
        log.warning(
            "event=action_retry action=%d kind=%s attempt=%d delay_s=%g error=%s",
            action.id,
            action.kind,
            attempt,
            delay_s,
            error,
        )

    def _fail(self, action: ActionView, *, reason: str, now: float) -> None:
        self._finish(action, state="failed", message=reason, now=now, output=None)
        if self.listener is not None:
            self.listener.escalate(action, reason=reason, now=now)

    def _finish(
        self,
        action: ActionView,
        *,
        state: str,
        message: str,
        now: float,
        output: dict[str, object] | None,
    ) -> None:
        kind = {"succeeded": "action_succeeded", "failed": "action_failed"}.get(
            state, "action_skipped"
        )
        text = f"{self._label(action)} {state}" + (f": {message}" if message else "")
        data: dict[str, object] = {"action_id": action.id}
        for key in TIMELINE_OUTPUT_KEYS:
            if output is not None and key in output:
                data[key] = output[key]
        self._store.actions.update(
            action.id,
            state=state,
            ts=now,
            result=message,
            output=output,
            timeline=(action.incident_id, kind, text, data)
            if action.incident_id is not None
            else None,
        )
        if self._counter is not None:
            self._counter.count(action.kind, state)
        log_fn = log.warning if state == "failed" else log.info
        log_fn(
            "event=action_%s action=%d kind=%s incident=%s key=%s",
            state,
            action.id,
            action.kind,
            action.incident_id,
            action.idempotency_key,
        )
        if self.listener is not None:
            done = self._store.actions.get(action.id)
            if done is not None:
                self.listener.on_action_finished(done, now=now)

    @staticmethod
    def _label(action: ActionView) -> str:
        return step_label(action)


def step_label(action: ActionView) -> str:
    """How the timeline names a step: "step notify (slack) #12", "step drain #13"."""
    channel = action.params.get("channel")
    suffix = f" ({channel})" if channel else ""
    return f"step {action.kind}{suffix} #{action.id}"


__all__ = [
    "TIMELINE_OUTPUT_KEYS",
    "ActionCounter",
    "ActionGate",
    "ActionListener",
    "ActionRunner",
    "step_label",
]
