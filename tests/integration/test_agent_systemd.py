"""systemd integration: the unit file verifies clean, and a real agent process speaks
sd_notify (READY, WATCHDOG while healthy, STOPPING) on a NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from agent_proc import AgentProcess, agent_command, cleanup, short_tmpdir, wait_until

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "trainguard-agent.service"


def test_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is required in CI (Debian package 'systemd')")
        pytest.skip("systemd-analyze not installed")
    text = UNIT.read_text()
    for required in (
        "Type=notify", "WatchdogSec=30", "Restart=always", "ProtectSystem=strict",
        "NoNewPrivileges=true", "PrivateTmp=true", "ReadWritePaths=/run/trainguard",
        "DeviceAllow=/dev/nvidiactl rw", "DeviceAllow=/dev/kmsg r",
        "CapabilityBoundingSet=CAP_SYSLOG",
    ):  # fmt: skip
        assert required in text, required
    # verify checks that ExecStart exists: point it at this checkout's agent
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    binary = exec_line.split("=", 1)[1].split()[0]
    script = agent_command()[0] if len(agent_command()) == 1 else None
    if script is None:
        pytest.skip("trainguard-agent console script not installed (pip install -e .)")
    unit = tmp_path / "trainguard-agent.service"
    unit.write_text(text.replace(binary, script))
    proc = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    # unknown keys are only warnings (exit 0): any output at all is a failure
    assert proc.returncode == 0 and not proc.stderr.strip() and not proc.stdout.strip(), (
        proc.stdout + proc.stderr
    )


@pytest.mark.slow
def test_agent_notifies_ready_watchdog_and_stopping() -> None:
    workdir = short_tmpdir()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(workdir / "notify"))
    notify.setblocking(False)
    got: list[str] = []

    def drain() -> list[str]:
        try:
            while True:
                got.append(notify.recv(4096).decode())
        except BlockingIOError:
            pass
        return got

    agent = AgentProcess(
        workdir, "--collect-interval-s", "0.2", env={"NOTIFY_SOCKET": str(workdir / "notify")}
    )
    try:
        wait_until(lambda: any(m.startswith("READY=1") for m in drain()), what="READY=1")
        ready_at = next(i for i, m in enumerate(got) if m.startswith("READY=1"))
        wait_until(
            lambda: drain()[ready_at:].count("WATCHDOG=1") >= 3, what="watchdog pings after READY"
        )
        assert agent.terminate() == 0
        wait_until(lambda: "STOPPING=1" in drain(), what="STOPPING=1")
    finally:
        agent.kill()
        notify.close()
        cleanup(workdir)
