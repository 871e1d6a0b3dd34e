"""docs/deploy.md, followed on this machine: every `bash tested` block of the guide runs, in
order, with the guide's names swapped for local ones (SWAPS); then the controller and three
agents run from the files those blocks wrote (as their units would start them), one node
joins later with a token issued from a hostlist and a SIGHUP, and a real Prometheus scrapes
the targets the guide generated.

One set of processes for the module; the whole file takes well under a minute."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import free_port, short_tmpdir, wait_for
from tests.integration.agent_proc import AgentProcess
from tests.integration.controller_proc import ControllerProcess
from tests.integration.prometheus_proc import require_binary, start_prometheus, stop
from tests.integration.systemd_units import assert_verifies_clean, systemd_analyze

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "deploy.md"
BIN = Path(sys.executable).parent
# the nodes the guide's blocks set up (node-03 joins later, from a hostlist, on SIGHUP)
NODES = ("node-01", "node-02")
LATE_NODE = "node-03"
ADDRESS = {"node-01": "127.0.0.1", "node-02": "127.0.0.2", "node-03": "127.0.0.3"}


def guide_blocks(text: str) -> list[str]:
    """The bodies of the guide's ```bash tested fenced blocks, in order."""
    return re.findall(r"^```bash tested\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


def swaps(root: Path, *, ctl_port: int, agent_port: int) -> list[tuple[str, str]]:
    """The guide's names -> this machine's, longest first where one contains another."""
    return [
        # the agents' targets: the guide's node names resolve on a cluster, not here
        ("'node-[01-64]' --port 9500", f"'127.0.0.[1-3]' --port {agent_port}"),
        ("node-[01-64]", "node-[01-02]"),
        ("/etc/trainguard", str(root / "etc")),
        ("/etc/systemd/system", str(root / "systemd")),
        ("/etc/prometheus", str(root / "prometheus")),
        ("/var/lib/trainguard", str(root / "var")),
        ("tg-ctl.example.internal", "localhost"),
        ("0.0.0.0", "127.0.0.1"),
        ("8800", str(ctl_port)),
    ]


def swap(block: str, pairs: list[tuple[str, str]]) -> str:
    for old, new in pairs:
        block = block.replace(old, new)
    return block


def run_block(block: str, *, cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"{block}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc.stdout


@dataclass
class Cluster:
    root: Path
    ctl_url: str
    ctl: ControllerProcess
    agents: dict[str, AgentProcess]
    prom_url: str
    outputs: list[str]

    @property
    def ca(self) -> str:
        return str(self.root / "etc" / "tls" / "ca.crt")

    def ops(self) -> dict[str, str]:
        token = (self.root / "etc" / "ops.token").read_text().strip()
        return {"Authorization": f"Bearer {token}"}

    def nodes(self) -> set[str]:
        verify = ssl.create_default_context(cafile=self.ca)
        r = httpx.get(f"{self.ctl_url}/v1/nodes", headers=self.ops(), verify=verify, timeout=5)
        assert r.status_code == 200, r.text
        return {n["name"] for n in r.json()}


def _start_agent(root: Path, node: str, config: Path, agent_port: int) -> AgentProcess:
    work = root / "agents" / node
    work.mkdir(parents=True, exist_ok=True)
    return AgentProcess(
        work, "--config", str(config), "--node-name", node,
        "--gpus", "2", "--ib-ports", "2", "--kmsg-path", "", "--report-interval-s", "1",
        "--metrics-address", ADDRESS[node], "--metrics-port", str(agent_port),
        log_name=f"{node}.log",
    )  # fmt: skip


def _prometheus_config(root: Path) -> Path:
    """The shipped prometheus.yml where the guide's targets went, with the guide's change
    for a TLS controller (scheme https, the CA) and 1 s intervals."""
    prom_dir = root / "prometheus"
    config = yaml.safe_load((REPO / "dashboards" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["global"]["evaluation_interval"] = "1s"
    for scrape in config["scrape_configs"]:
        for sd in scrape["file_sd_configs"]:
            sd["refresh_interval"] = "1s"
        if scrape["job_name"] == "trainguard-controller":
            scrape["scheme"] = "https"
            scrape["tls_config"] = {"ca_file": str(root / "etc" / "tls" / "ca.crt")}
    shutil.copy(REPO / "dashboards" / "alerts.yml", prom_dir / "alerts.yml")
    path = prom_dir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    prometheus = require_binary("prometheus")
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    root = short_tmpdir("tgdeploy")
    ctl_port, agent_port = free_port(), free_port()
    pairs = swaps(root, ctl_port=ctl_port, agent_port=agent_port)
    blocks = guide_blocks(GUIDE.read_text())
    assert len(blocks) >= 7, "the guide lost its tested blocks"
    (root / "var").mkdir()  # the unit's StateDirectory=
    (root / "systemd").mkdir()  # /etc/systemd/system is there on any host
    ctl: ControllerProcess | None = None
    agents: dict[str, AgentProcess] = {}
    prom: subprocess.Popen[bytes] | None = None
    try:
        outputs: list[str] = []
        for block in blocks:
            if "node=$(hostname -s)" in block:  # on each node: here, one per node
                for node in NODES:
                    node_block = block.replace("$(hostname -s)", node).replace(
                        "/etc/trainguard/agent.yaml", str(root / "agents" / f"{node}.yaml")
                    )
                    (root / "agents").mkdir(exist_ok=True)
                    outputs.append(run_block(swap(node_block, pairs), cwd=root))
                continue
            outputs.append(run_block(swap(block, pairs), cwd=root))
        # the controller as its unit starts it: the unit's ExecStart and config
        ctl = ControllerProcess(root / "etc" / "controller.yaml", log_path=root / "ctl.log")
        ctl.wait_listening()
        ctl_url = ctl.url.replace("127.0.0.1", "localhost")
        for node in NODES:
            agents[node] = _start_agent(root, node, root / "agents" / f"{node}.yaml", agent_port)
        prom, prom_url = start_prometheus(prometheus, root, _prometheus_config(root))
        yield Cluster(root, ctl_url, ctl, agents, prom_url, outputs)
    finally:
        if prom is not None:
            stop(prom)
        for agent in agents.values():
            agent.terminate()
        if ctl is not None:
            ctl.terminate()
        shutil.rmtree(root, ignore_errors=True)


def test_the_guide_has_its_steps_and_check_config_passes(cluster: Cluster) -> None:
    assert any(out.startswith("ok: ") and " mtls " in out for out in cluster.outputs), (
        cluster.outputs
    )
    tokens = yaml.safe_load((cluster.root / "etc" / "tokens.yaml").read_text())["tokens"]
    assert sorted(t["node"] for t in tokens if t["role"] == "agent") == list(NODES)
    assert [t["name"] for t in tokens if t["role"] == "operator"] == ["ops"]


def test_agents_report_over_mutual_tls_with_their_node_certificates(cluster: Cluster) -> None:
    wait_for(lambda: cluster.nodes() >= set(NODES), timeout_s=30, what="both agents to report")
    # the certificate is the credential: no token in these agents' configs
    for node in NODES:
        config = yaml.safe_load((cluster.root / "agents" / f"{node}.yaml").read_text())
        assert "token_file" not in config["controller"]
        assert config["controller"]["tls_cert_file"].endswith(f"{node}.crt")


def test_a_token_issued_from_a_hostlist_is_accepted_after_sighup(cluster: Cluster) -> None:
    etc = cluster.root / "etc"
    run_block(
        f"agentctl token issue '{LATE_NODE[:-2]}[03-03]' --out-dir {etc / 'node-tokens'} "
        f"--tokens-file {etc / 'tokens.yaml'} > /dev/null",
        cwd=cluster.root,
    )
    cluster.ctl.popen.send_signal(signal.SIGHUP)
    wait_for(
        lambda: "event=sighup_tokens tokens=4" in cluster.ctl.log(),
        timeout_s=15,
        what="the controller to reload its tokens",
    )
    config = cluster.root / "agents" / f"{LATE_NODE}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "node": {"name": LATE_NODE},
                "controller": {
                    "url": cluster.ctl_url,
                    "ca_file": cluster.ca,
                    "token_file": str(etc / "node-tokens" / f"{LATE_NODE}.token"),
                },
            }
        )
    )
    agent_port = int(
        json.loads((cluster.root / "prometheus" / "targets" / "agents-all.yml").read_text())[0][
            "targets"
        ][0].rsplit(":", 1)[1]
    )
    cluster.agents[LATE_NODE] = _start_agent(cluster.root, LATE_NODE, config, agent_port)
    wait_for(lambda: LATE_NODE in cluster.nodes(), timeout_s=30, what="the late node to report")
    assert cluster.ctl.popen.poll() is None  # the same process: no restart


def test_prometheus_scrapes_the_generated_targets(cluster: Cluster) -> None:
    targets = json.loads((cluster.root / "prometheus" / "targets" / "agents-all.yml").read_text())
    assert len(targets[0]["targets"]) == 3

    def up() -> dict[str, str] | None:
        body = httpx.get(f"{cluster.prom_url}/api/v1/targets", timeout=5).json()
        health = {t["scrapeUrl"]: t["health"] for t in body["data"]["activeTargets"]}
        want = {u for u in health if "127.0.0.1" in u or "127.0.0.2" in u or "localhost" in u}
        ok = len(want) == 3 and all(health[u] == "up" for u in want)
        return health if ok else None

    health = wait_for(up, timeout_s=30, what="the agents and the controller up in Prometheus")
    assert any(u.startswith("https://localhost:") for u in health), health


def test_the_units_the_guide_installs_verify(cluster: Cluster) -> None:
    analyze = systemd_analyze()
    units = cluster.root / "systemd"
    for name in ("trainguard-controller.service", "trainguard-agent.service"):
        assert_verifies_clean(analyze, units / name)
    drop_in = (units / "trainguard-controller.service.d" / "run-as.conf").read_text()
    assert "User=slurm" in drop_in and "DynamicUser=no" in drop_in
