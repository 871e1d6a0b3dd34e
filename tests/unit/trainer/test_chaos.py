"""TRAINGUARD_CHAOS parsing: valid specs become rules, bad ones fail naming the rule."""

from __future__ import annotations

import pytest

from trainguard.trainer.chaos import ChaosRule, ChaosSpecError, for_attempt, parse_chaos


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", ()),
        ("slow=0.2@rank1", (ChaosRule(kind="slow", rank=1, fraction=0.2),)),
        ("slow=0.5", (ChaosRule(kind="slow", fraction=0.5),)),
        ("hang@step30:rank2", (ChaosRule(kind="hang", step=30, rank=2),)),
        ("raise@step25", (ChaosRule(kind="raise", step=25),)),
        ("nan@step17", (ChaosRule(kind="nan", step=17),)),
        ("nan@rank0:step3", (ChaosRule(kind="nan", step=3, rank=0),)),
        ("pause_write@step20", (ChaosRule(kind="pause_write", step=20),)),
        (
            " nan@step17 , slow=0.1@rank0 ",
            (ChaosRule(kind="nan", step=17), ChaosRule(kind="slow", rank=0, fraction=0.1)),
        ),
    ],
    ids=["empty", "slow-rank", "slow-all", "hang", "raise", "nan", "rank-first", "pause", "two"],
)
def test_valid_specs_parse_to_rules(spec: str, expected: tuple[ChaosRule, ...]) -> None:
    assert parse_chaos(spec) == expected


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("explode@step3", "unknown kind 'explode'"),
        ("nan", "nan needs @stepK"),
        ("hang@rank1", "hang needs @stepK"),
        ("slow@rank1", "slow needs a fraction"),
        ("slow=fast", "not a number"),
        ("slow=0", "must be in (0, 100]"),
        ("nan=3@step2", "nan takes no value"),
        ("nan@step2:step3", "step given twice"),
        ("nan@stepX", "expected KIND"),
    ],
    ids=[
        "unknown",
        "nan-no-step",
        "hang-no-step",
        "slow-no-value",
        "slow-nan",
        "slow-zero",
        "value-on-nan",
        "two-steps",
        "garbage-scope",
    ],
)
def test_bad_specs_fail_naming_the_rule(spec: str, needle: str) -> None:
    with pytest.raises(ChaosSpecError) as e:
        parse_chaos(spec)
    assert needle in str(e.value)
    assert spec.split(",", maxsplit=1)[0].strip() in str(e.value)


def test_rule_scope_matches_step_and_rank() -> None:
    rule = ChaosRule(kind="hang", step=30, rank=2)
    assert rule.applies(step=30, rank=2)
    assert not rule.applies(step=30, rank=1)
    assert not rule.applies(step=29, rank=2)
    assert ChaosRule(kind="slow", fraction=0.2).applies(step=7, rank=5)


def test_a_step_scoped_slowdown_holds_from_that_step_on() -> None:
    rule = parse_chaos("slow=0.5@step10:rank1")[0]
    assert rule == ChaosRule(kind="slow", step=10, rank=1, fraction=0.5)
    assert [s for s in (9, 10, 11, 50) if rule.applies(step=s, rank=1)] == [10, 11, 50]
    assert not rule.applies(step=11, rank=0)
    assert for_attempt((rule,), "2") == ()


@pytest.mark.parametrize(
    ("attempt", "kinds"),
    [
        pytest.param(None, ["nan", "raise", "slow"], id="standalone-all"),
        pytest.param("", ["nan", "raise", "slow"], id="empty-all"),
        pytest.param("1", ["nan", "raise", "slow"], id="first-attempt-all"),
        pytest.param("2", ["slow"], id="restart-only-unscoped"),
        pytest.param("7", ["slow"], id="later-restart-only-unscoped"),
    ],
)
def test_step_scoped_rules_fire_only_in_the_first_attempt(
    attempt: str | None, kinds: list[str]
) -> None:
    rules = parse_chaos("nan@step17,raise@step3:rank1,slow=0.5@rank2")
    assert [r.kind for r in for_attempt(rules, attempt)] == kinds


def test_a_bad_attempt_value_fails_naming_it() -> None:
    with pytest.raises(ChaosSpecError, match="TRAINGUARD_ATTEMPT 'x'"):
        for_attempt(parse_chaos("nan@step1"), "x")
