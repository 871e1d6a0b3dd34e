"""Prometheus export: the rule-file shape, the signal -> metric mapping, and skipped rules."""

from __future__ import annotations

import pytest

from trainguard.controller.rules.export import PROM_SIGNALS, to_prometheus_rules
from trainguard.controller.rules.loader import RuleSet, default_rules_path, load_rules, parse_rules
from trainguard.controller.signals import SIGNALS


def _export(text: str) -> tuple[list[dict[str, object]], list[str]]:
    doc, warnings = to_prometheus_rules(RuleSet(rules=tuple(parse_rules(text)), sources=()))
    (group,) = doc["groups"]
    assert group["name"] == "trainguard"
    return group["rules"], warnings


def _one(scope: str, condition: str, **extra: str) -> str:
    lines = [
        "rules:",
        "  - name: r",
        f"    scope: {scope}",
        f"    condition: '{condition}'",
        "    severity: critical",
        "    summary: the summary",
    ]
    lines += [f"    {k}: {v}" for k, v in extra.items()]
    return "\n".join(lines) + "\n"


def test_rule_becomes_an_alert_with_for_labels_and_annotations() -> None:
    text = _one(
        "gpu",
        "temperature_celsius > 90",
        **{"for": "90s", "description": "hot", "labels": "{team: infra}"},
    )
    (alert,), warnings = _export(text)
    assert warnings == []
    assert alert == {
        "alert": "r",
        "expr": "(max by (node, gpu) (trainguard_gpu_temperature_celsius) > 90)",
        "for": "1m30s",
        "labels": {"severity": "critical", "scope": "gpu", "team": "infra"},
        "annotations": {"summary": "the summary", "description": "hot"},
    }


@pytest.mark.parametrize(
    ("scope", "condition", "expected"),
    [
        (
            "gpu",
            "increase(ecc_uncorrected_volatile_total[10m]) > 0",
            "max by (node, gpu) (increase(trainguard_gpu_ecc_errors_total"
            '{type="uncorrected",scope="volatile"}[10m]))',
        ),
        (
            "gpu",
            "increase(xid_fatal_total[5m]) > 0",
            'sum by (node, gpu) (((trainguard_gpu_xid_errors_total{severity="fatal"} unless '
            'trainguard_gpu_xid_errors_total{severity="fatal"} offset 5m) or '
            'increase(trainguard_gpu_xid_errors_total{severity="fatal"}[5m]))) > 0',
        ),
        (
            "node",
            "increase(xid_total[10m]) > 2",
            "sum by (node) (((trainguard_gpu_xid_errors_total unless "
            "trainguard_gpu_xid_errors_total offset 10m) or "
            "increase(trainguard_gpu_xid_errors_total[10m]))) > 2",
        ),
        (
            "gpu",
            "rate(xid_total[5m]) > 0.01",
            "sum by (node, gpu) (((trainguard_gpu_xid_errors_total unless "
            "trainguard_gpu_xid_errors_total offset 5m) / 300 or "
            "rate(trainguard_gpu_xid_errors_total[5m]))) > 0.01",
        ),
        (
            "ib_port",
            "changes(up[10m]) >= 4",
            "max by (node, device, port) (changes(trainguard_ib_port_up[10m])) >= 4",
        ),
        (
            "ib_port",
            "rate(symbol_error[5m]) > 1",
            'trainguard_ib_port_errors_total{counter="symbol_error"}[5m]',
        ),
        (
            "rank",
            "step_time_s > 1.1 * job_median(step_time_s)",
            "on(job) group_left() (1.1 * quantile by (job) "
            "(0.5, max by (job, rank) (trainguard_trainer_step_time_seconds)))",
        ),
        (
            "job",
            "samples_per_s < 0.7 * max_over_time(samples_per_s[15m])",
            "max_over_time(sum by (job) (trainguard_trainer_samples_per_second)[15m:])",
        ),
        (
            "gpu",
            "sm_clock_mhz < 1000",
            "(1e-06 * max by (node, gpu) (trainguard_gpu_sm_clock_hertz)) < 1000",
        ),
        (
            "rank",
            "not finite(loss)",
            "unless abs(max by (job, rank) (trainguard_trainer_loss)) < +Inf",
        ),
        (
            "gpu",
            "not (lost == 1 or power_watts > 700)",
            "((max by (node, gpu) (trainguard_gpu_lost) != 1) and "
            "(max by (node, gpu) (trainguard_gpu_power_watts) <= 700))",
        ),
        ("gpu", "xid_last_code in [79, 48]", None),
    ],
    ids=[
        "counter-increase",
        "fatal-xids",
        "xid-counter-born-in-the-window",
        "xid-rate-born-in-the-window",
        "flapping",
        "ib-counter",
        "job-median",
        "subquery",
        "scaled",
        "not-finite",
        "de-morgan",
        "controller-only",
    ],
)
def test_condition_translates_to_promql(scope: str, condition: str, expected: str | None) -> None:
    alerts, warnings = _export(_one(scope, condition))
    if expected is None:
        assert alerts == [] and len(warnings) == 1
        return
    assert warnings == []
    assert expected in alerts[0]["expr"]


@pytest.mark.parametrize(
    ("scope", "condition", "why"),
    [
        (
            "node",
            'report_age_s > 5 and role == "active"',
            "signal 'report_age_s' (node) has no Prometheus metric",
        ),
        ("gpu", "age(ecc_corrected_volatile_total) < 60", "age() has no PromQL equivalent"),
        ("gpu", "not present(power_watts)", "not present"),
    ],
    ids=["controller-only-signal", "age", "not-present"],
)
def test_unexpressible_rule_is_skipped_with_a_warning_naming_it(
    scope: str, condition: str, why: str
) -> None:
    alerts, warnings = _export(_one(scope, condition))
    assert alerts == []
    (w,) = warnings
    assert w.startswith("rule r: not exported to Prometheus: ")
    assert why in w


def test_mapping_table_only_names_catalogued_signals_with_trainguard_metrics() -> None:
    for scope, name in PROM_SIGNALS:
        assert name in SIGNALS[scope], (scope, name)
    assert all(p.selector.startswith("trainguard_") for p in PROM_SIGNALS.values())


def test_default_rules_export_keeps_most_rules() -> None:
    doc, warnings = to_prometheus_rules(load_rules([default_rules_path()]))
    exported = {r["alert"] for r in doc["groups"][0]["rules"]}
    skipped = {w.split()[1].rstrip(":") for w in warnings}
    assert exported | skipped == set(load_rules([default_rules_path()]).names())
    assert skipped <= {
        "node_silent",
        "spare_silent",
        "nan_loss",
        "gpu_lost",
        "job_process_failed",
        "preemption_notice",
    }
