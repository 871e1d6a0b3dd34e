"""What the real trainguard-controller rebuilds after `kill -9`: an XID 48 acknowledged but
never evaluated opens exactly one critical incident after the restart, and an open incident
whose windowed condition lost its history stays open while its node keeps reporting the
same counters (a fake agent posts the reports over HTTP)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.controller_proc import (
    AGENT,
    OP,
    ControllerProcess,
    start_controller,
    write_config,
)
from trainguard.model import GpuSample
from trainguard.protocol import Event, Report, ReportResponse, decode_json, encode_json

RULES = """
rules:
  - name: gpu_fatal_xid
    scope: gpu
    condition: increase(xid_fatal_total[5m]) > 0
    severity: critical
    actions: [notify]
    cooldown: 15m
    summary: fatal XID
  - name: gpu_uncorrectable_ecc
    scope: gpu
    condition: increase(ecc_uncorrected_volatile_total[10m]) > 0
    severity: critical
    actions: [notify]
    cooldown: 15m
    summary: uncorrectable ECC error
"""


class FakeAgent:
    """Posts the reports of node-1 (one GPU) the way an agent does."""

    def __init__(self, node: str = "node-1") -> None:
        self.node = node
        self.seq = 0

    def post(self, url: str, *, dbe: int = 0, events: tuple[Event, ...] = ()) -> ReportResponse:
        self.seq += 1
        gpu = GpuSample(
            index=0,
            uuid="GPU-0",
            pci_bus_id="0000:18:00.0",
            name="H100",
            ecc_uncorrected_volatile_total=dbe,
        )
        report = Report(
            node=self.node,
            instance="i1",
            seq=self.seq,
            sent_at=time.time(),
            gpus=(gpu,),
            events=events,
        )
        r = httpx.post(f"{url}/v1/reports", content=encode_json(report), headers=AGENT, timeout=10)
        assert r.status_code == 200, r.text
        return decode_json(ReportResponse, r.content)


def ticks(url: str) -> int:
    """How many ticks the controller has finished (its tick duration histogram's count)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r"^trainguard_controller_tick_seconds_count (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0


def incidents(url: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/v1/incidents", headers=OP, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def report_through_ticks(proc: ControllerProcess, agent: FakeAgent, *, n: int, **kw: Any) -> None:
    """Keep reporting until `n` ticks have finished after the first of these reports."""
    agent.post(proc.url, **kw)
    start = ticks(proc.url)

    def done() -> bool:
        agent.post(proc.url, **kw)
        return ticks(proc.url) >= start + n

    wait_for(done, timeout_s=30, what=f"{n} ticks while the node reports", interval_s=0.1)


@pytest.mark.slow
def test_xid_acknowledged_just_before_kill9_opens_exactly_one_incident_after_restart(
    tmp_path: Path, controllers: list[ControllerProcess]
) -> None:
    # one tick at start, then none for an hour: nothing evaluates the event before the kill
    cfg = write_config(tmp_path, rules=RULES, tick_interval_s=3600, stale_after_s=7200)
    first = start_controller(cfg, log_path=tmp_path / "first.log")
    controllers.append(first)
    wait_for(lambda: ticks(first.url) >= 1, timeout_s=30, what="the first tick")
    agent = FakeAgent()
    agent.post(first.url)
    dbe = Event(id=1, kind="xid", ts=time.time(), gpu=0, code=48, message="Xid 48: DBE")
    assert agent.post(first.url, dbe=1, events=(dbe,)).ack_event_id == 1
    assert ticks(first.url) == 1 and incidents(first.url) == []
    first.kill()

    cfg = write_config(tmp_path, rules=RULES, tick_interval_s=0.2, stale_after_s=30)
    second = start_controller(cfg, log_path=tmp_path / "second.log")
    controllers.append(second)
    assert "event=events_replayed count=1" in second.log()
    report_through_ticks(second, agent, n=10, dbe=1)  # the same counters, no new event
    (incident,) = incidents(second.url)
    assert incident["rule"] == "gpu_fatal_xid" and incident["severity"] == "critical"
    assert incident["state"] != "resolved"


@pytest.mark.slow
def test_incident_open_at_kill9_stays_open_while_its_node_reports_the_same_counters(
    tmp_path: Path, controllers: list[ControllerProcess]
) -> None:
    cfg = write_config(tmp_path, rules=RULES, tick_interval_s=0.2, stale_after_s=30)
    first = start_controller(cfg, log_path=tmp_path / "first.log")
    controllers.append(first)
    agent = FakeAgent()
    report_through_ticks(first, agent, n=2, dbe=0)
    agent.post(first.url, dbe=1)
    (opened,) = wait_for(
        lambda: incidents(first.url) or None, timeout_s=30, what="the ECC incident to open"
    )
    assert opened["rule"] == "gpu_uncorrectable_ecc"
    first.kill()

    second = start_controller(cfg, log_path=tmp_path / "second.log")
    controllers.append(second)
    # in the first report after the restart the counter is 1 with no history behind it
    report_through_ticks(second, agent, n=15, dbe=1)
    (incident,) = incidents(second.url)
    assert incident["id"] == opened["id"] and incident["state"] != "resolved"
