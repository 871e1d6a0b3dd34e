"""systemd integration of the controller: the unit file verifies clean, and a real
trainguard-controller process speaks sd_notify (READY after it listens, WATCHDOG while its
loops run, STOPPING on SIGTERM) on a NOTIFY_SOCKET."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from agent_proc import cleanup, short_tmpdir, wait_until
from controller_proc import BIN, ControllerProcess, write_config

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "trainguard-controller.service"


def test_controller_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is required in CI (Debian package 'systemd')")
        pytest.skip("systemd-analyze not installed")
    script = BIN / "trainguard-controller"
    if not script.exists():
        pytest.skip("trainguard-controller console script not installed (pip install -e .)")
    text = UNIT.read_text()
    for required in ("Type=notify", "NotifyAccess=main", "WatchdogSec=30s", "Restart=always"):
        assert required in text, required
    exec_line = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    binary = exec_line.split("=", 1)[1].split()[0]
    unit = tmp_path / "trainguard-controller.service"
    unit.write_text(text.replace(binary, str(script)))
    proc = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False
    )
    # unknown keys are only warnings (exit 0): any output at all is a failure
    assert proc.returncode == 0 and not proc.stderr.strip() and not proc.stdout.strip(), (
        proc.stdout + proc.stderr
    )


@pytest.mark.slow
def test_controller_notifies_ready_watchdog_and_stopping() -> None:
    workdir = short_tmpdir()  # unix socket paths are limited to 108 bytes
    cfg = write_config(workdir, rules="rules: []\n", tick_interval_s=0.2)
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

    # WatchdogSec=1 s: a ping every 0.5 s
    env = {**os.environ, "NOTIFY_SOCKET": str(workdir / "notify"), "WATCHDOG_USEC": "1000000"}
    proc = ControllerProcess(cfg, log_path=workdir / "controller.log", env=env)
    try:
        wait_until(lambda: any(m.startswith("READY=1") for m in drain()), what="READY=1")
        assert "event=api_listening" in proc.log()  # READY only once it listens
        ready_at = next(i for i, m in enumerate(got) if m.startswith("READY=1"))
        wait_until(
            lambda: drain()[ready_at:].count("WATCHDOG=1") >= 3, what="watchdog pings after READY"
        )
        assert proc.terminate(timeout_s=30) == 0, proc.log()
        wait_until(lambda: "STOPPING=1" in drain(), what="STOPPING=1")
    finally:
        proc.kill()
        notify.close()
        cleanup(workdir)
