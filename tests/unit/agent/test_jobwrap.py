"""The launch wrapper (real processes): it records its command's exit status (signals
included), ends workers its command left behind, ignores stop signals aimed at it alone,
takes the environment from a file it then removes, and records a command it cannot start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import alive, wait_for
from trainguard.agent.jobwrap import LAUNCH_FAILED_CODE, exit_code_of, wrapper_argv


def run(tmp_path: Path, argv: list[str], **kwargs: object) -> tuple[int, dict[str, object]]:
    status = tmp_path / "status.json"
    cmd = wrapper_argv(python=sys.executable, status_path=str(status), argv=argv, **kwargs)  # type: ignore[arg-type]
    code = subprocess.run(cmd, timeout=60, check=False).returncode
    return code, json.loads(status.read_text())


def test_argv_is_a_list_running_the_module_isolated() -> None:
    argv = wrapper_argv(
        python="/opt/tg/bin/python", status_path="/s", argv=["torchrun", "-x"],
        env_file="/e", cwd="/w", uid=1000, gid=1000, groups=(1000, 27),
    )  # fmt: skip
    assert argv == [
        "/opt/tg/bin/python", "-I", "-m", "trainguard.agent.jobwrap", "--status", "/s",
        "--env-file", "/e", "--cwd", "/w", "--uid", "1000", "--gid", "1000",
        "--groups", "1000,27", "--", "torchrun", "-x",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("script", "code", "wrapper_code"),
    [("raise SystemExit(0)", 0, 0), ("raise SystemExit(7)", 7, 7),
     ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -9, 137)],
    ids=["clean", "failed", "killed"],
)  # fmt: skip
def test_the_exit_status_is_recorded(
    tmp_path: Path, script: str, code: int, wrapper_code: int
) -> None:
    got, status = run(tmp_path, [sys.executable, "-c", script])
    assert got == wrapper_code
    assert status["exit_code"] == code
    assert status["leftovers_killed"] == 0
    assert not list(tmp_path.glob("*.tmp.*"))


def test_exit_code_of_maps_signals_to_negative_codes() -> None:
    assert exit_code_of(7 << 8) == 7
    assert exit_code_of(signal.SIGTERM) == -signal.SIGTERM


def test_workers_left_behind_by_a_killed_command_are_ended(tmp_path: Path) -> None:
    pidfile = tmp_path / "worker.pid"
    # a "launcher" that starts a worker in a session of its own (as torchrun does), then
    # dies of SIGKILL: the orphaned worker is re-parented to the wrapper, which ends it
    script = (
        "import os, signal, subprocess, sys\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
        " start_new_session=True)\n"
        f"open({str(pidfile)!r}, 'w').write(str(w.pid))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    got, status = run(tmp_path, [sys.executable, "-c", script])
    assert status["exit_code"] == -9 and got == 137
    assert status["leftovers_killed"] == 1
    assert not alive(int(pidfile.read_text()))


def test_the_environment_comes_from_the_file_which_is_then_removed(tmp_path: Path) -> None:
    env_file = tmp_path / "env.json"
    env_file.write_text(json.dumps({"ONLY": "this", "PATH": os.environ["PATH"]}))
    out = tmp_path / "env.out"
    script = f"import json, os; open({str(out)!r}, 'w').write(json.dumps(dict(os.environ)))"
    got, _ = run(tmp_path, [sys.executable, "-c", script], env_file=str(env_file))
    assert got == 0
    env = json.loads(out.read_text())
    assert env["ONLY"] == "this" and "HOME" not in env
    assert not env_file.exists()


def test_the_command_runs_in_cwd(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    script = "import os; open('here', 'w').write(os.getcwd())"
    got, _ = run(tmp_path, [sys.executable, "-c", script], cwd=str(work))
    assert got == 0 and (work / "here").read_text() == str(work)


def test_a_command_that_cannot_start_is_recorded_as_code_127(tmp_path: Path) -> None:
    got, status = run(tmp_path, [str(tmp_path / "no-such-program")])
    assert got == LAUNCH_FAILED_CODE and status["exit_code"] == LAUNCH_FAILED_CODE
    assert "No such file" in str(status["error"])


def test_sigterm_to_the_wrapper_alone_is_ignored_and_not_forwarded(tmp_path: Path) -> None:
    status = tmp_path / "status.json"
    ready = tmp_path / "ready"
    script = (
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(15))\n"
        f"pathlib.Path({str(ready)!r}).write_text('x')\n"
        f"while not pathlib.Path({str(tmp_path / 'go')!r}).exists(): time.sleep(0.01)\n"
    )
    proc = subprocess.Popen(
        wrapper_argv(python=sys.executable, status_path=str(status),
                     argv=[sys.executable, "-c", script]),
    )  # fmt: skip
    try:
        wait_for(ready.exists, timeout_s=30, what="the command to start")
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            proc.send_signal(sig)
        (tmp_path / "go").write_text("")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    # the command ended on its own (exit 0), not by a forwarded SIGTERM (exit 15)
    assert json.loads(status.read_text())["exit_code"] == 0
