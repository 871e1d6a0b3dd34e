"""The Prometheus alerts docs/controller.md gives for the controllers themselves (no leader, a
failover, the store unreachable) are real rules: the block as the docs print it passes
`promtool check rules`, `promtool test rules` shows each firing on the series a controller
exports, and every metric they read is one a controller does export."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest

from tests.integration.test_rules_export_promtool import _promtool
from trainguard.controller.ha import HaMetrics
from trainguard.controller.metrics import ControllerMetrics
from trainguard.controller.storewatch import StoreWatch

DOC = Path(__file__).resolve().parents[2] / "docs" / "controller.md"


def doc_alerts() -> list[dict[str, Any]]:
    """The YAML block of docs/controller.md that defines trainguard_controller_no_leader."""
    for block in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), flags=re.S):
        if "alert: trainguard_controller_no_leader" in block:
            rules = yaml.safe_load(block)
            assert isinstance(rules, list)
            return rules
    raise AssertionError("docs/controller.md has no controller alert block")


def write_rules(path: Path) -> list[dict[str, Any]]:
    rules = doc_alerts()
    path.write_text(yaml.safe_dump({"groups": [{"name": "controller", "rules": rules}]}))
    return rules


def test_the_documented_controller_alerts_pass_promtool_check(tmp_path: Path) -> None:
    rules = write_rules(tmp_path / "controller-alerts.yml")
    assert {r["alert"] for r in rules} == {
        "trainguard_controller_no_leader",
        "trainguard_controller_failover",
        "trainguard_controller_store_down",
    }
    proc = subprocess.run(
        [_promtool(), "check", "rules", str(tmp_path / "controller-alerts.yml")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_documented_controller_alerts_fire_on_what_a_controller_exports(
    tmp_path: Path,
) -> None:
    rules = write_rules(tmp_path / "controller-alerts.yml")
    # every series the alerts read is one a controller exports
    metrics = ControllerMetrics()
    StoreWatch(
        probe=lambda: None,
        notifiers=[],
        instance="ctl-1",
        store="postgresql://x@db/tg",
        page_after_s=10,
        registry=metrics.registry,
    )
    HaMetrics(metrics)
    exported = generate_latest(metrics.registry).decode()
    for rule in rules:
        for name in re.findall(r"trainguard_controller_\w+", rule["expr"]):
            assert f"# TYPE {name} " in exported, name
    tests = {
        "rule_files": ["controller-alerts.yml"],
        "evaluation_interval": "15s",
        "tests": [
            {
                "interval": "15s",
                "input_series": [
                    # two controllers: one leading, then the store goes and neither leads
                    {"series": 'trainguard_controller_leader{instance="a"}', "values": "1 1 0x10"},
                    {"series": 'trainguard_controller_leader{instance="b"}', "values": "0x12"},
                    {
                        "series": 'trainguard_controller_store_up{instance="a"}',
                        "values": "1 1 0x10",
                    },
                    {
                        "series": 'trainguard_controller_leadership_changes_total{instance="a",'
                        'change="lost"}',
                        "values": "0 0 1x10",
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "15s", "alertname": "trainguard_controller_store_down"},
                    {"eval_time": "15s", "alertname": "trainguard_controller_no_leader"},
                    {
                        "eval_time": "2m",
                        "alertname": "trainguard_controller_store_down",
                        "exp_alerts": [
                            {
                                "exp_labels": {"instance": "a", "severity": "critical"},
                                "exp_annotations": {
                                    "summary": "a trainguard controller cannot reach its "
                                    "PostgreSQL store"
                                },
                            }
                        ],
                    },
                    {
                        "eval_time": "2m",
                        "alertname": "trainguard_controller_no_leader",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "critical"},
                                "exp_annotations": {
                                    "summary": "no trainguard controller leads: nothing is "
                                    "being remediated"
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "tests.yml").write_text(yaml.safe_dump(tests, sort_keys=False))
    proc = subprocess.run(
        [_promtool(), "test", "rules", "tests.yml"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
