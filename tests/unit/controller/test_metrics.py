"""Controller metrics: per-instance registry, values follow state, promtool-clean."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from prometheus_client import generate_latest

from tests.builders import Reporter


def test_metrics_follow_nodes_incidents_and_actions(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now(), dbe=1), actor="a")
    c.ingest_report(Reporter("n2").report(now=core_clock.now()), actor="a")
    c.set_role("n2", role="spare", actor="ops")
    c.tick()
    m = c.metrics
    assert m.nodes.labels(role="active", state="drained")._value.get() == 1
    assert m.nodes.labels(role="spare", state="active")._value.get() == 1
    assert m.incidents_open.labels(rule="gpu_dbe", severity="critical")._value.get() == 1
    assert m.actions_total.labels(kind="drain", result="succeeded")._value.get() == 1
    assert m.reports_total._value.get() == 2


def test_two_controllers_do_not_share_series(make_core, core_clock, tmp_path):
    a = make_core()
    a.ingest_report(Reporter("n1").report(now=0), actor="a")
    assert (
        a.metrics.registry is not make_core(store={"path": str(tmp_path / "b.db")}).metrics.registry
    )


def test_exposition_passes_promtool(make_core, core_clock):
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI") == "true":
            pytest.fail("promtool is required in CI (Debian package prometheus)")
        pytest.skip("promtool not installed (make deps installs it)")
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now(), dbe=1), actor="a")
    c.tick()
    c.metrics.report_ingest_seconds.observe(0.002)
    c.metrics.notifications_failed_total.labels(channel="slack").inc()
    text = generate_latest(c.metrics.registry)
    assert b"trainguard_controller_report_ingest_seconds_bucket" in text
    out = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, timeout=30, check=False
    )
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert out.stdout.strip() == b"" and out.stderr.strip() == b""
