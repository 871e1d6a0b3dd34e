"""The action kind table answers every question the separate kind sets used to answer (the
sets are written out here as they were), rule files list the same actions in the same words,
and the handler registry holds handlers to the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.controller.actionkinds import ActionKind, job_step_kinds, rule_actions
from trainguard.controller.actions.base import HandlerRegistry, UnavailableHandler
from trainguard.controller.backends.base import JOB_STEP_KINDS, Capability
from trainguard.controller.rules.loader import RuleError, load_rules

# The sets the table replaced, as they stood.
RULE_ACTIONS = (
    "notify",
    "page",
    "checkpoint",
    "drain",
    "replace",
    "restart",
    "rollback",
    "stop",
    "collect_stacks",
)  # controller/rules/loader.py ACTIONS
KNOWN_KINDS = {
    "notify",
    "page",
    "drain",
    "undrain",
    "checkpoint",
    "replace",
    "restart",
    "rollback",
    "stop",
    "collect_stacks",
}  # controller/actions/base.py
DISRUPTIVE_KINDS = {"drain", "replace", "restart", "rollback", "stop"}  # actions/base.py
JOB_STEPS = (
    "checkpoint",
    "replace",
    "restart",
    "rollback",
    "stop",
    "collect_stacks",
    "grow",
)  # controller/backends/base.py JOB_STEP_KINDS
STOPPING_KINDS = {"checkpoint", "drain", "grow", "replace", "restart", "rollback", "stop"}
NODE_REMOVING = {"drain", "replace"}  # controller/incidents.py
NOT_REMEDIATION = {"notify", "page", "checkpoint_interval"}  # the handlers' `remediation = False`
# kinds added since the sets were replaced: the node lifecycle's operator steps
LIFECYCLE_KINDS = {"validate", "retire"}  # controller/actions/lifecycle.py
REPAIR_KINDS = {"diagnose", "repair"}  # controller/actions/repairsteps.py (lifecycle.auto_repair)
AUTO_INTERVAL_KINDS = {"checkpoint_interval"}  # controller/ckptauto.py (a decision row)
# cloud replacement's step (controller/backends/aws/terminate.py) -> the capability it needs
CLOUD_KINDS = {"terminate_instance": "cloud_replace"}


def _members(prop: str) -> set[str]:
    return {k.value for k in ActionKind if _flag(k, prop)}


def _flag(kind: ActionKind, prop: str) -> bool:
    flags = {
        "disruptive": kind.disruptive,
        "stops_job": kind.stops_job,
        "removes_node": kind.removes_node,
        "job_step": kind.job_step,
        "remediation": kind.remediation,
        "in_rules": kind.in_rules,
    }
    return flags[prop]


def test_every_kind_the_old_sets_named_is_a_member_and_stored_as_the_same_string() -> None:
    every = (
        KNOWN_KINDS
        | set(JOB_STEPS)
        | set(RULE_ACTIONS)
        | STOPPING_KINDS
        | LIFECYCLE_KINDS
        | REPAIR_KINDS
        | AUTO_INTERVAL_KINDS
        | set(CLOUD_KINDS)
    )
    assert {k.value for k in ActionKind} == every
    for value in every:
        assert ActionKind(value).value == value
        assert ActionKind(value) == value  # compares equal to the stored row's string


@pytest.mark.parametrize(
    ("prop", "old"),
    [
        ("disruptive", DISRUPTIVE_KINDS),
        ("stops_job", STOPPING_KINDS),
        ("removes_node", NODE_REMOVING),
        ("job_step", set(JOB_STEPS)),
        ("in_rules", set(RULE_ACTIONS)),
        ("remediation", {k.value for k in ActionKind} - NOT_REMEDIATION),
    ],
    ids=["disruptive", "stops-job", "removes-node", "job-step", "in-rules", "remediation"],
)
def test_each_property_picks_the_members_of_the_set_it_replaced(prop: str, old: set[str]) -> None:
    assert _members(prop) == old


def test_ordered_lists_keep_their_order() -> None:
    assert rule_actions() == RULE_ACTIONS
    assert job_step_kinds() == JOB_STEPS
    assert JOB_STEP_KINDS == JOB_STEPS


def test_every_job_step_names_its_backend_capability_and_besides_only_cloud_steps_do() -> None:
    for kind in ActionKind:
        expected = kind.value if kind.job_step else CLOUD_KINDS.get(kind.value)
        assert kind.capability == expected
        if kind.capability is not None:
            assert Capability(kind.capability).value == kind.capability


def test_parse_answers_none_for_a_kind_outside_the_table() -> None:
    assert ActionKind.parse("drain") is ActionKind.DRAIN
    assert ActionKind.parse("reboot") is None


def test_a_rule_with_an_unknown_action_gets_the_same_message_as_before(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(
        "rules:\n  - name: r1\n    scope: gpu\n    condition: lost == 1\n"
        "    severity: critical\n    summary: s\n    actions: [notify, drian]\n"
    )
    with pytest.raises(RuleError) as exc:
        load_rules([path])
    assert exc.value.reason == (
        "actions: unknown action 'drian' (did you mean 'drain'?); allowed: notify, page,"
        " checkpoint, drain, replace, restart, rollback, stop, collect_stacks"
    )


def test_a_rule_may_not_list_an_operator_or_tick_kind(tmp_path: Path) -> None:
    for kind in ("undrain", "grow", "validate", "retire", "diagnose", "repair"):
        path = tmp_path / f"{kind}.yaml"
        path.write_text(
            "rules:\n  - name: r1\n    scope: gpu\n    condition: lost == 1\n"
            f"    severity: critical\n    summary: s\n    actions: [{kind}]\n"
        )
        with pytest.raises(RuleError, match=f"unknown action '{kind}'"):
            load_rules([path])


def test_the_registry_starts_with_every_kind_unavailable() -> None:
    registry = HandlerRegistry()
    assert registry.kinds() == sorted(k.value for k in ActionKind)
    for kind in ActionKind:
        assert isinstance(registry.get(kind.value), UnavailableHandler)
        assert not registry.available(kind.value)
    outcome = registry.get("reboot").run(None)  # type: ignore[arg-type]
    assert outcome.skipped and outcome.message == "skipped: unknown action kind 'reboot'"


class _Handler:
    def __init__(self, kind: str, *, remediation: bool) -> None:
        self.kind = kind
        self.remediation = remediation

    def idempotent(self, params: object) -> bool:
        return True

    def run(self, ctx: object) -> object:
        raise NotImplementedError


def test_the_registry_refuses_a_handler_that_disagrees_with_the_table() -> None:
    registry = HandlerRegistry()
    with pytest.raises(ValueError, match="remediation=True, the action kind table says False"):
        registry.register(_Handler("notify", remediation=True))  # type: ignore[arg-type]
    registry.register(_Handler("drain", remediation=True))  # type: ignore[arg-type]
    assert registry.available("drain")
    registry.register(_Handler("custom", remediation=True))  # type: ignore[arg-type]
    assert registry.get("custom").remediation is True
