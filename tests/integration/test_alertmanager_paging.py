"""Both paging paths on, one page: a DBE seen by Prometheus (its exported alert) and by the
controller (an incident on its `alertmanager` channel) reaches a real Alertmanager, configured
as dashboards/alertmanager.yml ships it, which pages a fake PagerDuty (Events API v2, real
HTTP) once, with one dedup key; resolving both sends one resolve.

The controller is the real process. Prometheus' side is the alert Prometheus posts to
Alertmanager for the exported rule (labels and annotations from dashboards/alerts.yml, endsAt
four minutes ahead, then endsAt = now when it resolves); test_alertmanager_delivery.py shows
a real Prometheus puts exactly those labels on it.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.fakes.http_receiver import Receiver
from tests.helpers import short_tmpdir, wait_for
from tests.integration.controller_proc import ControllerProcess, post_gpu_report, write_config
from tests.integration.prometheus_proc import require_binary, start_alertmanager, stop

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
RULE = "gpu_uncorrectable_ecc"
NODE = "node-9"


def _shipped_rule() -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "rules" / "default.yaml").read_text())
    (rule,) = [r for r in doc["rules"] if r["name"] == RULE]
    return dict(rule)


def _exported_rule() -> dict[str, Any]:
    doc = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())
    (rule,) = [r for g in doc["groups"] for r in g["rules"] if r["alert"] == RULE]
    return dict(rule)


def _rfc3339(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


@dataclass
class PagerDuty:
    """Events API v2 as PagerDuty applies it: a trigger opens an incident (a page) unless one
    with its dedup_key is open; a resolve closes it."""

    receiver: Receiver

    def events(self) -> list[dict[str, Any]]:
        return [r.json() for r in list(self.receiver.requests) if r.path == "/v2/enqueue"]

    def pages(self) -> list[str]:
        open_keys: set[str] = set()
        pages = []
        for event in self.events():
            key = event["dedup_key"]
            if event["event_action"] == "trigger" and key not in open_keys:
                open_keys.add(key)
                pages.append(key)
            elif event["event_action"] == "resolve":
                open_keys.discard(key)
        return pages

    def firing(self, count: int, *, since: int = 0) -> bool:
        """A trigger counting `count` firing alerts (the shipped template's `firing` detail)
        came, as event `since` or later."""
        return any(
            e["event_action"] == "trigger"
            and e["payload"]["custom_details"].get("firing") == str(count)
            for e in self.events()[since:]
        )

    def resolves(self) -> list[str]:
        return [e["dedup_key"] for e in self.events() if e["event_action"] == "resolve"]


@dataclass
class Stack:
    alertmanager_url: str
    controller_url: str
    pagerduty: PagerDuty

    def alerts(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.alertmanager_url}/api/v2/alerts", timeout=10)
        r.raise_for_status()
        alerts: list[dict[str, Any]] = r.json()
        return alerts

    def prometheus_posts(self, *, resolved: bool) -> None:
        """The exported alert as Prometheus sends it to Alertmanager."""
        rule = _exported_rule()
        now = time.time()
        alert = {
            "labels": {"alertname": RULE, **rule["labels"], "node": NODE, "gpu": "0"},
            "annotations": rule["annotations"],
            "startsAt": _rfc3339(now - 5),
            "endsAt": _rfc3339(now if resolved else now + 240),
            "generatorURL": "http://prometheus:9090/graph",
        }
        r = httpx.post(f"{self.alertmanager_url}/api/v2/alerts", json=[alert], timeout=10)
        assert r.status_code == 200, r.text


def _alertmanager_config(workdir: Path, receiver_url: str) -> Path:
    """dashboards/alertmanager.yml as shipped, its secret files here, its receivers pointed at
    the fake, and 1 s group timers."""
    config = yaml.safe_load((DASHBOARDS / "alertmanager.yml").read_text())
    config["route"].update(group_wait="1s", group_interval="1s")
    receivers = {r["name"]: r for r in config["receivers"]}
    (pagerduty,) = receivers["pagerduty"]["pagerduty_configs"]
    (workdir / "routing-key").write_text("PDROUTINGKEY\n")
    pagerduty.update(
        routing_key_file=str(workdir / "routing-key"), url=f"{receiver_url}/v2/enqueue"
    )
    (slack,) = receivers["slack"]["slack_configs"]
    (workdir / "slack-url").write_text(f"{receiver_url}/slack\n")
    slack["api_url_file"] = str(workdir / "slack-url")
    path = workdir / "alertmanager.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    alertmanager = require_binary("prometheus-alertmanager", package="prometheus-alertmanager")
    workdir = short_tmpdir()
    am: subprocess.Popen[bytes] | None = None
    controller: ControllerProcess | None = None
    ok = False
    try:
        with Receiver(default_status=202) as receiver:
            am, am_url = start_alertmanager(
                alertmanager, workdir, _alertmanager_config(workdir, receiver.url)
            )
            rule = {**_shipped_rule(), "condition": "ecc_uncorrected_volatile_total > 0"}
            rule["actions"] = ["notify"]
            (workdir / "ctl").mkdir()
            cfg = write_config(
                workdir / "ctl",
                rules=yaml.safe_dump({"rules": [rule]}),
                tick_interval_s=0.2,
                extra_yaml=f"notify:\n  alertmanager: {{url: '{am_url}'}}\n",
            )
            controller = ControllerProcess(cfg, log_path=workdir / "controller.log")
            controller.wait_listening()
            ok = True
            yield Stack(am_url, controller.url, PagerDuty(receiver))
    finally:
        if controller is not None:
            controller.terminate(timeout_s=30)
        if am is not None:
            stop(am)
        if not ok:
            for name in ("alertmanager.log", "controller.log"):
                path = workdir / name
                if path.exists():
                    print(f"--- {name}\n{path.read_text()[-4000:]}")
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.slow
def test_a_dbe_on_both_paths_pages_once_with_one_key_and_resolves_once(stack: Stack) -> None:
    stack.prometheus_posts(resolved=False)
    post_gpu_report(stack.controller_url, node=NODE, dbe=1, seq=1)

    def controller_alert() -> dict[str, Any] | None:
        return next((a for a in stack.alerts() if a["labels"].get("source") == "controller"), None)

    ours = wait_for(controller_alert, timeout_s=30, what="the controller's alert in Alertmanager")
    (theirs,) = [a for a in stack.alerts() if "source" not in a["labels"]]
    assert ours["labels"] == {**theirs["labels"], "source": "controller"}
    assert ours["annotations"]["summary"] == theirs["annotations"]["summary"]
    # one group: the alerts share their group-by labels, so one notification names both
    wait_for(lambda: stack.pagerduty.firing(2), timeout_s=20, what="a page with both alerts")
    (key,) = stack.pagerduty.pages()
    assert {e["dedup_key"] for e in stack.pagerduty.events()} == {key}

    # the controller's incident resolves first: Alertmanager tells PagerDuty the group still
    # fires (Prometheus' alert), on the same key, and sends no resolve
    told = len(stack.pagerduty.events())
    post_gpu_report(stack.controller_url, node=NODE, dbe=0, seq=2)
    wait_for(lambda: stack.pagerduty.firing(1, since=told), timeout_s=30, what="one alert left")
    assert stack.pagerduty.resolves() == []
    stack.prometheus_posts(resolved=True)
    wait_for(stack.pagerduty.resolves, timeout_s=20, what="the resolve")
    assert stack.pagerduty.resolves() == [key]
    assert stack.pagerduty.pages() == [key]
    assert {e["dedup_key"] for e in stack.pagerduty.events()} == {key}
    slack = [r for r in list(stack.pagerduty.receiver.requests) if r.path == "/slack"]
    assert slack, "the shipped route posts every alert to Slack too"
