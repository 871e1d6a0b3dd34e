"""A real agent running as root with `jobs.run_as_user` starts its job as that unprivileged
user (uid, primary group, supplementary groups), the job reaches the heartbeat socket and
binds in the control dir as that user, and a program off the allow-list is refused. A torchrun
job an ordinary user starts by hand, with the agent's defaults, is watched: its heartbeats get
through and a checkpoint request reaches its ranks."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes.controller_service import FakeController
from tests.helpers import free_port, wait_for
from tests.integration.agent_proc import AgentProcess
from trainguard.devkit.devcluster import REPO_ROOT
from trainguard.devkit.slurm import OpenPaths
from trainguard.protocol import Command, Event

pytestmark = pytest.mark.slow

JOB_USER = "tgjobs"

# Stands in for `python -m torch.distributed.run <launcher options> program`: the agent's
# interpreter may live where the job user cannot read it (a root-owned pyenv), and what is
# tested here is the identity the agent gives the launch, not torchrun.
LAUNCHER = """\
#!{python}
import runpy, sys
runpy.run_path(sys.argv[-1], run_name="__main__")
"""

JOB = """\
import json, os, socket
out = {"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
       "home": os.environ.get("HOME")}
hb = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
try:
    hb.sendto(b"{}", os.environ["TRAINGUARD_AGENT_SOCKET"])
    out["heartbeat"] = "sent"
except OSError as e:
    out["heartbeat"] = repr(e)
ctl = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
try:
    ctl.bind(os.path.join(os.environ["TRAINGUARD_CONTROL_DIR"], f"probe-{os.getpid()}.sock"))
    out["control"] = "bound"
except OSError as e:
    out["control"] = repr(e)
with open(os.path.join(os.environ["OUT_DIR"], "ids.json"), "w") as f:
    json.dump(out, f)
"""


def job_user() -> pwd.struct_passwd:
    """The unprivileged user jobs run as, created (system user, no home) when missing."""
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI runs the tests as root: this test needs it to switch users")
        pytest.skip("needs root: the agent switches to an unprivileged user")
    try:
        return pwd.getpwnam(JOB_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", JOB_USER], check=True)
        return pwd.getpwnam(JOB_USER)


def interpreter_for(user: pwd.struct_passwd) -> str:
    """A python the job user may run (the agent's, or the system's)."""
    for candidate in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        if not os.path.isfile(candidate):
            continue
        try:
            probe = subprocess.run(
                [candidate, "-c", "pass"], user=user.pw_uid, group=user.pw_gid, check=False,
                capture_output=True, timeout=30, cwd="/",
            )  # fmt: skip
        except PermissionError:
            continue  # e.g. under a home directory only its owner may enter
        if probe.returncode == 0:
            return candidate
    pytest.fail(f"no python interpreter the user {user.pw_name} may run")


def result_of(controller: FakeController, command_id: str) -> Event | None:
    return next(
        (e for e in controller.events_of("command_result") if e.data["command_id"] == command_id),
        None,
    )


def send(controller: FakeController, command: Command) -> Event:
    controller.queue_command("node-1", command)
    return wait_for(
        lambda: result_of(controller, command.id), timeout_s=30, what=f"result of {command.id}"
    )


def start_job(command_id: str, *, job: str, program: str, launcher: Path, out: Path) -> Command:
    return Command(
        id=command_id,
        kind="start_job",
        args={
            "job": job,
            "attempt": 0,
            "command": [program],
            "python": str(launcher),
            "env": {"OUT_DIR": str(out)},
            "cwd": str(launcher.parent),
            "nproc_per_node": 1,
            "nnodes": 1,
            "rdzv_endpoint": f"127.0.0.1:{free_port()}",
            "rdzv_id": f"{job}-0",
        },
    )


def test_root_agent_runs_the_job_as_run_as_user_and_refuses_a_program_off_the_allow_list(
    short_tmp: Path, fake_controller: FakeController
) -> None:
    user = job_user()
    short_tmp.chmod(0o755)  # the job user reaches the heartbeat socket and its files here
    code = short_tmp / "code"
    code.mkdir(mode=0o755)
    launcher = code / "launcher"
    launcher.write_text(LAUNCHER.format(python=interpreter_for(user)))
    launcher.chmod(0o755)
    (code / "job.py").write_text(JOB)
    (code / "job.py").chmod(0o644)
    out = short_tmp / "out"
    out.mkdir(mode=0o700)  # only the job user may write here
    os.chown(out, user.pw_uid, user.pw_gid)
    token = short_tmp / "token"
    token.write_text(fake_controller.agent_token)
    token.chmod(0o600)
    config = short_tmp / "agent.yaml"
    config.write_text(f"jobs:\n  run_as_user: {JOB_USER}\n  allowed_paths: [{code}]\n")
    agent = AgentProcess(
        short_tmp, "--config", str(config), "--controller", fake_controller.url,
        "--token-file", str(token), "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
    )  # fmt: skip
    try:
        started = send(
            fake_controller,
            start_job("start-1", job="ids", program="job.py", launcher=launcher, out=out),
        )
        assert started.data["ok"] is True, started.data["message"]
        exited = wait_for(
            lambda: next(
                (e for e in fake_controller.events_of("job_exit") if e.job == "ids"), None
            ),
            timeout_s=60,
            what="the job's exit",
        )
        assert exited.code == 0, f"{exited.message}\n{exited.data.get('output_tail')}"
        ids = json.loads((out / "ids.json").read_text())
        groups = set(os.getgrouplist(user.pw_name, user.pw_gid))
        assert (ids["uid"], ids["gid"]) == (user.pw_uid, user.pw_gid), ids
        assert groups <= set(ids["groups"]) and 0 not in ids["groups"], ids
        assert ids["home"] == user.pw_dir
        assert (ids["heartbeat"], ids["control"]) == ("sent", "bound"), ids
        assert f"user={JOB_USER} uid={user.pw_uid}" in agent.log()

        outside = short_tmp / "outside.py"
        outside.write_text(JOB)
        refused = send(
            fake_controller,
            start_job("start-2", job="off", program=str(outside), launcher=launcher, out=out),
        )
        assert refused.data["ok"] is False
        assert "is not under jobs.allowed_paths" in refused.data["message"], refused.data
    finally:
        assert agent.terminate() == 0, agent.log()


# A rank of a hand-started torchrun job: the trainer library's channel, as Trainguard opens it
# (the job name is torchrun's run id), heartbeats every 0.1 s until a Control arrives.
RANK = """\
import json, os, time
from trainguard.protocol import Heartbeat
from trainguard.trainer.channel import (
    AgentChannel, agent_socket_path, control_socket_path, job_name)
job, rank, sock = job_name(), int(os.environ["RANK"]), agent_socket_path()
ch = AgentChannel(agent_socket=sock, control_socket=control_socket_path(
    job=job, rank=rank, pid=os.getpid(), agent_socket=sock))
got, step, deadline = None, 0, time.monotonic() + 60
while got is None and time.monotonic() < deadline:
    step += 1
    ch.send(Heartbeat(job=job, rank=rank, step=step, t=time.time(), pid=os.getpid(),
                      control_socket=ch.control_socket))
    got = next(iter(ch.poll()), None)
    time.sleep(0.1)
with open(os.path.join(os.environ["OUT_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"job": job, "uid": os.getuid(), "control_socket": ch.control_socket,
               "control": got and got.action, "sent": ch.sent}, f)
ch.close()
"""


def test_a_hand_started_torchrun_job_of_an_ordinary_user_is_watched(
    short_tmp: Path, fake_controller: FakeController
) -> None:
    user = job_user()
    short_tmp.chmod(0o755)
    code = short_tmp / "code"
    code.mkdir(mode=0o755)
    (code / "rank.py").write_text(RANK)
    (code / "rank.py").chmod(0o644)
    out = short_tmp / "out"
    out.mkdir(mode=0o700)
    os.chown(out, user.pw_uid, user.pw_gid)
    token = short_tmp / "token"
    token.write_text(fake_controller.agent_token)
    token.chmod(0o600)
    # the agent's defaults: an open heartbeat socket, ctl/ (1777) beside it
    agent = AgentProcess(
        short_tmp, "--controller", fake_controller.url, "--token-file", str(token),
        "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
    )  # fmt: skip
    paths = OpenPaths()  # the user runs this checkout's interpreter (it may sit under /root)
    paths.open(Path(sys.executable), REPO_ROOT)
    torchrun = None
    try:
        torchrun = subprocess.Popen(
            [
                "runuser", "-u", user.pw_name, "--", sys.executable, "-m",
                "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                str(code / "rank.py"),
            ],
            cwd=str(code),
            env={**os.environ, "TRAINGUARD_AGENT_SOCKET": str(agent.socket_path),
                 "OUT_DIR": str(out)},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip

        def both_ranks() -> str | None:
            report = fake_controller.reports[-1] if fake_controller.reports else None
            jobs = {r.job for r in report.ranks if r.step > 0} if report else set()
            ranks = [r for r in (report.ranks if report else ()) if r.job in jobs]
            return next(iter(jobs)) if len(jobs) == 1 and len(ranks) == 2 else None

        job = wait_for(both_ranks, timeout_s=60, what="both ranks' heartbeats in a report")
        done = send(fake_controller, Command(id="ckpt-1", kind="checkpoint", args={"job": job}))
        assert done.data["ok"] is True, done.data
        assert torchrun.wait(timeout=60) == 0, torchrun.stderr.read() if torchrun.stderr else ""
        for rank in (0, 1):
            seen = json.loads((out / f"rank{rank}.json").read_text())
            assert (seen["job"], seen["uid"], seen["control"]) == (job, user.pw_uid, "checkpoint")
            own = short_tmp / "ctl" / f"u{user.pw_uid}"
            assert Path(seen["control_socket"]).parent == own, seen
        assert "event=heartbeat_sender_refused" not in agent.log()
        assert "event=agent_socket_denied" not in agent.log()
    finally:
        if torchrun is not None and torchrun.poll() is None:
            torchrun.kill()
            torchrun.wait(timeout=10)
        paths.restore()
        assert agent.terminate() == 0, agent.log()
