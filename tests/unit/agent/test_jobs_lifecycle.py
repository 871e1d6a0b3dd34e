"""The launch lifecycle with a stand-in launcher (real processes, no torch): launches outside
the agent (systemd-run's argument list, or a session of their own), re-adoption by a new
runner from the launch records (a reused pid is never adopted, an exit meanwhile is
reported once), and stale attempts stopped on the controller's word."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import alive, wait_for
from trainguard.agent.jobpolicy import JobPolicy
from trainguard.agent.jobs import (
    JobEvent,
    JobRunner,
    job_unit_name,
    job_unit_properties,
    systemd_is_pid1,
    systemd_run_argv,
)
from trainguard.agent.launchrec import load_records
from trainguard.clock import FakeClock
from trainguard.command_args import StartJobArgs
from trainguard.protocol import EventKind

# Stands in for `python -m torch.distributed.run ...`: says it is up, then waits; SIGTERM
# exits 0. It also writes its pid (the wrapper's child) for the tests.
LAUNCHER = """\
#!{python}
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("launcher up pid=%d" % os.getpid(), flush=True)
time.sleep(300)
"""


@pytest.fixture
def launcher(tmp_path: Path) -> str:
    path = tmp_path / "fake-python"
    path.write_text(LAUNCHER.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def make_runner(tmp_path: Path, **kwargs: object) -> JobRunner:
    return JobRunner(
        node_name="node-1",
        work_dir=str(tmp_path / "work"),
        heartbeat_socket=str(tmp_path / "hb.sock"),
        policy=JobPolicy.unrestricted(),
        systemd=False,
        **kwargs,  # type: ignore[arg-type]
    )


def spec(launcher: str, *, attempt: int = 1, job: str = "llm") -> StartJobArgs:
    return StartJobArgs(
        job=job,
        attempt=attempt,
        command=["train.py"],
        nproc_per_node=1,
        nnodes=1,
        rdzv_endpoint="127.0.0.1:29500",
        rdzv_id=f"{job}-{attempt}",
        python=launcher,
    )


def launcher_pid(runner: JobRunner, job: str = "llm") -> int:
    def check() -> int | None:
        runner.poll()
        for p in runner.processes():
            if p.job == job and "launcher up pid=" in p.output_tail:
                return int(p.output_tail.rsplit("launcher up pid=", 1)[1].split()[0])
        return None

    return wait_for(check, timeout_s=30, what="the stand-in launcher to run")


def exits(runner: JobRunner, seen: list[JobEvent], count: int = 1) -> list[JobEvent]:
    def check() -> list[JobEvent] | None:
        seen.extend(e for e in runner.poll() if e.kind == EventKind.JOB_EXIT)
        return list(seen) if len(seen) >= count else None

    return wait_for(check, timeout_s=30, what=f"{count} job_exit event(s)")


# --- systemd ---------------------------------------------------------------------------------


def test_systemd_run_argv_is_an_argument_list_with_the_job_unit_properties() -> None:
    s = spec("/usr/bin/python3", attempt=4)
    unit = job_unit_name(s, launch_id="0123456789abcdef")
    assert unit == "trainguard-job-llm-4-01234567.service"
    props = job_unit_properties(log_path="/var/lib/trainguard/jobs/llm-4.log", stop_timeout_s=9.5)
    argv = systemd_run_argv(
        unit=unit, description="trainguard job llm attempt 4", properties=props,
        command=["/opt/tg/bin/python", "-I", "-m", "trainguard.agent.jobwrap", "--", "x y"],
    )  # fmt: skip
    assert argv[0] == "systemd-run" and "--collect" in argv and "--service-type=exec" in argv
    assert f"--unit={unit}" in argv
    assert argv[argv.index("--") + 1 :] == [
        "/opt/tg/bin/python", "-I", "-m", "trainguard.agent.jobwrap", "--", "x y",
    ]  # fmt: skip
    given = [argv[i + 1] for i, a in enumerate(argv) if a == "-p"]
    assert given == props
    for needed in (
        "KillMode=control-group", "LimitMEMLOCK=infinity", "TimeoutStopSec=10",
        "StandardOutput=append:/var/lib/trainguard/jobs/llm-4.log",
        "StandardError=append:/var/lib/trainguard/jobs/llm-4.log",
    ):  # fmt: skip
        assert needed in props
    assert not any(p.startswith("DevicePolicy=") for p in props)  # GPUs, /dev/infiniband/*


def test_systemd_is_detected_by_its_run_directory(tmp_path: Path) -> None:
    assert systemd_is_pid1(run_dir=str(tmp_path / "nope")) is False
    (tmp_path / "system").mkdir()
    assert systemd_is_pid1(run_dir=str(tmp_path / "system")) is True


# --- outside the agent -----------------------------------------------------------------------


def test_a_launch_runs_in_a_session_of_its_own_under_the_wrapper(
    tmp_path: Path, launcher: str
) -> None:
    r = make_runner(tmp_path)
    try:
        r.start(spec(launcher))
        child = launcher_pid(r)
        (proc,) = r.processes()
        wrapper = proc.pid or 0
        assert os.getsid(wrapper) == wrapper != os.getsid(0)
        assert os.getpgid(child) == wrapper
        with open(f"/proc/{wrapper}/cmdline", "rb") as f:
            assert b"trainguard.agent.jobwrap" in f.read()
        (rec,) = load_records(r.state_dir)
        assert (rec.job, rec.attempt, rec.pid, rec.pgid) == ("llm", 1, wrapper, wrapper)
        assert rec.unit is None and rec.spec["python"] == launcher
        assert r.launch_processes("llm") >= {wrapper, child}
    finally:
        r.close(grace_s=1)
    assert load_records(r.state_dir) == []


# --- re-adoption -----------------------------------------------------------------------------


def test_a_new_runner_adopts_a_running_launch_and_stops_every_process_of_it(
    tmp_path: Path, launcher: str
) -> None:
    first = make_runner(tmp_path)
    first.start(spec(launcher))
    child = launcher_pid(first)
    (before,) = first.processes()
    assert first.detach() == ["llm"]
    second = make_runner(tmp_path)
    try:
        assert second.adopt() == ["llm"]
        (after,) = second.processes()
        assert (after.job, after.attempt, after.state) == ("llm", 1, "running")
        assert after.pid == before.pid
        assert "launcher up" in after.output_tail  # the tail, from the log file
        assert second.poll() == []  # nothing ended
        assert second.stop("llm", grace_s=5) is True
        seen: list[JobEvent] = []
        (ev,) = exits(second, seen)
        assert ev.exit_code == 0 and ev.data["stopped"] is True and ev.data["adopted"] is True
        wait_for(
            lambda: not any(alive(pid) for pid in (before.pid or 0, child)),
            timeout_s=10,
            what="every process gone",
        )
        assert second.poll() == []  # once
    finally:
        second.close(grace_s=1)
        first.close(grace_s=1)


def test_a_launch_that_ended_while_no_agent_watched_is_reported_once_with_its_code(
    tmp_path: Path, launcher: str
) -> None:
    first = make_runner(tmp_path)
    first.start(spec(launcher))
    child = launcher_pid(first)
    (proc,) = first.processes()
    first.detach()
    os.kill(child, signal.SIGKILL)  # the launcher dies while no agent runs
    wait_for(lambda: not alive(proc.pid or 0), timeout_s=30, what="the wrapper to end")
    second = make_runner(tmp_path)
    try:
        assert second.adopt() == []
        (ev,) = second.poll()
        assert ev.exit_code == -signal.SIGKILL and ev.data["stopped"] is False
        assert "launcher up" in ev.data["output_tail"]
        assert second.poll() == []
        assert load_records(second.state_dir) == []
        third = make_runner(tmp_path)  # and not again by the next agent
        assert third.adopt() == [] and third.poll() == []
    finally:
        second.close(grace_s=1)
        first.close(grace_s=1)


def test_a_pid_reused_by_another_process_is_not_adopted_nor_signalled(
    tmp_path: Path, launcher: str
) -> None:
    first = make_runner(tmp_path)
    first.start(spec(launcher))
    launcher_pid(first)
    first.close(grace_s=1)  # the launch ends; its record is gone
    assert load_records(first.state_dir) == []
    # a record naming a live process of someone else (as after a pid wrap-around): same
    # pid, but another start time
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        records = first.state_dir
        rec = {
            "job": "llm", "attempt": 1, "launch_id": "f" * 32, "pid": other.pid,
            "start_ticks": 1, "pgid": other.pid, "log_path": str(tmp_path / "work" / "llm-1.log"),
            "log_offset": 0, "status_path": str(records / "missing.status"), "started_at": 1.0,
            "unit": None, "spec": dataclasses.asdict(spec(launcher)), "v": 1,
        }  # fmt: skip
        (records / f"llm-1-{'f' * 32}.launch.json").write_text(json.dumps(rec))
        second = make_runner(tmp_path)
        assert second.adopt() == []
        (ev,) = second.poll()
        # its real exit is unknown: reported as killed, never as a clean exit
        assert ev.exit_code == -signal.SIGKILL and ev.data["exit_status_known"] is False
        assert other.poll() is None and alive(other.pid)  # never signalled
        assert second.processes()[0].state == "exited"
    finally:
        other.kill()
        other.wait()


def test_a_corrupt_record_does_not_stop_the_others_from_being_adopted(
    tmp_path: Path, launcher: str
) -> None:
    first = make_runner(tmp_path)
    first.start(spec(launcher))
    launcher_pid(first)
    first.detach()
    (first.state_dir / "llm-0-bad.launch.json").write_text("{not json")
    second = make_runner(tmp_path)
    try:
        assert second.adopt() == ["llm"]
    finally:
        second.close(grace_s=1)
        first.close(grace_s=1)


# --- stale attempts --------------------------------------------------------------------------


def test_stop_stale_stops_an_older_attempt_only(tmp_path: Path, launcher: str) -> None:
    clock = FakeClock()
    r = make_runner(tmp_path, clock=clock, replace_grace_s=7.0)
    try:
        r.start(spec(launcher, attempt=2))
        launcher_pid(r)
        assert r.stop_stale("llm", current_attempt=2) is False  # current: left alone
        assert r.stop_stale("other", current_attempt=9) is False  # not here
        assert r.processes()[0].state == "running"
        assert r.stop_stale("llm", current_attempt=3) is True
        assert r.stop_stale("llm", current_attempt=3) is False  # already stopping
        seen: list[JobEvent] = []
        (ev,) = exits(r, seen)
        assert ev.attempt == 2 and ev.data["stopped"] is True
        assert ev.data["stop_reason"] == "stale_attempt_current_3"
    finally:
        r.close(grace_s=1)


def test_a_rejoined_launch_is_the_new_attempts_for_fencing_and_readoption(
    tmp_path: Path, launcher: str
) -> None:
    r = make_runner(tmp_path)
    try:
        r.start(spec(launcher, attempt=2))
        launcher_pid(r)
        assert r.retag("llm", attempt=3) is True
        assert r.retag("llm", attempt=3) is False  # already
        assert r.processes()[0].attempt == 3
        assert r.stop_stale("llm", current_attempt=3) is False  # the rejoined ranks live on
        r.detach()
        again = make_runner(tmp_path)
        try:
            assert again.adopt() == ["llm"]
            assert again.processes()[0].attempt == 3
        finally:
            again.close(grace_s=1)
    finally:
        r.close(grace_s=1)


def test_a_newer_attempt_waits_for_the_older_one_to_stop_and_a_stop_cancels_it(
    tmp_path: Path, launcher: str
) -> None:
    r = make_runner(tmp_path)
    try:
        r.start(spec(launcher, attempt=1))
        launcher_pid(r)
        assert r.start(spec(launcher, attempt=2)) == 1
        (proc,) = r.processes()
        assert (proc.attempt, proc.state) == (1, "stopping")
        seen: list[JobEvent] = []
        exits(r, seen)
        wait_for(
            lambda: r.poll() == [] and r.processes()[0].attempt == 2,
            timeout_s=30,
            what="attempt 2 to start",
        )
        assert r.processes()[0].state == "running"
        # a newer start, then a stop: the waiting start is cancelled, nothing more runs
        assert r.start(spec(launcher, attempt=3)) == 2
        assert r.stop("llm", grace_s=5) is True
        exits(r, seen, count=2)
        assert r.poll() == []
        assert [p.attempt for p in r.processes()] == [2]
        assert load_records(r.state_dir) == []
    finally:
        r.close(grace_s=1)
