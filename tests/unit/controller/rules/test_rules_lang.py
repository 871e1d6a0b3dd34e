"""The condition language: parse errors name the column and the reason; evaluation follows the
documented absent-value semantics."""

from __future__ import annotations

import math

import pytest

from trainguard.controller.model import Target
from trainguard.controller.rules.lang import (
    ConditionError,
    compile_condition,
    format_duration,
    parse_condition,
    parse_duration,
)
from trainguard.controller.signals import SignalState
from trainguard.model import GpuSample
from trainguard.protocol import RankState, Report

BAD = [
    ("unknown-signal", "gpu", "temprature_celsius > 90", "unknown signal 'temprature_celsius'"),
    ("did-you-mean", "gpu", "temprature_celsius > 90", "did you mean 'temperature_celsius'"),
    ("signal-of-other-scope", "gpu", "heartbeat_age_s > 30", "for scope gpu"),
    ("unknown-function", "gpu", "rat(xid_total[5m]) > 0", "unknown function 'rat'"),
    ("rate-without-window", "gpu", "rate(xid_total) > 0", "needs a window"),
    ("window-on-abs", "gpu", "abs(power_watts[5m]) > 0", "takes no window"),
    ("two-arguments", "gpu", "increase(xid_total[5m], 2) > 0", "exactly one argument"),
    ("no-argument", "gpu", "finite() or lost == 1", "exactly one argument"),
    ("rate-of-expression", "gpu", "rate((xid_total + 1)[5m]) > 0", "takes a signal name"),
    ("zero-window", "gpu", "rate(xid_total[0s]) > 0", "longer than 0s"),
    ("number-window", "gpu", "rate(xid_total[5]) > 0", "expected a duration"),
    ("duration-outside-window", "rank", "step_age_s > 2m", "only allowed in windows"),
    ("not-boolean", "gpu", "temperature_celsius + 1", "must be true/false"),
    ("and-on-numbers", "gpu", "temperature_celsius and lost == 1", "'and' needs true/false"),
    ("string-ordering", "node", 'role > "active"', "strings compare only with == and !="),
    ("string-vs-number", "node", "role == 1", "cannot compare a string with a number"),
    ("chained", "gpu", "1 < temperature_celsius < 90", "do not chain"),
    ("unterminated-string", "node", 'role == "active', "unterminated string"),
    ("bad-character", "gpu", "lost == 1 ; drop", "unexpected character ';'"),
    ("empty", "gpu", "   ", "empty condition"),
    ("unbalanced", "gpu", "(lost == 1", "expected ')'"),
    ("trailing", "gpu", "lost == 1 lost", "unexpected 'lost'"),
    ("job-agg-outside-rank", "gpu", "power_watts > job_median(power_watts)", "only in rank"),
    ("list-type", "node", "role in [1, 2]", "list item is a number"),
    ("bad-unit", "gpu", "rate(xid_total[5x]) > 0", "invalid number or duration"),
    ("arith-on-string", "node", "role + 1 > 2", "needs numbers"),
]


@pytest.mark.parametrize(
    ("scope", "source", "reason"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_bad_condition_is_rejected_with_reason_and_column(
    scope: str, source: str, reason: str
) -> None:
    with pytest.raises(ConditionError) as exc:
        parse_condition(source, scope)
    assert reason in str(exc.value)
    assert str(exc.value).startswith("column ")
    assert 0 <= exc.value.pos <= len(source)


def test_error_column_points_at_the_offending_token() -> None:
    with pytest.raises(ConditionError) as exc:
        parse_condition("lost == 1 or bogus > 2", "gpu")
    assert exc.value.pos == len("lost == 1 or ")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("0s", 0), ("90s", 90), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("2d", 172800)],
    ids=["zero", "seconds", "minutes", "compound", "millis", "days"],
)
def test_durations_parse_and_format_round_trip(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds
    assert parse_duration(format_duration(seconds)) == seconds


@pytest.mark.parametrize("text", ["5", "1.5m", "m", "-5s", "5 m", "5min"], ids=str)
def test_invalid_durations_are_rejected(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


# --- evaluation -----------------------------------------------------------------------------

NOW = 1_700_000_000.0


def _signals(**gpu_fields: object) -> SignalState:
    s = SignalState()
    g = GpuSample(index=0, uuid="GPU-0", pci_bus_id="0000:18:00.0", name="H100", **gpu_fields)  # type: ignore[arg-type]
    ranks = (
        RankState(job="j", rank=0, step=10, step_time_s=1.0, loss=1.0),
        RankState(job="j", rank=1, step=12, step_time_s=2.0, loss=math.nan),
        RankState(job="j", rank=2, step=11, step_time_s=4.0),
    )
    s.ingest(
        Report(node="n1", instance="i", seq=1, sent_at=NOW, gpus=(g,), ranks=ranks),
        now=NOW,
        new_events=(),
    )
    s.set_node_meta("n1", role="active", state="active", job="j")
    return s


GPU = Target("gpu", node="n1", gpu=0)


def _holds(source: str, signals: SignalState, target: Target = GPU) -> bool:
    compiled = compile_condition(parse_condition(source, target.scope), target.scope)
    ctx = signals.context_for(target, now=NOW + 2)
    assert ctx is not None
    return compiled.test(ctx)


TRUTH = [
    ("precedence", "temperature_celsius + 10 * 2 == 70", True),
    ("parens", "(temperature_celsius + 10) * 2 == 120", True),
    ("unary-minus", "-temperature_celsius < -40", True),
    ("division", "power_watts / 2 == 200", True),
    ("divide-by-zero-is-absent", "power_watts / 0 > 0 or power_watts / 0 <= 0", False),
    ("bool-as-number", "lost == 0 and throttle_hw_slowdown == 1", True),
    ("absent-comparison-false", "ecc_corrected_volatile_total >= 0", False),
    ("not-absent-is-still-false", "not (ecc_corrected_volatile_total > 5)", False),
    ("absent-or-true", "ecc_corrected_volatile_total > 5 or lost == 0", True),
    ("absent-and-false", "ecc_corrected_volatile_total > 5 and lost == 1", False),
    ("finite-absent-false", "finite(ecc_corrected_volatile_total)", False),
    ("finite-present", "finite(temperature_celsius)", True),
    ("present", "present(temperature_celsius) and not present(ecc_corrected_volatile_total)", True),
    ("in-list", "xid_total in [0, 1]", True),
    ("not-in-list", "xid_total not in [0, 1]", False),
    ("abs", "abs(0 - temperature_celsius) == 50", True),
    ("rate-of-unchanged-counter", "rate(xid_total[5m]) == 0", True),
    ("age-since-first-seen", "age(xid_total) == 2", True),
]


@pytest.mark.parametrize(("source", "expected"), [t[1:] for t in TRUTH], ids=[t[0] for t in TRUTH])
def test_condition_evaluates(source: str, expected: bool) -> None:
    s = _signals(temperature_celsius=50.0, power_watts=400.0, throttle_hw_slowdown=True)
    assert _holds(source, s) is expected


def test_unknown_signal_inside_present_is_a_load_error_not_false() -> None:
    with pytest.raises(ConditionError, match="unknown signal 'power_brake_x'"):
        parse_condition("present(power_brake_x)", "gpu")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('role == "active" and state in ["active", "draining"]', True),
        ('job == "other"', False),
        ("report_age_s == 2", True),
        ("gpus == 1 and gpus_lost == 0", True),
    ],
    ids=["role-and-state", "job-mismatch", "report-age", "gpu-counts"],
)
def test_node_signals_evaluate(source: str, expected: bool) -> None:
    assert _holds(source, _signals(), Target("node", node="n1")) is expected


@pytest.mark.parametrize(
    ("source", "rank", "expected"),
    [
        ("step_time_s == job_median(step_time_s)", 1, True),
        ("step_time_s == job_max(step_time_s) and job_count(step_time_s) == 3", 2, True),
        ("step_time_s == job_min(step_time_s)", 0, True),
        ("not finite(loss)", 1, True),
        ("not finite(loss)", 0, False),
        ("present(loss) and not finite(loss)", 2, False),
        ("heartbeat_age_s == 2 and step_age_s == 2", 0, True),
    ],
    ids=[
        "median",
        "max-and-count",
        "min",
        "nan-loss",
        "finite-loss",
        "absent-loss",
        "aged-by-report",
    ],
)
def test_rank_signals_and_job_aggregates(source: str, rank: int, expected: bool) -> None:
    target = Target("rank", node="n1", job="j", rank=rank)
    assert _holds(source, _signals(), target) is expected


def test_median_of_even_count_is_the_mean_of_the_middle_two() -> None:
    s = _signals()
    s.ingest(
        Report(
            node="n2",
            instance="i",
            seq=1,
            sent_at=NOW,
            ranks=(RankState(job="j", rank=3, step=1, step_time_s=3.0),),
        ),
        now=NOW,
        new_events=(),
    )
    assert _holds("job_median(step_time_s) == 2.5", s, Target("rank", job="j", rank=0))


LIMITS = [
    ("deep-parentheses", "(" * 90 + "temperature_celsius > 1" + ")" * 90, "nested more than 16"),
    ("deep-not", "not " * 40 + "temperature_celsius > 1", "nested more than 16"),
    ("deep-minus", "temperature_celsius > " + "-" * 40 + "1", "nested more than 16"),
    ("long-or-chain", " or ".join(["temperature_celsius > 1"] * 1000), "the limit is 2000"),
    ("many-tokens", " or ".join(["lost == 1"] * 150), "the limit is 400"),
    ("infinite-number", "temperature_celsius > 1e999", "out of range"),
    ("huge-number", "temperature_celsius > 1e16", "out of range"),
    ("window-too-long", "increase(xid_total[30d]) > 0", "longer than 1d"),
]


@pytest.mark.parametrize(("src", "reason"), [c[1:] for c in LIMITS], ids=[c[0] for c in LIMITS])
def test_oversized_conditions_are_clear_errors_not_recursion(src: str, reason: str) -> None:
    with pytest.raises(ConditionError) as e:
        parse_condition(src, "gpu")
    assert reason in str(e.value)


def test_conditions_at_the_limits_parse_and_evaluate() -> None:
    deep = "(" * 16 + "temperature_celsius > 1" + ")" * 16
    chain = " or ".join(["temperature_celsius > 1"] * 70)  # 1,886 characters, 279 tokens
    hot, cold = _signals(temperature_celsius=50.0), _signals(temperature_celsius=0.5)
    for src in (deep, chain):
        assert (_holds(src, hot), _holds(src, cold)) == (True, False)
    huge = ("temperature_celsius > 1e15", "temperature_celsius < 1e15")
    assert [_holds(src, hot) for src in huge] == [False, True]
    assert _holds("increase(xid_total[1d]) > 0", hot) is False
