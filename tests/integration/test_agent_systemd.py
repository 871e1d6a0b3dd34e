"""systemd integration: `trainguard-agent install-unit` writes a unit that runs this
installation and verifies clean, and a real agent process speaks sd_notify (READY, WATCHDOG
while healthy, STOPPING) on a NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for
from tests.integration.agent_proc import AgentProcess, agent_command
from tests.integration.systemd_units import (
    REPO,
    assert_verifies_clean,
    exec_start_program,
    install_unit,
    systemd_analyze,
)
from trainguard.agent.jobs import job_unit_properties


def test_installed_unit_runs_this_installation_and_verifies_clean(tmp_path: Path) -> None:
    analyze = systemd_analyze()
    command = agent_command()
    if len(command) != 1:
        pytest.skip("trainguard-agent console script not installed (pip install -e .)")
    unit = install_unit(Path(command[0]), dest=tmp_path)
    text = unit.read_text()
    for required in (
        "Type=notify", "WatchdogSec=30", "Restart=always", "ProtectSystem=strict",
        "NoNewPrivileges=true", "PrivateTmp=true", "ReadWritePaths=/run/trainguard",
        "DeviceAllow=/dev/nvidiactl rw", "DeviceAllow=/dev/kmsg r",
        "CapabilityBoundingSet=CAP_SYSLOG",
        # requests reach the control sockets of every user's ranks (docs/security.md)
        "CapabilityBoundingSet=CAP_DAC_OVERRIDE",
        # a configuration error exits 2 (tests/unit/agent/test_agent_main.py): no restart loop
        "RestartPreventExitStatus=2",
        # a restart kills the agent's own cgroup; jobs run in transient units of their own
        "KillMode=control-group",
    ):  # fmt: skip
        assert required in text.splitlines(), required
    program = exec_start_program(unit)
    assert program.is_absolute() and program == Path(command[0]), program
    assert program.is_file() and os.access(program, os.X_OK), program
    assert_verifies_clean(analyze, unit)


def test_documented_jobs_drop_in_verifies_clean(tmp_path: Path) -> None:
    analyze = systemd_analyze()
    command = agent_command()
    if len(command) != 1:
        pytest.skip("trainguard-agent console script not installed (pip install -e .)")
    docs = (REPO / "docs" / "agent.md").read_text()
    section = docs.split("### Jobs the agent launches", 1)[1]
    drop_in = section.split("```ini\n", 1)[1].split("```", 1)[0]
    # for jobs.transient_units: never (the jobs then run in the agent's unit)
    for required in ("LimitMEMLOCK=infinity", "DeviceAllow=char-infiniband_verbs rw"):
        assert required in drop_in.splitlines(), required
    unit = install_unit(Path(command[0]), dest=tmp_path)
    (tmp_path / f"{unit.name}.d").mkdir()
    (tmp_path / f"{unit.name}.d" / "jobs.conf").write_text(drop_in)
    assert_verifies_clean(analyze, unit)  # the drop-in beside the unit is read too


@pytest.mark.slow
def test_agent_notifies_ready_watchdog_and_stopping(short_tmp: Path) -> None:
    workdir = short_tmp  # unix socket paths are limited to 108 bytes
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
        wait_for(
            lambda: any(m.startswith("READY=1") for m in drain()), timeout_s=30, what="READY=1"
        )
        ready_at = next(i for i, m in enumerate(got) if m.startswith("READY=1"))
        wait_for(
            lambda: drain()[ready_at:].count("WATCHDOG=1") >= 3,
            timeout_s=30,
            what="watchdog pings after READY",
        )
        assert agent.terminate() == 0
        wait_for(lambda: "STOPPING=1" in drain(), timeout_s=30, what="STOPPING=1")
    finally:
        agent.kill()
        notify.close()


def test_the_job_units_properties_verify_clean_and_carry_what_nccl_needs(tmp_path: Path) -> None:
    """The properties the agent gives each job's transient unit (systemd-run -p), written
    as a unit file: systemd accepts every one of them."""
    analyze = systemd_analyze()
    log = tmp_path / "llm-3.log"
    props = job_unit_properties(log_path=str(log), stop_timeout_s=10.0)
    for required in ("KillMode=control-group", "LimitMEMLOCK=infinity"):
        assert required in props, required
    unit = tmp_path / "trainguard-job-llm-3-0123abcd.service"
    unit.write_text(
        "[Unit]\nDescription=trainguard job llm attempt 3\n\n[Service]\nType=exec\n"
        f"ExecStart={sys.executable} -I -m trainguard.agent.jobwrap --status /x -- /bin/true\n"
        + "".join(f"{p}\n" for p in props)
    )
    assert_verifies_clean(analyze, unit)
