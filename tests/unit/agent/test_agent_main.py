"""The trainguard-agent command line: config errors, --check-config, inject failures."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

import trainguard.agent.config as config_mod
from trainguard.agent.main import main


@pytest.fixture(autouse=True)
def no_default_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.yaml"))


def test_config_error_names_file_key_reason_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("controller:\n  report_interval_sec: 1\n")
    assert main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"trainguard-agent: config error: {cfg}: controller.report_interval_sec: "
        "unknown key (did you mean 'report_interval_s'?)"
    )


def test_bad_flag_value_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--metrics-port", "70000"]) == 2
    assert "metrics.port: must be within 0..65535" in capsys.readouterr().err


def test_explicit_missing_config_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: file not found" in capsys.readouterr().err


def test_check_config_prints_the_merged_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--check-config", "--gpu-backend", "sim", "--gpus", "2", "--node-name", "n1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == "(flags)"
    assert out["config"]["hardware"]["sim_gpus"] == 2
    assert out["config"]["node"]["name"] == "n1"


def test_inject_without_a_running_agent_fails_clearly(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["inject", "--metrics-port", str(port), "dbe", "--gpu", "1"]) == 1
    assert "cannot reach the agent" in capsys.readouterr().err


def test_inject_rejects_an_unknown_fault_kind() -> None:
    with pytest.raises(SystemExit) as e:
        main(["inject", "meltdown"])
    assert e.value.code == 2


def test_install_unit_subcommand_renders_the_agent_unit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "bin").mkdir()
    script = tmp_path / "bin" / "trainguard-agent"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    unit = tmp_path / "mine.service"
    unit.write_text("[Service]\nExecStart=/usr/local/bin/trainguard-agent --config /x\n")
    argv = ["install-unit", "--prefix", str(tmp_path), "--unit-file", str(unit), "--dry-run"]
    assert main(argv) == 0
    assert f"ExecStart={script} --config /x" in capsys.readouterr().out


def test_a_host_name_the_controller_would_refuse_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "bad host\nname")
    assert main(["--gpu-backend", "sim", "--metrics-port", "0"]) == 2
    err = capsys.readouterr().err
    assert "node.name (default: the host name) must match" in err
    assert "set node.name or --node-name" in err
