"""trainguard-controller as a real process: config errors, serving, SIGHUP reload, SIGTERM."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.controller_proc import (
    AGENT,
    BIN,
    OP,
    ControllerProcess,
    dbe_rules,
    start_controller,
    write_config,
)
from trainguard.controller.cli import main as agentctl
from trainguard.model import GpuSample
from trainguard.protocol import Report, encode_json

RULE = dbe_rules()


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[ControllerProcess]:
    proc = start_controller(
        write_config(tmp_path, rules=RULE),
        log_path=tmp_path / "controller.log",
        # --db and --dry-run override the file: the store must land at the flag's path
        args=["--db", str(tmp_path / "flag.db"), "--dry-run"],
    )
    try:
        yield proc
    finally:
        proc.kill()


@pytest.mark.slow
def test_controller_serves_reports_reloads_on_sighup_and_stops_on_sigterm(
    controller: ControllerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_TOKEN", "op-token")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    gpu = GpuSample(index=0, uuid="GPU-0", pci_bus_id="0000:18:00.0", name="H100")
    report = Report(node="node-7", instance="i1", seq=1, sent_at=time.time(), gpus=(gpu,))
    with httpx.Client(base_url=controller.url, timeout=10) as c:
        r = c.post("/v1/reports", content=encode_json(report), headers=AGENT)
        assert r.status_code == 200, r.text
        assert r.json()["ack_event_id"] == 0
        nodes = c.get("/v1/nodes", headers=OP).json()
        assert [n["name"] for n in nodes] == ["node-7"]
        assert c.get("/healthz").json() == {"status": "ok"}
        # agentctl against the real controller
        out, err = io.StringIO(), io.StringIO()
        argv = ["--url", controller.url, "get", "nodes", "-o", "json"]
        assert agentctl(argv, stdout=out, stderr=err) == 0, err.getvalue()
        assert [n["name"] for n in json.loads(out.getvalue())] == ["node-7"]
        out = io.StringIO()
        assert agentctl(["--url", controller.url, "describe", "node", "node-7"], stdout=out) == 0
        assert "name:" in out.getvalue()
        assert agentctl(["--url", controller.url, "describe", "node", "ghost"], stderr=err) == 3
        assert "trainguard_controller_report_ingest_seconds_count" in c.get("/metrics").text

        # a broken rule file: the reload fails, is logged, and the old rule keeps running
        (tmp_path / "rules.yaml").write_text(RULE.replace("> 0", "> > 0"))
        controller.popen.send_signal(signal.SIGHUP)
        wait_for(
            lambda: "event=sighup_reload_failed" in controller.log(),
            timeout_s=15,
            what="the failed reload to be logged",
        )
        second = RULE.replace("gpu_dbe", "gpu_dbe_2").replace("rules:\n", "")
        (tmp_path / "rules.yaml").write_text(RULE + second)
        controller.popen.send_signal(signal.SIGHUP)
        wait_for(
            lambda: "event=sighup_reload rules=2" in controller.log(),
            timeout_s=15,
            what="the good reload to be logged",
        )
        audit = c.get("/v1/audit", headers=OP).json()
        assert any(a["action"] == "reload_rules" and a["actor"] == "sighup" for a in audit)

    controller.popen.send_signal(signal.SIGTERM)
    assert controller.popen.wait(timeout=30) == 0, controller.log()
    assert (tmp_path / "flag.db").exists()
    assert not (tmp_path / "c.db").exists()
    text = controller.log()
    assert "event=controller_stopped" in text
    assert "op-token" not in text
    assert "agent-token" not in text


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        pytest.param("api: {prot: 1}\n", "api.prot", id="unknown-key"),
        pytest.param("api: {port: 70000}\n", "api.port", id="bad-port"),
        pytest.param(
            "api: {tokens_file: /nonexistent/tokens.yaml}\n", "file not found", id="no-tokens-file"
        ),
    ],
)
def test_bad_config_exits_2_with_the_reason(tmp_path: Path, content: str, needle: str) -> None:
    cfg = tmp_path / "controller.yaml"
    cfg.write_text(f"store: {{path: {tmp_path / 'c.db'}}}\n" + content)
    r = subprocess.run(
        [str(BIN / "trainguard-controller"), "--config", str(cfg)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is required in CI (Debian package systemd)")
        pytest.skip("systemd-analyze not installed")
    unit = Path(__file__).parents[2] / "systemd" / "trainguard-controller.service"
    text = unit.read_text()
    assert "Type=notify" in text
    assert "Restart=always" in text
    # verify needs ExecStart to exist: point it at this environment's console script
    local = tmp_path / unit.name
    local.write_text(
        text.replace("/usr/local/bin/trainguard-controller", str(BIN / "trainguard-controller"))
    )
    r = subprocess.run(
        [analyze, "verify", str(local)], check=False, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stderr.strip() == "", r.stderr
