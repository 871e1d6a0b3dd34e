"""Costs a caller can put on a real controller (issue 20): rules valid but costly, unfinished
bodies, idle and slow connections.

- A rule file over the cost budget is refused at start (exit 2) and on reload (SIGHUP and
  the API: 400, the running rules stay), naming the rule and its cost against the budget.
- A rule whose evaluation overruns its budget tick after tick is disabled and opens one
  incident on the controller; the process keeps serving (no restart loop).
- Many unfinished bodies from one token hit the per-credential cap (429 naming the limit)
  without the process's memory following; connections that send nothing, or their headers
  too slowly, are closed; past the connection cap the never-answered ones go first; a
  regular agent keeps reporting throughout.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import short_tmpdir, wait_for
from tests.integration.agent_proc import cleanup, sample_value
from tests.integration.controller_proc import (
    OP,
    ControllerProcess,
    dbe_rules,
    post_gpu_report,
    start_controller,
    write_config,
)

COSTLY = """
rules:
  - name: temp_scan
    scope: gpu
    condition: max_over_time(temperature_celsius[15m]) < 0
    severity: info
    summary: never true
"""
REFUSAL = "rule temp_scan: cost 2,981,888 history points per tick"


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


# --- rules ----------------------------------------------------------------------------------


def test_a_costly_rule_file_is_refused_at_start_with_exit_2(tmp_path: Path) -> None:
    config = write_config(tmp_path, rules=COSTLY)
    proc = ControllerProcess(config, log_path=tmp_path / "controller.log")
    try:
        assert proc.popen.wait(timeout=60) == 2, proc.log()
    finally:
        proc.kill()
    assert REFUSAL in proc.log()
    assert "rule_budget.max_cost_per_rule 1,500,000" in proc.log()


def test_a_costly_rule_file_on_reload_is_refused_and_the_running_rules_stay(
    tmp_path: Path, controllers: list[ControllerProcess]
) -> None:
    config = write_config(tmp_path, rules=dbe_rules(), tick_interval_s=0.2)
    proc = start_controller(config, log_path=tmp_path / "controller.log")
    controllers.append(proc)
    (tmp_path / "rules.yaml").write_text(COSTLY)
    proc.popen.send_signal(signal.SIGHUP)
    wait_for(lambda: "sighup_reload_failed" in proc.log(), timeout_s=30, what="SIGHUP refusal")
    assert REFUSAL in proc.log()
    r = httpx.post(f"{proc.url}/v1/rules/reload", headers=OP, timeout=30)
    assert r.status_code == 400, r.text
    assert "the running rules stay" in r.text and REFUSAL in r.text
    # the running rule still acts
    post_gpu_report(proc.url, node="n1", dbe=1, seq=1)
    wait_for(
        lambda: any(
            i["rule"] == "gpu_dbe"
            for i in httpx.get(f"{proc.url}/v1/incidents", headers=OP, timeout=30).json()
        ),
        timeout_s=30,
        what="gpu_dbe incident from the running rules",
    )
    assert proc.popen.poll() is None


def test_an_overrunning_rule_is_disabled_opens_an_incident_and_the_process_serves_on(
    tmp_path: Path, controllers: list[ControllerProcess]
) -> None:
    # a budget no evaluation meets: the rule is cut whenever it has a target
    budget = "rule_budget: {eval_budget_s: 1.0e-9, overrun_ticks: 2, tick_budget_s: 1.0}\n"
    config = write_config(tmp_path, rules=dbe_rules(), tick_interval_s=0.2, extra_yaml=budget)
    proc = start_controller(config, log_path=tmp_path / "controller.log")
    controllers.append(proc)
    post_gpu_report(proc.url, node="n1", dbe=0, seq=1)

    def disabled() -> list[dict[str, object]]:
        incidents = httpx.get(f"{proc.url}/v1/incidents", headers=OP, timeout=30).json()
        return [i for i in incidents if i["target"] == "controller"]

    wait_for(lambda: disabled() != [], timeout_s=30, what="the rule-disabled incident")
    (incident,) = disabled()
    assert incident["rule"] == "gpu_dbe" and incident["severity"] == "critical"
    assert "rule gpu_dbe disabled" in str(incident["summary"])
    assert "event=rule_disabled rule=gpu_dbe" in proc.log()
    body = httpx.get(f"{proc.url}/metrics", timeout=30).text
    assert sample_value(body, "trainguard_controller_rule_disabled", rule="gpu_dbe") == 1.0
    time.sleep(1.0)  # more ticks: still one incident, the tick loop alive
    assert len(disabled()) == 1
    assert httpx.get(f"{proc.url}/healthz", timeout=30).status_code == 200
    assert proc.popen.poll() is None


# --- connections and bodies -----------------------------------------------------------------

AGENTS = {"n1": "agent-n1-token", "n2": "agent-n2-token"}
MAX_BODY = 1024 * 1024
CONNECTIONS = {
    "max_open": 40,
    "header_timeout_s": 2,
    "body_timeout_s": 20,
    "idle_timeout_s": 5,
    "per_credential_requests": 4,
    "per_credential_body_bytes": 2 * MAX_BODY,
    "total_body_bytes": 16 * MAX_BODY,
}


@dataclass
class Rig:
    proc: ControllerProcess
    host: str
    port: int

    def connect(self) -> socket.socket:
        s = socket.create_connection((self.host, self.port), timeout=30)
        return s


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    workdir = short_tmpdir("tgcost")
    config = write_config(
        workdir,
        rules=dbe_rules(),
        tick_interval_s=0.5,
        agent_tokens=AGENTS,
        max_body_bytes=MAX_BODY,
    )
    data = yaml.safe_load(config.read_text())
    data["api"]["connections"] = CONNECTIONS
    config.write_text(yaml.safe_dump(data))
    proc = start_controller(config, log_path=workdir / "controller.log")
    host, port = proc.url.split("//")[1].split(":")
    try:
        yield Rig(proc=proc, host=host, port=int(port))
    finally:
        proc.kill()
        cleanup(workdir)


class Agent:
    """A regular agent: one keep-alive connection, a report every call."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {AGENTS['n2']}"}, timeout=30
        )
        self.seq = 0

    def report(self) -> int:
        self.seq += 1
        body = f'{{"node": "n2", "instance": "i1", "seq": {self.seq}, "sent_at": {time.time()}}}'
        return self.client.post("/v1/reports", content=body).status_code


def _unfinished(rig: Rig, token: str, *, length: int, sent: int) -> socket.socket:
    s = rig.connect()
    s.sendall(
        f"POST /v1/reports HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()
        + b" " * sent
    )
    return s


def _answer(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    s.settimeout(timeout_s)
    try:
        return s.recv(65536)
    except TimeoutError:
        return b"(no answer)"
    except ConnectionResetError:
        return b""


def test_unfinished_bodies_from_one_token_hit_the_cap_and_memory_stays_bounded(
    rig: Rig,
) -> None:
    agent = Agent(rig.proc.url)
    assert agent.report() == 200
    before = _rss_bytes(rig.proc.popen.pid)
    socks = [_unfinished(rig, AGENTS["n1"], length=MAX_BODY, sent=256 * 1024) for _ in range(30)]
    try:
        # two bodies of 1 MiB are in flight for n1's token; every other is answered at once
        answers = [_answer(s, timeout_s=3.0) for s in socks]
        refused = [a for a in answers if a.startswith(b"HTTP/1.1 429")]
        assert len(refused) >= 26, answers
        assert b"api.connections.per_credential_body_bytes" in refused[0]
        assert agent.report() == 200  # another credential reports on
        during = _rss_bytes(rig.proc.popen.pid)
        assert during - before < 64 * 1024 * 1024, (before, during)
    finally:
        for s in socks:
            s.close()
    assert agent.report() == 200
    assert rig.proc.popen.poll() is None


def test_a_connection_that_sends_nothing_is_closed_after_the_header_deadline(rig: Rig) -> None:
    agent = Agent(rig.proc.url)
    s = rig.connect()
    started = time.monotonic()
    got = _answer(s, timeout_s=20.0)
    assert got.startswith(b"HTTP/1.1 408") or got == b"", got
    assert 1.5 <= time.monotonic() - started < 15.0
    assert agent.report() == 200


def test_headers_sent_too_slowly_are_cut(rig: Rig) -> None:
    s = rig.connect()
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    started = time.monotonic()
    closed = False
    for byte in request:
        try:
            s.sendall(bytes([byte]))
        except OSError:
            closed = True
            break
        time.sleep(0.1)
        if time.monotonic() - started > 10:
            break
    if not closed:
        got = _answer(s, timeout_s=10.0)
        assert got.startswith(b"HTTP/1.1 408") or got == b"", got
    assert time.monotonic() - started < 15.0
    assert "reason=headers_timeout" in rig.proc.log()


def test_past_the_connection_cap_idle_strangers_go_first_and_agents_report_on(
    rig: Rig,
) -> None:
    agent = Agent(rig.proc.url)
    assert agent.report() == 200
    socks = []
    try:
        for _ in range(60):  # more than max_open (40), none sends a byte
            socks.append(rig.connect())
        for _ in range(5):
            assert agent.report() == 200  # its established connection is kept
        fresh = httpx.get(f"{rig.proc.url}/healthz", timeout=30)
        assert fresh.status_code == 200
        closed = sum(1 for s in socks[:20] if _answer(s, timeout_s=0.5) == b"")
        assert closed >= 15  # the oldest strangers were closed to make room
    finally:
        for s in socks:
            s.close()
    assert "reason=connections_full" in rig.proc.log()


def test_ingest_workers_hold_the_same_bounds(
    tmp_path: Path, controllers: list[ControllerProcess]
) -> None:
    config = write_config(tmp_path, rules=dbe_rules(), agent_tokens=AGENTS, max_body_bytes=MAX_BODY)
    data = yaml.safe_load(config.read_text())
    data["api"]["connections"] = CONNECTIONS
    data["api"]["ingest_workers"] = 1
    config.write_text(yaml.safe_dump(data))
    proc = start_controller(config, log_path=tmp_path / "controller.log")
    controllers.append(proc)
    host, port = proc.url.split("//")[1].split(":")
    rig = Rig(proc=proc, host=host, port=int(port))
    agent = Agent(proc.url)
    assert agent.report() == 200
    socks = [_unfinished(rig, AGENTS["n1"], length=MAX_BODY, sent=1024) for _ in range(6)]
    try:
        answers = [_answer(s, timeout_s=3.0) for s in socks]
        assert sum(a.startswith(b"HTTP/1.1 429") for a in answers) >= 4, answers
        assert agent.report() == 200
    finally:
        for s in socks:
            s.close()
    idle = rig.connect()
    got = _answer(idle, timeout_s=20.0)
    assert got.startswith(b"HTTP/1.1 408") or got == b"", got
    assert agent.report() == 200
