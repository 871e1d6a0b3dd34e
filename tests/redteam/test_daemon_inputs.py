"""Inputs that used to break a daemon, against real processes: rule files nested too deep or
too long (start, API reload, SIGHUP, agentctl), a damaged store file, and a second agent on a
live heartbeat socket. Each asserts the refusal and that the process and its state are intact.
"""

from __future__ import annotations

import signal
import socket
import stat
import subprocess
from pathlib import Path

import httpx

from tests.helpers import wait_for
from tests.integration.agent_proc import AgentProcess, agent_command
from tests.integration.controller_proc import (
    BIN,
    OP,
    ControllerProcess,
    dbe_rules,
    post_gpu_report,
    write_config,
)
from trainguard.protocol import Heartbeat, encode_json

DEEP = "(" * 90 + "temperature_celsius > 90" + ")" * 90
LONG_OR = " or ".join(["temperature_celsius > 90"] * 1000)


def _rule(condition: str) -> str:
    return (
        "rules:\n"
        "  - name: evil\n"
        "    scope: gpu\n"
        f"    condition: '{condition}'\n"
        "    severity: warning\n"
        "    summary: evil\n"
    )


def test_a_bad_rule_file_at_start_is_exit_2_naming_file_and_rule(
    tmp_path: Path, controllers: list[ControllerProcess]
) -> None:
    cfg = write_config(tmp_path, rules=_rule(DEEP))
    proc = ControllerProcess(cfg, log_path=tmp_path / "controller.log")
    controllers.append(proc)
    assert proc.popen.wait(timeout=60) == 2, proc.log()
    assert "rules.yaml" in proc.log() and "evil" in proc.log()
    assert "nested more than 16 levels deep" in proc.log()
    assert "Traceback" not in proc.log()


def test_reload_of_oversized_rules_is_4xx_and_the_running_rules_stay(
    tmp_path: Path, controllers: list[ControllerProcess]
) -> None:
    cfg = write_config(tmp_path, rules=dbe_rules(), tick_interval_s=0.2)
    proc = ControllerProcess(cfg, log_path=tmp_path / "controller.log")
    controllers.append(proc)
    proc.wait_listening(timeout_s=60)
    for bad in (DEEP, LONG_OR, "temperature_celsius > 1e999"):
        (tmp_path / "rules.yaml").write_text(_rule(bad))
        r = httpx.post(f"{proc.url}/v1/rules/reload", headers=OP, timeout=10)
        assert r.status_code == 400, r.text
        assert "running rules stay" in r.text
    # the rule loaded at start still acts
    post_gpu_report(proc.url, node="node-1", dbe=0, seq=1)
    post_gpu_report(proc.url, node="node-1", dbe=1, seq=2)

    def dbe_incident() -> bool:
        r = httpx.get(f"{proc.url}/v1/incidents", headers=OP, timeout=10)
        return r.status_code == 200 and any(i["rule"] == "gpu_dbe" for i in r.json())

    wait_for(dbe_incident, timeout_s=30, what="the running gpu_dbe rule to open its incident")
    # SIGHUP with the bad file: logged, the rules stay, and the reload thread still serves
    # the next SIGHUP with a good file
    proc.popen.send_signal(signal.SIGHUP)
    wait_for(
        lambda: "sighup_reload_failed" in proc.log(), timeout_s=30, what="the failed reload log"
    )
    (tmp_path / "rules.yaml").write_text(dbe_rules() + _rule("temperature_celsius > 95")[7:])
    proc.popen.send_signal(signal.SIGHUP)
    wait_for(
        lambda: "event=sighup_reload rules=2" in proc.log(),
        timeout_s=30,
        what="a good file to reload after the bad one",
    )
    assert proc.popen.poll() is None
    assert httpx.get(f"{proc.url}/metrics", timeout=10).status_code == 200


def test_agentctl_rules_check_reports_a_deep_rule_without_a_traceback(tmp_path: Path) -> None:
    f = tmp_path / "evil.yaml"
    f.write_text(_rule(DEEP))
    out = subprocess.run(
        [str(BIN / "agentctl"), "rules", "check", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode != 0
    assert "nested more than 16 levels deep" in out.stderr + out.stdout
    assert "Traceback" not in out.stderr


def test_an_empty_or_damaged_store_file_is_exit_2_and_left_as_it_was(
    tmp_path: Path, controllers: list[ControllerProcess]
) -> None:
    for content, reason in ((b"", "empty (0 bytes)"), (b"x" * 8192, "not an SQLite database")):
        cfg = write_config(tmp_path, rules=dbe_rules())
        (tmp_path / "c.db").write_bytes(content)
        proc = ControllerProcess(cfg, log_path=tmp_path / "controller.log")
        controllers.append(proc)
        assert proc.popen.wait(timeout=60) == 2, proc.log()
        assert reason in proc.log() and "trainguard-controller restore" in proc.log()
        assert (tmp_path / "c.db").read_bytes() == content


def test_a_second_agent_on_a_live_heartbeat_socket_refuses_and_the_first_keeps_it(
    short_tmp: Path,
) -> None:
    first = AgentProcess(short_tmp, "--kmsg-path", "")
    try:
        sock = first.socket_path
        second = subprocess.run(
            [
                *agent_command(),
                "--gpu-backend", "sim", "--node-name", "node-1", "--metrics-port", "0",
                "--heartbeat-socket", str(sock), "--jobs-dir", str(short_tmp / "jobs2"),
                "--kmsg-path", "",
            ],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert second.returncode != 0
        assert "owns this heartbeat socket" in second.stderr
        assert stat.S_ISSOCK(sock.lstat().st_mode)
        hb = Heartbeat(job="j", rank=0, local_rank=0, step=7, t=1.0)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(encode_json(hb), str(sock))
        wait_for(
            lambda: 'rank="0"' in first.metrics() and "trainguard_trainer_step" in first.metrics(),
            timeout_s=30,
            what="the first agent to still receive heartbeats",
        )
    finally:
        assert first.terminate() == 0, first.log()
