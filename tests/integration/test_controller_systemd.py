"""systemd integration of the controller: `trainguard-controller install-unit` writes a unit
that runs this installation and verifies clean, the controller reads its tokens from the
credentials directory the unit's LoadCredential= fills, and a real
trainguard-controller process speaks sd_notify (READY after it listens, WATCHDOG while its
loops run, STOPPING on SIGTERM) on a NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers import wait_for
from tests.integration.controller_proc import (
    BIN,
    OP,
    ControllerProcess,
    start_controller,
    write_config,
)
from tests.integration.systemd_units import (
    assert_verifies_clean,
    exec_start_program,
    install_unit,
    systemd_analyze,
)


def test_installed_controller_unit_runs_this_installation_and_verifies_clean(
    tmp_path: Path,
) -> None:
    analyze = systemd_analyze()
    script = BIN / "trainguard-controller"
    if not script.exists():
        pytest.skip("trainguard-controller console script not installed (pip install -e .)")
    unit = install_unit(script, dest=tmp_path)
    lines = unit.read_text().splitlines()
    for required in (
        "Type=notify", "NotifyAccess=main", "WatchdogSec=30s", "Restart=always",
        "RestartPreventExitStatus=2", "DynamicUser=yes",
        # the dynamic user reads the tokens as a credential (test below: the controller side)
        "LoadCredential=tokens:/etc/trainguard/tokens.yaml",
    ):  # fmt: skip
        assert required in lines, required
    program = exec_start_program(unit)
    assert program.is_absolute() and program == script, program
    assert program.is_file() and os.access(program, os.X_OK), program
    assert_verifies_clean(analyze, unit)


@pytest.mark.slow
def test_controller_reads_its_tokens_from_the_credentials_directory(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, rules="rules: []\n")
    creds = tmp_path / "credentials"  # what LoadCredential=tokens:... fills
    creds.mkdir()
    (tmp_path / "tokens.yaml").rename(creds / "tokens")
    text = cfg.read_text().replace(
        f"tokens_file: {tmp_path / 'tokens.yaml'}", "tokens_file: '${CREDENTIALS_DIRECTORY}/tokens'"
    )
    assert "CREDENTIALS_DIRECTORY" in text
    cfg.write_text(text)

    env = {k: v for k, v in os.environ.items() if k != "CREDENTIALS_DIRECTORY"}
    unset = subprocess.run(
        [str(BIN / "trainguard-controller"), "--config", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert unset.returncode == 2, unset.stdout + unset.stderr
    assert "api.tokens_file" in unset.stderr and "CREDENTIALS_DIRECTORY is not set" in unset.stderr

    proc = start_controller(
        cfg,
        log_path=tmp_path / "controller.log",
        env={**env, "CREDENTIALS_DIRECTORY": str(creds)},
    )
    try:
        assert httpx.get(f"{proc.url}/v1/nodes", headers=OP, timeout=10).status_code == 200
        wrong = {"Authorization": "Bearer not-a-token"}
        assert httpx.get(f"{proc.url}/v1/nodes", headers=wrong, timeout=10).status_code == 401
        assert proc.terminate(timeout_s=30) == 0, proc.log()
    finally:
        proc.kill()


@pytest.mark.slow
def test_controller_notifies_ready_watchdog_and_stopping(short_tmp: Path) -> None:
    workdir = short_tmp  # unix socket paths are limited to 108 bytes
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
        wait_for(
            lambda: any(m.startswith("READY=1") for m in drain()), timeout_s=30, what="READY=1"
        )
        assert "event=api_listening" in proc.log()  # READY only once it listens
        ready_at = next(i for i, m in enumerate(got) if m.startswith("READY=1"))
        wait_for(
            lambda: drain()[ready_at:].count("WATCHDOG=1") >= 3,
            timeout_s=30,
            what="watchdog pings after READY",
        )
        assert proc.terminate(timeout_s=30) == 0, proc.log()
        wait_for(lambda: "STOPPING=1" in drain(), timeout_s=30, what="STOPPING=1")
    finally:
        proc.kill()
        notify.close()
