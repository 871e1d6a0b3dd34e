"""The Prometheus export of rules/default.yaml passes the real `promtool check rules`."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

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
