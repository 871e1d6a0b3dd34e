"""The wheel works anywhere: built from this checkout, installed into a clean virtualenv, and
run from a directory outside the checkout, with nothing but the installed package.

One wheel and one virtualenv for the module (building and installing take most of its time).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.systemd_units import (
    assert_verifies_clean,
    exec_start_program,
    systemd_analyze,
)
from trainguard.controller.auth import hash_token

REPO = Path(__file__).resolve().parents[2]
OP_TOKEN = "wheel-op-token"
AGENT_TOKEN = "wheel-agent-token"


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    work: Path  # a directory outside the checkout: every command runs here

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *args: str, check: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            list(args),
            cwd=self.work,
            env=_clean_env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            **kw,  # type: ignore[call-overload]
        )
        if check:
            assert out.returncode == 0, f"{args}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
        return out


def _clean_env() -> dict[str, str]:
    """No PYTHONPATH, no virtualenv of the checkout: only what the wheel installed is seen."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = "/usr/bin:/bin"
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = dist.glob("trainguard-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"{wheel}[controller]"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert pip.returncode == 0, pip.stdout + pip.stderr
    work = root / "elsewhere"
    work.mkdir()
    yield Installed(wheel=wheel, venv=venv, work=work)


def test_the_wheel_installs_one_namespace_with_its_data(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.startswith("trainguard-")}
    assert top == {"trainguard"}, top  # no top-level `agent` or `controller`
    for data in (
        "trainguard/rules/default.yaml",
        "trainguard/rules/xid_catalog.yaml",
        "trainguard/py.typed",
    ):
        assert data in names, data
    shared = {n.split(".data/data/", 1)[1] for n in names if ".data/data/" in n}
    for data in (
        "share/trainguard/dashboards/alerts.yml",
        "share/trainguard/dashboards/cluster-overview.json",
        "share/trainguard/systemd/trainguard-agent.service",
        "share/trainguard/systemd/trainguard-controller.service",
        "share/trainguard/examples/controller.yaml",
        "share/trainguard/examples/agent.yaml",
        "share/doc/trainguard/README.md",
        "share/doc/trainguard/deploy.md",
    ):
        assert data in shared, data
    # and they are where an operator looks for them after the install
    assert (installed.venv / "share/trainguard/dashboards/alerts.yml").is_file()


def test_the_installed_package_is_imported_from_the_virtualenv(installed: Installed) -> None:
    out = installed.run(
        installed.bin("python"),
        "-c",
        "import trainguard, trainguard.agent, trainguard.controller, importlib.util, sys;"
        "print(trainguard.__file__);"
        "print(importlib.util.find_spec('agent'), importlib.util.find_spec('controller'))",
    )
    first, second = out.stdout.splitlines()
    assert first.startswith(str(installed.venv)), first
    assert second == "None None"


def test_version_on_every_command(installed: Installed) -> None:
    for cmd in ("trainguard-agent", "trainguard-controller", "agentctl"):
        out = installed.run(installed.bin(cmd), "--version")
        assert re.search(r"\d+\.\d+", out.stdout), (cmd, out.stdout)


def test_shipped_rules_check_and_export_without_a_path(installed: Installed) -> None:
    check = installed.run(installed.bin("agentctl"), "rules", "check")
    assert "ok" in (check.stdout + check.stderr).lower()
    export = installed.run(installed.bin("agentctl"), "rules", "export", "--format", "prometheus")
    assert "gpu_fatal_xid" in export.stdout
    (installed.work / "alerts.yml").write_text(export.stdout)
    promtool = Path("/usr/bin/promtool")
    if promtool.exists():
        lint = installed.run(str(promtool), "check", "rules", "alerts.yml")
        assert "SUCCESS" in lint.stdout


def test_install_unit_runs_the_virtualenv_with_the_shipped_units(installed: Installed) -> None:
    analyze = systemd_analyze()
    dest = installed.work / "units"
    dest.mkdir()
    for cmd in ("trainguard-agent", "trainguard-controller"):
        out = installed.run(installed.bin(cmd), "install-unit", "--dest", str(dest))
        shipped = installed.venv / "share/trainguard/systemd" / f"{cmd}.service"
        assert f"from {shipped})" in out.stdout, out.stdout  # the wheel's copy, not the checkout's
        unit = dest / f"{cmd}.service"
        assert exec_start_program(unit) == Path(installed.bin(cmd))
        assert_verifies_clean(analyze, unit)
        # Documentation= names the wheel's copy of the docs, and it is there
        (line,) = [ln for ln in unit.read_text().splitlines() if ln.startswith("Documentation=")]
        uris = line.removeprefix("Documentation=").split()
        assert uris, line
        for uri in uris:
            path = Path(unquote(urlsplit(uri).path))
            assert uri.startswith("file://") and path.is_file(), uri
            assert path.is_relative_to(installed.venv / "share/doc/trainguard"), uri


def _start(installed: Installed, name: str, args: list[str]) -> subprocess.Popen[bytes]:
    log = (installed.work / f"{name}.log").open("wb")
    return subprocess.Popen(
        args, cwd=installed.work, env=_clean_env(), stdout=log, stderr=subprocess.STDOUT
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_controller_agent_and_agentctl_from_the_wheel(installed: Installed) -> None:
    work = installed.work
    (work / "tokens.yaml").write_text(
        "tokens:\n"
        f'  - {{name: ops, role: operator, sha256: "{hash_token(OP_TOKEN)}"}}\n'
        "  - {name: agent-node-12, role: agent, node: node-12,"
        f' sha256: "{hash_token(AGENT_TOKEN)}"}}\n'
    )
    (work / "agent.token").write_text(AGENT_TOKEN + "\n")
    (work / "agent.token").chmod(0o600)
    (work / "op.token").write_text(OP_TOKEN + "\n")
    (work / "op.token").chmod(0o600)
    # names neither rules nor the XID catalog: both come from the installed package
    (work / "controller.yaml").write_text(
        f"store: {{path: {work / 'c.db'}}}\n"
        f"api: {{host: 127.0.0.1, port: 0, tokens_file: {work / 'tokens.yaml'}}}\n"
    )
    controller = _start(
        installed,
        "controller",
        [installed.bin("trainguard-controller"), "--config", str(work / "controller.yaml")],
    )
    agent: subprocess.Popen[bytes] | None = None
    try:
        clog = work / "controller.log"
        wait_for(
            lambda: "event=api_listening" in clog.read_text() or controller.poll() is not None,
            timeout_s=60,
            what="the installed controller to listen",
        )
        assert controller.poll() is None, clog.read_text()
        m = re.search(r"event=api_listening url=(\S+)", clog.read_text())
        assert m, clog.read_text()
        url = m.group(1)
        agent = _start(
            installed,
            "agent",
            [
                installed.bin("trainguard-agent"),
                "--gpu-backend",
                "sim",
                "--gpus",
                "2",
                "--ib-ports",
                "1",
                "--node-name",
                "node-12",
                "--metrics-port",
                "0",
                "--heartbeat-socket",
                str(work / "hb.sock"),
                "--jobs-dir",
                str(work / "jobs"),
                "--kmsg-path",
                "",
                "--controller",
                url,
                "--token-file",
                str(work / "agent.token"),
            ],
        )
        ops = {"Authorization": f"Bearer {OP_TOKEN}"}

        def node_state() -> dict[str, object] | None:
            r = httpx.get(f"{url}/v1/nodes", headers=ops, timeout=5)
            body = r.json() if r.status_code == 200 else []
            for n in body.get("nodes", body) if isinstance(body, dict) else body:
                if isinstance(n, dict) and n.get("name") == "node-12":
                    return n
            return None

        wait_for(
            lambda: node_state() is not None or agent.poll() is not None,
            timeout_s=60,
            what="the installed agent to report",
        )
        assert agent.poll() is None, (work / "agent.log").read_text()
        ctl = [installed.bin("agentctl"), "--url", url, "--token-file", str(work / "op.token")]
        installed.run(*ctl, "drain", "node-12")  # as typed: no --reason
        out = installed.run(*ctl, "get", "nodes", "-o", "json")
        nodes = json.loads(out.stdout)
        rows = nodes.get("nodes", nodes) if isinstance(nodes, dict) else nodes
        (row,) = [n for n in rows if n["name"] == "node-12"]
        assert row["state"] in ("draining", "drained"), row
        assert row["drain_reason"] == "drained by ops (operator) via agentctl", row
        # the agent's XID counters carry the catalog's severity (the catalog came from the wheel)
        alog = (work / "agent.log").read_text()
        port = re.search(r"metrics_port=(\d+)", alog)
        assert port, alog
        installed.run(
            installed.bin("trainguard-agent"),
            "inject",
            "--metrics-port",
            port.group(1),
            "xid",
            "--gpu",
            "0",
            "--code",
            "79",
        )

        def xid_line() -> str | None:
            text = httpx.get(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=5).text
            hits = [ln for ln in text.splitlines() if ln.startswith("trainguard_gpu_xid")]
            hits = [ln for ln in hits if 'xid="79"' in ln]
            return hits[0] if hits else None

        wait_for(lambda: xid_line() is not None, timeout_s=30, what="the XID 79 counter")
        assert 'severity="fatal"' in (xid_line() or "")
    finally:
        if agent is not None:
            _stop(agent)
        _stop(controller)
