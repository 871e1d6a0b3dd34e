"""AgentConfig: defaults, YAML + flag overrides, strictness and invariants."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml

import trainguard.agent.config as config_mod
from trainguard.agent.config import AgentConfig, load_config
from trainguard.strict import ConfigError

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "agent.yaml"


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "agent.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_are_valid_and_documented_values() -> None:
    c = AgentConfig()
    assert c.controller.report_interval_s == 1.0
    assert c.controller.spool_max_events == 10_000
    assert c.metrics.port == 9500
    assert c.heartbeat.socket_path == "/run/trainguard/heartbeat.sock"
    assert c.heartbeat.mode == 0o666  # senders are authenticated (agent.senders)
    assert c.jobs.control_dir == ""  # <socket dir>/ctl, 1777


def test_missing_default_file_means_defaults_plus_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config_mod, "DEFAULT_CONFIG_PATH", str(tmp_path / "absent.yaml"))
    c, source = load_config(None, overrides={"hardware.sim_gpus": 4, "metrics.port": None})
    assert source == "(flags)"
    assert c.hardware.sim_gpus == 4 and c.metrics.port == 9500


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="file not found"):
        load_config(str(tmp_path / "nope.yaml"))


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "hardware:\n  gpu_backend: sim\n  sim_gpus: 2\nmetrics:\n  port: 9600\n")
    c, source = load_config(path, overrides={"metrics.port": 9700})
    assert source == path
    assert (c.hardware.gpu_backend, c.hardware.sim_gpus, c.metrics.port) == ("sim", 2, 9700)


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("hardware:\n  sim_gpu: 8\n", "hardware.sim_gpu", "unknown key (did you mean 'sim_gpus'?)"),
        ("metrics:\n  port: 70000\n", "metrics.port", "must be within 0..65535"),
        ("hardware:\n  sim_gpus: -1\n", "hardware.sim_gpus", "must be >= 0"),
        ("hardware:\n  gpu_backend: dcgm\n", "hardware.gpu_backend", "must be one of"),
        ("controller:\n  url: http://c:8080\n", "controller.token_file", "is required"),
        ("controller:\n  url: c:8080\n  token_file: /t\n", "controller.url", "must start with"),
        ("heartbeat:\n  rank_timeout_s: 0.5\n", "heartbeat.rank_timeout_s", "must exceed"),
        ("heartbeat:\n  socket_mode: rw\n", "heartbeat.socket_mode", "octal"),
        ("controller:\n  report_interval_s: 0\n", "controller.report_interval_s", "must be > 0"),
        ("collectors:\n  gpu:\n    deadline_s: 0\n", "collectors.gpu.deadline_s", "must be > 0"),
        ("collectors:\n  ib:\n    interval_s: -1\n", "collectors.ib.interval_s", "must be > 0"),
        ("preemption:\n  deadline_s: 0.5\n", "preemption.deadline_s", "must be >= preemption"),
    ],
    ids=[
        "typo", "port-range", "negative-gpus", "unknown-backend", "url-without-token",
        "url-without-scheme", "rank-timeout-too-short", "bad-socket-mode", "zero-interval",
        "zero-source-deadline", "negative-source-interval", "preemption-deadline-below-timeout",
    ],
)  # fmt: skip
def test_bad_config_fails_naming_file_key_and_reason(
    tmp_path: Path, text: str, key: str, reason: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert e.value.source == path
    assert e.value.key == key
    assert reason in e.value.reason


def _dotted_fields(cls: type, prefix: str = "") -> set[str]:
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if isinstance(f.type, str) and f.type.endswith("Config"):
            out |= _dotted_fields(getattr(config_mod, f.type), f"{key}.")
        else:
            out.add(key)
    return out


def _dotted_keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in data.items():
        if isinstance(v, dict) and v and k != "labels":
            out |= _dotted_keys(v, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def test_shipped_example_documents_every_key_with_its_default() -> None:
    c, _ = load_config(str(EXAMPLE))
    assert c == AgentConfig()
    assert _dotted_keys(yaml.safe_load(EXAMPLE.read_text())) == _dotted_fields(AgentConfig)
