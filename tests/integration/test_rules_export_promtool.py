"""The Prometheus export of rules/default.yaml passes the real `promtool check rules`, and
`promtool test rules` shows the fatal-XID alert firing on a counter series born at its first XID."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from trainguard.controller.rules.export import to_prometheus_rules
from trainguard.controller.rules.loader import default_rules_path, load_rules


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is required in CI (Debian package 'prometheus')")
        pytest.skip("promtool not installed")
    return path


def test_default_rules_export_passes_promtool_check_rules(tmp_path: Path) -> None:
    promtool = _promtool()
    doc, _ = to_prometheus_rules(load_rules([default_rules_path()]))
    assert doc["groups"][0]["rules"], "nothing exported"
    out = tmp_path / "trainguard-rules.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run(
        [promtool, "check", "rules", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(doc['groups'][0]['rules'])} rules found" in proc.stdout


def test_promtool_rejects_a_broken_expression(tmp_path: Path) -> None:
    """The check above can fail: promtool really parses what we write."""
    promtool = _promtool()
    out = tmp_path / "bad.yaml"
    bad = {"groups": [{"name": "x", "rules": [{"alert": "a", "expr": "sum by (job (x)"}]}]}
    out.write_text(yaml.safe_dump(bad))
    proc = subprocess.run(
        [promtool, "check", "rules", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0


# --- counters whose series are born at the first event (promtool test rules) ----------------

# The agent creates trainguard_gpu_xid_errors_total{xid="79",severity="fatal"} when it first
# sees XID 79, so the first sample already reads 1. 15 s samples; `_` is no sample, `stale` a
# restart. GPU -> (xid, the line's severity, samples).
XID_SERIES = {
    "0": ("79", "fatal", "_x28 1x60"),  # born at the first XID 79 (7 min in), never moves
    "1": ("79", "fatal", "3x40 stale _x3 1x40"),  # old news, agent restart, reborn (11m15s)
    "2": ("48", "fatal", "1x40 2x40"),  # one XID 48 long ago, a second one at 10m15s
    # a Nonfatal NVLink5 XID 145 (the link corrected it): never fires, though 145 is fatal
    # when its line says Fatal
    "3": ("145", "informational", "_x28 1x60"),
}
# (eval time, GPUs expected firing). Prometheus sees every series appear at 0s, so the first
# check comes 5 min later: an old count does not fire, a birth does, and 5 min after it the
# birth has left the window.
XID_EXPECTED = [
    ("6m", []),
    ("8m", ["0"]),
    ("11m30s", ["0", "1", "2"]),
    ("12m30s", ["1", "2"]),
    ("17m", []),
]


def _fatal_xid_unit_test(rules_file: Path, alert: dict[str, Any]) -> dict[str, Any]:
    series = [
        {
            "series": f'trainguard_gpu_xid_errors_total{{node="n1",gpu="{gpu}",uuid="GPU-{gpu}",'
            f'xid="{xid}",severity="{severity}"}}',
            "values": values,
        }
        for gpu, (xid, severity, values) in XID_SERIES.items()
    ]
    checks = [
        {
            "eval_time": at,
            "alertname": "gpu_fatal_xid",
            "exp_alerts": [
                {
                    "exp_labels": {"node": "n1", "gpu": gpu, **alert["labels"]},
                    "exp_annotations": alert["annotations"],
                }
                for gpu in gpus
            ],
        }
        for at, gpus in XID_EXPECTED
    ]
    return {
        "rule_files": [str(rules_file)],
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": series, "alert_rule_test": checks}],
    }


def _run_unit_test(promtool: str, tmp_path: Path, alert: dict[str, Any]) -> tuple[bool, str]:
    """`promtool test rules` of the scenario over this one alert: (passed, promtool's output)."""
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "t", "rules": [alert]}]}))
    test_file = tmp_path / "test.yaml"
    test_file.write_text(yaml.safe_dump(_fatal_xid_unit_test(rules_file, alert)))
    proc = subprocess.run(
        [promtool, "test", "rules", str(test_file)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode == 0, proc.stdout + proc.stderr


def _exported_alert(name: str) -> dict[str, Any]:
    doc, _ = to_prometheus_rules(load_rules([default_rules_path()]))
    (alert,) = [r for r in doc["groups"][0]["rules"] if r["alert"] == name]
    return dict(alert)


def test_exported_fatal_xid_alert_fires_on_a_series_born_at_its_first_xid(tmp_path: Path) -> None:
    passed, out = _run_unit_test(_promtool(), tmp_path, _exported_alert("gpu_fatal_xid"))
    assert passed, out


def test_plain_increase_misses_the_first_xid_which_is_why_the_export_counts_births(
    tmp_path: Path,
) -> None:
    """The scenario above can fail: `increase()` alone never sees a series born at 1."""
    alert = _exported_alert("gpu_fatal_xid")
    selector = re.search(r"\(\((trainguard_gpu_xid_errors_total\{[^}]*\})", alert["expr"])
    assert selector, alert["expr"]
    alert["expr"] = f"sum by (node, gpu) (increase({selector.group(1)}[5m])) > 0"
    passed, out = _run_unit_test(_promtool(), tmp_path, alert)
    assert not passed, out
    assert "alertname: gpu_fatal_xid, time: 8m" in out, out
