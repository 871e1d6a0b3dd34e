"""Exported alerts reach a receiver from the first fault: a real Prometheus scrapes a sim agent
and evaluates dashboards/alerts.yml, a real Alertmanager delivers to a webhook in the test.

Prometheus runs from dashboards/prometheus.yml as shipped (1 s intervals, the agent and the
Alertmanager as file_sd targets). The rules are the checked-in alerts.yml with one change:
every `for:` is rewritten to 0s in the copy, so the test needs no minute-long waits; the
expressions are the exported ones, untouched. XID 79 is injected on GPU 0 after Prometheus
has scraped the agent with no XID series at all (the agent creates that series at the first
XID, at 1), and a DBE on GPU 2 after it has scraped that GPU's ECC counter at 0.

The checked-in dashboards/alertmanager.yml is checked by amtool: config, routing, templates.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fakes.http_receiver import Receiver
from tests.helpers import short_tmpdir, wait_for
from tests.integration.agent_proc import AgentProcess
from tests.integration.prometheus_proc import (
    require_binary,
    start_alertmanager,
    start_prometheus,
    stop,
)
from trainguard.controller.model import Target
from trainguard.controller.rules.export import alert_labels
from trainguard.controller.rules.loader import load_rules
from trainguard.rules import shipped_dir

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
NODE = "node-1"
AM_PACKAGE = "prometheus-alertmanager"


def _alerts(receiver: Receiver) -> list[dict[str, Any]]:
    """Every alert of every notification Alertmanager has POSTed so far."""
    return [a for req in list(receiver.requests) for a in req.json()["alerts"]]


def _firing(receiver: Receiver, alertname: str, **labels: str) -> dict[str, Any] | None:
    for alert in _alerts(receiver):
        got = alert["labels"]
        if (
            alert["status"] == "firing"
            and got.get("alertname") == alertname
            and all(got.get(k) == v for k, v in labels.items())
        ):
            return alert
    return None


@dataclass
class Stack:
    agent: AgentProcess
    prometheus_url: str
    alertmanager_url: str
    receiver: Receiver
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def series(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


def _rules_without_for(workdir: Path) -> Path:
    """dashboards/alerts.yml with every `for:` set to 0s; expressions and labels as shipped."""
    doc = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            rule["for"] = "0s"
    path = workdir / "alerts.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _prometheus_config(workdir: Path, *, agent: str, alertmanager: str) -> Path:
    """dashboards/prometheus.yml as shipped, with 1 s intervals and these targets."""
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    targets = workdir / "targets"
    targets.mkdir()
    (targets / "agents-test.yml").write_text(yaml.safe_dump([{"targets": [agent]}]))
    (targets / "controller.yml").write_text("[]\n")
    (targets / "alertmanager.yml").write_text(yaml.safe_dump([{"targets": [alertmanager]}]))
    sds = [sd for s in config["scrape_configs"] for sd in s["file_sd_configs"]]
    sds += [sd for am in config["alerting"]["alertmanagers"] for sd in am["file_sd_configs"]]
    for sd in sds:
        sd["refresh_interval"] = "1s"
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def _alertmanager_config(workdir: Path, webhook_url: str) -> Path:
    path = workdir / "alertmanager.yml"
    path.write_text(
        yaml.safe_dump(
            {
                "route": {
                    "receiver": "test",
                    "group_by": ["alertname", "node", "gpu"],
                    "group_wait": "1s",
                    "group_interval": "1s",
                    "repeat_interval": "1h",
                },
                "receivers": [{"name": "test", "webhook_configs": [{"url": webhook_url}]}],
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def webhook() -> Iterator[Receiver]:
    with Receiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def stack(webhook: Receiver) -> Iterator[Stack]:
    prometheus = require_binary("prometheus")
    alertmanager = require_binary("prometheus-alertmanager", package=AM_PACKAGE)
    workdir = short_tmpdir()
    procs: list[subprocess.Popen[bytes]] = []
    agent: AgentProcess | None = None
    ok = False
    try:
        (workdir / "agent").mkdir()
        agent = AgentProcess(
            workdir / "agent", "--node-name", NODE, "--gpus", "4", "--ib-ports", "1",
            "--kmsg-path", "",
        )  # fmt: skip
        am_proc, am_url = start_alertmanager(
            alertmanager, workdir, _alertmanager_config(workdir, f"{webhook.url}/alerts")
        )
        procs.append(am_proc)
        _rules_without_for(workdir)
        config = _prometheus_config(
            workdir,
            agent=f"127.0.0.1:{agent.port}",
            alertmanager=am_url.removeprefix("http://"),
        )
        prom_proc, prom_url = start_prometheus(prometheus, workdir, config)
        procs.append(prom_proc)
        ok = True
        yield Stack(agent, prom_url, am_url, webhook, procs)
    finally:
        if agent is not None and agent.terminate() != 0 and not ok:
            print(agent.log())
        for proc in procs:
            stop(proc)
        if not ok:
            for name in ("prometheus.log", "alertmanager.log"):
                path = workdir / name
                if path.exists():
                    print(f"--- {name}\n{path.read_text()[-4000:]}")
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.slow
def test_first_xid_and_first_dbe_reach_the_receiver_through_alertmanager(stack: Stack) -> None:
    def discovered() -> bool:
        up = stack.series('up{job="trainguard-agent"} == 1')
        ams = httpx.get(f"{stack.prometheus_url}/api/v1/alertmanagers", timeout=5).json()
        return bool(up) and bool(ams["data"]["activeAlertmanagers"])

    wait_for(discovered, timeout_s=30, what="prometheus to scrape the agent and find alertmanager")
    ecc = (
        f'trainguard_gpu_ecc_errors_total{{node="{NODE}",gpu="2",'
        'type="uncorrected",scope="volatile"}'
    )
    wait_for(lambda: stack.series(f"{ecc} == 0"), timeout_s=20, what="a scrape of GPU 2's ECC at 0")
    xid = f'trainguard_gpu_xid_errors_total{{node="{NODE}",gpu="0",xid="79"}}'
    assert stack.series(f"count_over_time({xid}[5m])") == [], "the XID series exists already"

    for fault in (("xid", "--gpu", "0", "--code", "79"), ("dbe", "--gpu", "2")):
        done = stack.agent.inject(*fault)
        assert done.returncode == 0, done.stderr

    fatal = wait_for(
        lambda: _firing(stack.receiver, "gpu_fatal_xid", node=NODE, gpu="0"),
        timeout_s=30,
        what="gpu_fatal_xid for GPU 0 at the webhook",
    )
    ecc_alert = wait_for(
        lambda: _firing(stack.receiver, "gpu_uncorrectable_ecc", node=NODE, gpu="2"),
        timeout_s=30,
        what="gpu_uncorrectable_ecc for GPU 2 at the webhook",
    )
    for alert in (fatal, ecc_alert):
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["scope"] == "gpu"
        assert alert["annotations"]["summary"]
    # exactly the labels the controller's alertmanager channel gives its incident on that GPU
    # (less its source label), so Alertmanager groups the two (test_alertmanager_paging.py)
    rules = load_rules([shipped_dir() / "default.yaml"])
    for alert, gpu in ((fatal, 0), (ecc_alert, 2)):
        rule = rules.get(alert["labels"]["alertname"])
        assert rule is not None
        ours = alert_labels(
            rule=rule.name,
            severity=rule.severity,
            target=Target("gpu", node=NODE, gpu=gpu),
            rule_labels=rule.labels,
        )
        assert alert["labels"] == ours
    # The XID series was born at 1 and never moved, so increase() alone reads 0 on it: the
    # alert above fired through the export's born-in-the-window branch.
    wait_for(
        lambda: stack.series(f"count_over_time({xid}[5m]) >= 2"),
        timeout_s=10,
        what="two samples of the XID series",
    )
    assert [float(r["value"][1]) for r in stack.series(f"min_over_time({xid}[5m])")] == [1.0]
    assert [float(r["value"][1]) for r in stack.series(f"increase({xid}[5m])")] == [0.0]
    # No GPU alert for the GPUs that had no fault
    fired = {(a["labels"]["alertname"], a["labels"].get("gpu")) for a in _alerts(stack.receiver)}
    assert {gpu for _, gpu in fired if gpu is not None} <= {"0", "2"}, fired


# --- the example Alertmanager configuration (amtool, no processes) ---------------------------


def _amtool() -> str:
    return require_binary("amtool", package=AM_PACKAGE)


def _amtool_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_amtool(), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_example_alertmanager_config_passes_amtool_check_config() -> None:
    proc = _amtool_run("check-config", str(DASHBOARDS / "alertmanager.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 receivers" in proc.stdout, proc.stdout


def test_amtool_check_config_rejects_a_misspelt_secret_file_key(tmp_path: Path) -> None:
    """The check above can fail: Alertmanager refuses unknown keys."""
    bad = tmp_path / "alertmanager.yml"
    text = (DASHBOARDS / "alertmanager.yml").read_text()
    bad.write_text(text.replace("routing_key_file:", "routing_key_fil:"))
    proc = _amtool_run("check-config", str(bad))
    assert proc.returncode != 0
    assert "routing_key_fil" in proc.stdout + proc.stderr


def test_example_alertmanager_config_reads_secrets_from_files() -> None:
    config = yaml.safe_load((DASHBOARDS / "alertmanager.yml").read_text())
    receivers = {r["name"]: r for r in config["receivers"]}
    (pagerduty,) = receivers["pagerduty"]["pagerduty_configs"]
    (slack,) = receivers["slack"]["slack_configs"]
    assert pagerduty["routing_key_file"].startswith("/")
    assert slack["api_url_file"].startswith("/")
    for secret in ("routing_key", "service_key", "api_url", "url"):
        assert secret not in pagerduty and secret not in slack, secret


@pytest.mark.parametrize(
    ("severity", "receivers"),
    [("critical", "pagerduty,slack"), ("warning", "slack"), ("info", "slack")],
    ids=["critical-pages-and-posts", "warning-posts", "anything-else-posts"],
)
def test_example_alertmanager_routes_critical_to_pagerduty_and_all_to_slack(
    severity: str, receivers: str
) -> None:
    proc = _amtool_run(
        "config", "routes", "test", f"--config.file={DASHBOARDS / 'alertmanager.yml'}",
        f"--verify.receivers={receivers}", "alertname=gpu_fatal_xid", f"node={NODE}",
        f"severity={severity}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == receivers


def _templates(obj: Any) -> Iterator[str]:
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _templates(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _templates(v)
    elif isinstance(obj, str) and "{{" in obj:
        yield obj


def test_example_alertmanager_templates_render_for_an_exported_alert(tmp_path: Path) -> None:
    """Alertmanager parses templates only when it notifies; render each one now."""
    labels = {"alertname": "gpu_fatal_xid", "node": NODE, "gpu": "0", "severity": "critical"}
    annotations = {"summary": "fatal XID", "description": "The driver reported an XID."}
    data = {
        "receiver": "pagerduty",
        "status": "firing",
        "alerts": [
            {
                "status": "firing",
                "labels": labels,
                "annotations": annotations,
                "startsAt": "2024-01-01T00:00:00Z",
                "endsAt": "0001-01-01T00:00:00Z",
            }
        ],
        "groupLabels": {"alertname": "gpu_fatal_xid", "node": NODE},
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": "http://alertmanager.example:9093",
    }
    (tmp_path / "data.json").write_text(json.dumps(data))
    (tmp_path / "none.tmpl").write_text("")
    config = yaml.safe_load((DASHBOARDS / "alertmanager.yml").read_text())
    templates = list(_templates(config["receivers"]))
    assert len(templates) >= 5, templates
    for text in templates:
        proc = _amtool_run(
            "template", "render", f"--template.glob={tmp_path / 'none.tmpl'}",
            f"--template.data={tmp_path / 'data.json'}", f"--template.text={text}",
        )  # fmt: skip
        assert proc.returncode == 0, f"{text!r}: {proc.stderr}"
        assert "<no value>" not in proc.stdout, (text, proc.stdout)
