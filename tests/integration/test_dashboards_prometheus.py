"""The dashboards against a real Prometheus scraping a real controller and real agents.

One stack per module: the controller process (default rules), an active sim agent (node-1)
with a trainer job of three ranks sending real heartbeat datagrams (checkpoint commits
included) and a DBE plus a pending row remap injected, and a spare agent (node-2, pool
h100). Prometheus runs from dashboards/prometheus.yml (targets swapped in, 1 s intervals)
with the checked-in dashboards/alerts.yml. Every panel query of every dashboard must
evaluate without error and return at least one series.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helpers import short_tmpdir, wait_for
from tests.integration.agent_proc import AgentProcess, cleanup
from tests.integration.prometheus_proc import require_binary, start_prometheus
from trainguard.controller.auth import hash_token
from trainguard.protocol import Heartbeat, encode_json

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "dashboards"
BIN = Path(sys.executable).parent
JOB = "demo"
RANKS = 3
AGENT_TOKENS = {"node-1": "dash-agent-token-1", "node-2": "dash-agent-token-2"}
VIEWER_TOKEN = "dash-viewer-token"
OP_TOKEN = "dash-op-token"
# Grafana's built-in interval variables, as Grafana would expand them for a short range
GRAFANA_INTERVALS = {"__rate_interval": "1m", "__interval": "2s", "__range": "5m"}
# Series that exist only once the controller computes them for a job (see _allowed_empty)
ETTR_METRIC = "trainguard_controller_job_ettr_ratio"
# After the faults: what Prometheus must hold before the dashboards are queried
READY_WHEN = (
    (
        "the exported DBE alert to fire",
        'ALERTS{alertname="gpu_uncorrectable_ecc",alertstate="firing"}',
    ),
    # One fault, one incident: a DBE is also an XID 48, and whichever of the two the agent's
    # sources report first opens the incident the other then joins.
    (
        "the controller's DBE incident",
        'trainguard_controller_incidents_open{rule=~"gpu_uncorrectable_ecc|gpu_fatal_xid"} > 0',
    ),
    # born at 1 when first counted: increase() needs a second sample
    (
        "two samples of action results",
        "count_over_time(trainguard_controller_actions_total[1m]) >= 2",
    ),
    ("the straggler alert (pending)", f'ALERTS{{alertname="straggler",job="{JOB}"}}'),
    ("checkpoint commit times", "trainguard_trainer_checkpoint_timestamp_seconds"),
    (
        "the controller's view of the job",
        f'trainguard_controller_job_checkpoint_step{{job="{JOB}"}}',
    ),
    ("a few controller scrapes", "count_over_time(trainguard_controller_nodes_reporting[1m]) >= 3"),
)


# --- the trainer: three ranks posting heartbeats to the agent's socket ----------------------


class TrainerSender:
    """Three ranks of one job in step (a synchronous job: equal step times); rank 2 computes
    50% longer (a straggler) and the others wait for it at the all-reduce; every
    5th step commits a checkpoint (event + level ckpt_step), like agent/trainer does."""

    def __init__(self, socket_path: Path) -> None:
        self.path = str(socket_path)
        self.stop = threading.Event()
        self.sent = 0
        self.thread = threading.Thread(target=self._run, name="trainer", daemon=True)

    def _run(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        step, ckpt = 0, None
        try:
            while not self.stop.is_set():
                step += 1
                committed = step % 5 == 1
                if committed:
                    ckpt = step
                for rank in range(RANKS):
                    hb = Heartbeat(
                        job=JOB,
                        rank=rank,
                        step=step,
                        t=time.time(),
                        local_rank=rank,
                        world_size=RANKS,
                        pid=os.getpid(),
                        loss=2.5 / (1 + 0.01 * step) + 0.01 * rank,
                        grad_norm=1.0 + 0.1 * rank,
                        samples_per_s=320.0 if rank < 2 else 213.0,
                        tokens_per_s=655_360.0 if rank < 2 else 436_000.0,
                        step_time_s=0.15,
                        compute_time_s=0.08 if rank < 2 else 0.12,
                        ckpt_step=ckpt,
                        event="checkpoint_committed" if committed else None,
                        event_data={"step": step, "duration_s": 0.4 + 0.1 * rank}
                        if committed
                        else {},
                    )
                    try:
                        sock.sendto(encode_json(hb), self.path)
                        self.sent += 1
                    except OSError:
                        pass  # the agent is not bound yet, or is stopping: like a real rank
                self.stop.wait(0.2)
        finally:
            sock.close()


# --- processes ------------------------------------------------------------------------------


@dataclass
class Stack:
    workdir: Path
    controller_url: str
    prometheus_url: str
    agents: dict[str, AgentProcess]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def query(self, expr: str) -> dict[str, Any]:
        r = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": expr}, timeout=10)
        body: dict[str, Any] = r.json()
        return body

    def series(self, expr: str) -> list[dict[str, Any]]:
        body = self.query(expr)
        if body.get("status") != "success":
            return []
        result: list[dict[str, Any]] = body["data"]["result"]
        return result


def _start_controller(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    (workdir / "tokens.yaml").write_text(
        "tokens:\n"
        + "".join(
            f'  - {{name: agent-{n}, role: agent, node: {n}, sha256: "{hash_token(t)}"}}\n'
            for n, t in AGENT_TOKENS.items()
        )
        + f'  - {{name: grafana, role: viewer, sha256: "{hash_token(VIEWER_TOKEN)}"}}\n'
        + f'  - {{name: ops, role: operator, sha256: "{hash_token(OP_TOKEN)}"}}\n'
    )
    cfg = workdir / "controller.yaml"
    cfg.write_text(
        f"store: {{path: {workdir / 'controller.db'}}}\n"
        f"api: {{host: 127.0.0.1, port: 0, tokens_file: {workdir / 'tokens.yaml'}}}\n"
        # a price, so the cost-of-failures panel's money has a series
        "cost: {gpu_hour: 2.5}\n"
    )
    log = workdir / "controller.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(BIN / "trainguard-controller"), "--config", str(cfg)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def url() -> str | None:
        if proc.poll() is not None:
            pytest.fail(f"controller exited with {proc.returncode}:\n{log.read_text()}")
        m = re.search(r"event=api_listening url=(\S+)", log.read_text())
        return m.group(1) if m else None

    return proc, str(wait_for(url, timeout_s=30, what="the controller to listen"))


def _prometheus_config(workdir: Path, targets: dict[str, list[str]]) -> Path:
    """dashboards/prometheus.yml as shipped, with 1 s intervals and these targets."""
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    shutil.copy(DASHBOARDS / "alerts.yml", workdir / "alerts.yml")
    (workdir / "targets").mkdir()
    (workdir / "targets" / "agents-test.yml").write_text(
        yaml.safe_dump([{"targets": targets["agents"]}])
    )
    (workdir / "targets" / "controller.yml").write_text(
        yaml.safe_dump([{"targets": targets["controller"]}])
    )
    for scrape in config["scrape_configs"]:
        for sd in scrape["file_sd_configs"]:
            sd["refresh_interval"] = "1s"
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    prometheus = require_binary("prometheus")
    workdir = short_tmpdir()
    procs: list[subprocess.Popen[bytes]] = []
    agents: dict[str, AgentProcess] = {}
    sender: TrainerSender | None = None
    ok = False
    try:
        controller, controller_url = _start_controller(workdir)
        procs.append(controller)
        for node, token in AGENT_TOKENS.items():
            (workdir / f"{node}.token").write_text(token + "\n")
        common = ["--controller", controller_url, "--report-interval-s", "1", "--kmsg-path", ""]
        (workdir / "n1").mkdir()
        agents["node-1"] = AgentProcess(
            workdir / "n1", "--gpus", "2", "--ib-ports", "2",
            "--token-file", str(workdir / "node-1.token"), *common,
        )  # fmt: skip
        (workdir / "n2").mkdir()
        spare_cfg = workdir / "n2" / "agent.yaml"
        spare_cfg.write_text("node: {labels: {pool: h100}}\n")
        agents["node-2"] = AgentProcess(
            workdir / "n2", "--config", str(spare_cfg), "--node-name", "node-2",
            "--gpus", "1", "--ib-ports", "1",
            "--token-file", str(workdir / "node-2.token"), *common,
        )  # fmt: skip
        # a spare is one because an operator says so, once the node has reported
        op = {"Authorization": f"Bearer {OP_TOKEN}"}
        wait_for(
            lambda: httpx.get(f"{controller_url}/v1/nodes/node-2", headers=op).status_code == 200,
            timeout_s=30,
            what="node-2 to report",
        )
        r = httpx.put(f"{controller_url}/v1/nodes/node-2/role", json={"role": "spare"}, headers=op)
        assert r.status_code == 200, r.text
        sender = TrainerSender(agents["node-1"].socket_path)
        sender.thread.start()

        host_port = controller_url.removeprefix("http://")
        config = _prometheus_config(
            workdir,
            {
                "agents": [f"127.0.0.1:{a.port}" for a in agents.values()],
                "controller": [host_port],
            },
        )
        prom, prom_url = start_prometheus(prometheus, workdir, config)
        procs.append(prom)
        s = Stack(workdir, controller_url, prom_url, agents, procs)

        def targets_up() -> bool:
            body = httpx.get(f"{prom_url}/api/v1/targets", timeout=5).json()
            active = body["data"]["activeTargets"]
            return len(active) == 3 and all(t["health"] == "up" for t in active)

        wait_for(targets_up, timeout_s=30, what="prometheus to scrape 2 agents + controller")
        # a counter must be seen at 0 before it moves, or increase() cannot see the move
        wait_for(
            lambda: s.series('count_over_time(trainguard_gpu_lost{node="node-1"}[1m]) >= 2'),
            timeout_s=20,
            what="two scrapes of node-1 before injecting faults",
        )
        for kind, gpu in (("dbe", "0"), ("remap_pending", "1")):
            done = agents["node-1"].inject(kind, "--gpu", gpu)
            assert done.returncode == 0, done.stderr
        for what, expr in READY_WHEN:
            wait_for(lambda e=expr: s.series(e), timeout_s=30, what=what)
        ok = True
        yield s
    finally:
        if sender is not None:
            sender.stop.set()
            sender.thread.join(timeout=5)
        for agent in agents.values():
            if agent.terminate() != 0 and not ok:
                print(agent.log())
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        if not ok:
            for name in ("controller.log", "prometheus.log"):
                path = workdir / name
                if path.exists():
                    print(f"--- {name}\n{path.read_text()[-4000:]}")
        cleanup(workdir)


# --- dashboards as Grafana would run them ---------------------------------------------------


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str
    panel: str
    ref: str
    expr: str

    def __str__(self) -> str:
        return f"{self.dashboard} / {self.panel!r} [{self.ref}]: {self.expr}"


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def panel_queries() -> list[PanelQuery]:
    out = []
    for name, dash in load_dashboards().items():
        for panel in dash["panels"]:
            for t in panel.get("targets", []):
                out.append(PanelQuery(name, panel["title"], t["refId"], t["expr"]))
    return out


def substitute(expr: str, values: dict[str, str]) -> str:
    """Expand $var and ${var} as Grafana does (multi-value: a regex alternation)."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise KeyError(f"unknown variable ${name} in {expr!r}")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


def _label_values(stack: Stack, query: str, values: dict[str, str]) -> list[str]:
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
    assert m, f"variable query is not label_values(selector, label): {query!r}"
    selector, label = substitute(m.group(1), values), m.group(2)
    r = httpx.get(
        f"{stack.prometheus_url}/api/v1/label/{label}/values",
        params={"match[]": selector},
        timeout=10,
    )
    data: list[str] = r.json()["data"]
    return data


def variable_values(stack: Stack, dash: dict[str, Any]) -> dict[str, str]:
    """Resolve the dashboard's query variables against the live Prometheus, in order."""
    values = dict(GRAFANA_INTERVALS)
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        options = _label_values(stack, var["query"]["query"], values)
        assert options, f"variable {var['name']} has no values ({var['query']['query']})"
        if var["name"] == "node":
            assert "node-1" in options, options
            values["node"] = "node-1"
        elif var["name"] == "job":
            assert JOB in options, options
            values["job"] = JOB
        else:  # multi-value "All": Grafana joins the values into a regex alternation
            values[var["name"]] = "|".join(re.escape(o) for o in options)
    return values


def _allowed_empty(stack: Stack, expr: str) -> bool:
    """ETTR is the controller's to compute; until JobView.ettr is filled in, the series is
    absent (never a made-up value) and only those queries may come back empty."""
    if ETTR_METRIC not in expr:
        return False
    r = httpx.get(
        f"{stack.controller_url}/v1/jobs",
        headers={"Authorization": f"Bearer {VIEWER_TOKEN}"},
        timeout=10,
    )
    jobs = {j["name"]: j for j in r.json()}
    return jobs.get(JOB, {}).get("ettr") is None


@pytest.mark.slow
def test_every_panel_query_evaluates_and_returns_series(stack: Stack) -> None:
    dashboards = load_dashboards()
    values = {name: variable_values(stack, d) for name, d in dashboards.items()}
    failures: list[str] = []
    allowed: list[str] = []
    queries = panel_queries()
    assert len(queries) > 60, "dashboards lost their panels?"
    for q in queries:
        expr = substitute(q.expr, values[q.dashboard])
        body = stack.query(expr)
        if body.get("status") != "success":
            failures.append(f"ERROR {q}\n    -> {body.get('errorType')}: {body.get('error')}")
        elif not body["data"]["result"]:
            if _allowed_empty(stack, q.expr):
                allowed.append(str(q))
            else:
                failures.append(f"EMPTY {q}\n    -> {expr}")
    for a in allowed:
        print(f"empty until the controller computes ETTR: {a}")
    assert not failures, f"{len(failures)} of {len(queries)} panel queries failed:\n" + "\n".join(
        failures
    )


def panel_expr(dashboard: str, title: str, ref: str = "A") -> str:
    for q in panel_queries():
        if (q.dashboard, q.panel, q.ref) == (dashboard, title, ref):
            return q.expr
    raise AssertionError(f"no panel {title!r} [{ref}] in {dashboard}")


@pytest.mark.slow
def test_panel_values_reflect_the_injected_faults_and_the_job(stack: Stack) -> None:
    """Not just any series: the numbers behind key panels are the ones the stack produced."""
    cluster = "cluster-overview"

    def scalar(dashboard: str, title: str) -> float:
        (only,) = stack.series(substitute(panel_expr(dashboard, title), job_values))
        return float(only["value"][1])

    def by(label: str, dashboard: str, title: str) -> dict[str, float]:
        rows = stack.series(substitute(panel_expr(dashboard, title), job_values))
        return {r["metric"][label]: float(r["value"][1]) for r in rows}

    job_values = {**GRAFANA_INTERVALS, "job": JOB}
    # the DBE on GPU 0 (+ XID 48 and the remap it leaves pending) and the remap on GPU 1
    problems = stack.series(panel_expr(cluster, "GPUs needing attention"))
    found = sorted(
        (r["metric"]["node"], r["metric"]["gpu"], r["metric"]["problem"]) for r in problems
    )
    assert found == [
        ("node-1", "0", "fatal XID"),
        ("node-1", "0", "row remap pending"),
        ("node-1", "0", "uncorrectable ECC"),
        ("node-1", "1", "row remap pending"),
    ]
    assert scalar(cluster, "GPUs with uncorrectable ECC") == 1
    assert scalar(cluster, "GPUs with pending row remap") == 2
    assert scalar(cluster, "GPUs with failed row remap") == 0
    assert scalar(cluster, "Hot spares available") == 1
    assert by("pool", cluster, "Spares left per pool") == {"default": 0, "h100": 1}
    assert scalar(cluster, "Open critical incidents") >= 1
    # rank 2 computes 50% longer than the median of the three
    score = by("rank", "training-job", "Straggler score (compute time / job median)")
    assert score == {"0": 1.0, "1": 1.0, "2": pytest.approx(1.5)}
    durations = by("rank", "training-job", "Checkpoint save duration")
    assert durations == {"0": pytest.approx(0.4), "1": pytest.approx(0.5), "2": pytest.approx(0.6)}
    assert 0 <= scalar("training-job", "Checkpoint age (oldest rank)") < 60
    assert scalar("training-job", "Ranks reporting") == RANKS


@pytest.mark.slow
def test_exported_alert_rules_load_healthy_in_prometheus(stack: Stack) -> None:
    body = httpx.get(f"{stack.prometheus_url}/api/v1/rules", timeout=10).json()
    rules = [r for g in body["data"]["groups"] for r in g["rules"]]
    expected = yaml.safe_load((DASHBOARDS / "alerts.yml").read_text())["groups"][0]["rules"]
    assert sorted(r["name"] for r in rules) == sorted(r["alert"] for r in expected)
    unhealthy = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not unhealthy, unhealthy


@pytest.mark.slow
def test_agent_and_controller_scrapes_pass_promtool_check_metrics(stack: Stack) -> None:
    promtool = require_binary("promtool")
    bodies = {name: a.metrics() for name, a in stack.agents.items()}
    bodies["controller"] = httpx.get(f"{stack.controller_url}/metrics", timeout=10).text
    assert "trainguard_trainer_checkpoint_duration_seconds{" in bodies["node-1"]
    assert "trainguard_controller_remediation_phase_seconds_bucket{" in bodies["controller"]
    for name, text in bodies.items():
        proc = subprocess.run(
            [promtool, "check", "metrics"],
            input=text,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, f"{name}: {proc.stdout}{proc.stderr}"


# --- the checked-in Prometheus files (no processes) -----------------------------------------


def test_example_prometheus_config_passes_promtool_check_config() -> None:
    promtool = require_binary("promtool")
    proc = subprocess.run(
        [promtool, "check", "config", str(DASHBOARDS / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS: 1 rule files found" in proc.stdout + proc.stderr


def test_checked_in_alert_rules_pass_promtool_check_rules() -> None:
    promtool = require_binary("promtool")
    proc = subprocess.run(
        [promtool, "check", "rules", str(DASHBOARDS / "alerts.yml")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
