"""Action worker: ordering, retries with backoff (FakeClock), permanent failure and
escalation, output feeding later steps, and recovery of rows left running by a crash; each on
both store backends (the exactly-once guarantees are the store's as much as the worker's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.builders import Reporter
from tests.integration.postgres_proc import BOTH_STORES
from trainguard.controller.actions.base import (
    ActionContext,
    Outcome,
    PermanentError,
    TransientError,
)
from trainguard.controller.actions.notify import RecordingNotifier
from trainguard.controller.model import Decision, Target
from trainguard.controller.store.errors import LeaseLost, StoreUnavailable

pytestmark = BOTH_STORES


def _decision(actions: tuple[str, ...], node: str = "n1") -> Decision:
    return Decision(
        rule="gpu_dbe",
        target=Target(scope="gpu", node=node, gpu=0),
        state="firing",
        severity="critical",
        actions=actions,
    )


@dataclass
class StepHandler:
    """A remediation step that records its contexts and returns/raises what it is told."""

    kind: str
    script: list[Any] = field(default_factory=list)
    seen: list[ActionContext] = field(default_factory=list)
    remediation: bool = True
    is_idempotent: bool = True

    def idempotent(self, params: dict[str, Any]) -> bool:
        return self.is_idempotent

    def run(self, ctx: ActionContext) -> Outcome:
        self.seen.append(ctx)
        item = self.script.pop(0) if self.script else Outcome(message="ok")
        if isinstance(item, Exception):
            raise item
        return item


def _core_with(make_core, core_clock, *handlers, notifiers=None):
    c = make_core(notifiers=notifiers)
    for h in handlers:
        c.registry.register(h)
    c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    return c


def test_transient_failures_retry_with_doubling_backoff_then_succeed(make_core, core_clock):
    step = StepHandler("checkpoint", script=[TransientError("busy"), TransientError("busy")])
    c = _core_with(make_core, core_clock, step)
    c.apply_decisions([_decision(("checkpoint",))], now=core_clock.now())
    start = core_clock.now()
    c.run_actions(now=start)
    (action,) = c.get_incident(1).actions
    assert (action.state, action.attempts) == ("pending", 1)
    assert c.store.actions.next_attempt_at(action.id) == start + 2.0
    c.run_actions(now=start + 1.9)  # not yet due
    assert len(step.seen) == 1
    c.run_actions(now=start + 2.0)
    assert c.store.actions.next_attempt_at(action.id) == start + 2.0 + 4.0
    c.run_actions(now=start + 6.0)
    (action,) = c.get_incident(1).actions
    assert (action.state, action.attempts) == ("succeeded", 3)
    assert [ctx.attempt for ctx in step.seen] == [1, 2, 3]
    assert c.metrics.actions_total.labels(kind="checkpoint", result="retried")._value.get() == 2


def test_retries_are_bounded_then_fail_and_escalate(make_core, core_clock, core_notifier):
    step = StepHandler("checkpoint", script=[TransientError("down")] * 5)
    c = _core_with(make_core, core_clock, step)
    c.apply_decisions([_decision(("checkpoint",))], now=core_clock.now())
    t = core_clock.now()
    for _ in range(5):
        c.run_actions(now=t)
        t += 100
    (action, *pages) = c.get_incident(1).actions
    assert (action.state, action.attempts) == ("failed", 3)
    assert "gave up after 3 attempts" in action.result
    assert [p.params["page"] for p in pages] == [True]
    assert [n.page for n in core_notifier.sent] == [True]


def test_permanent_error_fails_at_once_and_skips_later_remediation(make_core, core_clock):
    first = StepHandler("checkpoint", script=[PermanentError("bad request")])
    later = StepHandler("restart")
    c = _core_with(make_core, core_clock, first, later)
    c.apply_decisions([_decision(("checkpoint", "restart", "notify"))], now=core_clock.now())
    c.run_actions(now=core_clock.now())
    states = {a.kind: a.state for a in c.get_incident(1).actions if not a.params.get("page")}
    assert states == {"checkpoint": "failed", "restart": "skipped", "notify": "succeeded"}
    assert later.seen == []


def test_a_steps_output_feeds_the_later_steps(make_core, core_clock):
    ckpt = StepHandler("checkpoint", script=[Outcome(message="ok", output={"step": 1200})])
    restart = StepHandler("restart")
    c = _core_with(make_core, core_clock, ckpt, restart)
    c.apply_decisions([_decision(("checkpoint", "restart"))], now=core_clock.now())
    c.run_actions(now=core_clock.now())
    assert restart.seen[0].previous["checkpoint"] == {"step": 1200}


def test_remediation_steps_wait_for_a_polling_step(make_core, core_clock):
    ckpt = StepHandler(
        "checkpoint", script=[Outcome(message="waiting", done=False, output={"req": "r1"})]
    )
    restart = StepHandler("restart")
    c = _core_with(make_core, core_clock, ckpt, restart)
    c.apply_decisions([_decision(("checkpoint", "restart"))], now=core_clock.now())
    c.run_actions(now=core_clock.now())
    assert restart.seen == []
    c.run_actions(now=core_clock.now() + 1.0)
    assert ckpt.seen[1].progress == {"req": "r1"} and ckpt.seen[1].attempt == 1
    assert len(restart.seen) == 1


def test_failed_notification_pages_through_the_other_channels(make_core, core_clock):
    slack = RecordingNotifier("slack", errors=[PermanentError("slack: HTTP 404: no_service")])
    pager = RecordingNotifier("pager", min_severity="critical")
    c = _core_with(make_core, core_clock, notifiers=[slack, pager])
    c.apply_decisions([_decision(("notify",))], now=core_clock.now())
    c.run_actions(now=core_clock.now())
    assert slack.sent == []
    assert [n.page for n in pager.sent] == [False, True]
    assert "no_service" in pager.sent[1].reason
    assert c.metrics.notifications_failed_total.labels(channel="slack")._value.get() == 1


def test_after_restart_running_idempotent_step_is_resumed(make_core, core_clock):
    step = StepHandler("checkpoint", is_idempotent=True)
    c = _core_with(make_core, core_clock, step)
    c.apply_decisions([_decision(("checkpoint",))], now=core_clock.now())
    (action,) = c.get_incident(1).actions
    # as if the process died after marking the row running
    c.store.actions.update(action.id, state="running", ts=core_clock.now(), attempts_delta=1)
    c.stop()
    c2 = make_core()
    c2.registry.register(step)
    c2.runner.recover(now=core_clock.now())
    c2.run_actions(now=core_clock.now())
    (action,) = c2.get_incident(1).actions
    assert (action.state, action.attempts) == ("succeeded", 1)
    assert any(t.kind == "action_resumed" for t in c2.get_incident(1).timeline)


def test_after_restart_running_non_idempotent_step_is_not_repeated(make_core, core_clock):
    slack = RecordingNotifier("slack", idempotent=False)
    pager = RecordingNotifier("pager", min_severity="critical")
    c = _core_with(make_core, core_clock, notifiers=[slack, pager])
    c.apply_decisions([_decision(("notify",))], now=core_clock.now())
    slack_row = next(a for a in c.get_incident(1).actions if a.params["channel"] == "slack")
    c.store.actions.update(slack_row.id, state="running", ts=core_clock.now(), attempts_delta=1)
    c.stop()
    c2 = make_core(notifiers=[slack, pager])  # recover() runs in the constructor
    c2.run_actions(now=core_clock.now())
    row = c2.store.actions.get(slack_row.id)
    assert row.state == "failed" and "at most once" in row.result
    assert slack.sent == []
    assert [n.page for n in pager.sent] == [False, True]


def test_succeeded_rows_are_never_run_again_after_restart(make_core, core_clock, core_notifier):
    c = _core_with(make_core, core_clock)
    c.apply_decisions([_decision(("notify",))], now=core_clock.now())
    c.run_actions(now=core_clock.now())
    c.stop()
    c2 = make_core()
    c2.run_actions(now=core_clock.now() + 100)
    assert len(core_notifier.sent) == 1


@pytest.mark.parametrize(
    "error",
    [
        pytest.param(StoreUnavailable("postgresql://db/x: connection lost: EOF"), id="store"),
        pytest.param(LeaseLost("the lease is no longer this controller's"), id="lease-lost"),
    ],
)
def test_a_step_that_loses_the_store_or_the_lease_is_not_failed_and_runs_again(
    make_core, core_clock, core_notifier, error
):
    step = StepHandler("checkpoint", script=[error])
    later = StepHandler("restart")
    c = _core_with(make_core, core_clock, step, later)
    c.apply_decisions([_decision(("checkpoint", "restart"))], now=core_clock.now())
    with pytest.raises(type(error)):
        c.run_actions(now=core_clock.now())
    (action, restart) = c.get_incident(1).actions
    assert (action.state, action.attempts) == ("running", 1)  # neither failed nor retried
    assert restart.state == "pending" and later.seen == []
    assert core_notifier.sent == []  # no escalation page
    c.run_actions(now=core_clock.now() + 1.0)  # the store back: taken up again
    states = [(a.kind, a.state, a.attempts) for a in c.get_incident(1).actions]
    assert states == [("checkpoint", "succeeded", 1), ("restart", "succeeded", 1)]
    assert len(step.seen) == 2 and step.seen[1].recovering
