"""The node's job policy (agent.jobpolicy): who a job runs as, and each refusal of a
start_job (root without jobs.run_as_user, denied env, interpreter or program off the
allow-list, relative cwd, too many processes) as a failed command result naming why."""

from __future__ import annotations

import logging
import os
import pwd
import sys
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.commands import CommandExecutor
from trainguard.agent.config import (
    DEFAULT_ENV_DENY,
    AgentConfig,
    HardwareConfig,
    HeartbeatConfig,
    JobsConfig,
)
from trainguard.agent.daemon import Agent
from trainguard.agent.jobpolicy import (
    JobPolicy,
    JobRefused,
    JobUser,
    PolicyError,
    current_user,
    policy_from_config,
    prepare_access,
    prepare_control_dir,
    resolve_user,
)
from trainguard.agent.jobs import JobRunner, build_env, job_handlers
from trainguard.clock import FakeClock
from trainguard.command_args import StartJobArgs
from trainguard.protocol import Command
from trainguard.strict import ConfigError, build

ME = current_user()


def policy(**kwargs: Any) -> JobPolicy:
    fields: dict[str, Any] = {"user": ME, "env_deny": DEFAULT_ENV_DENY, "max_nproc_per_node": 8}
    fields.update(kwargs)
    return JobPolicy(**fields)


def check(p: JobPolicy, **kwargs: Any) -> JobUser:
    fields: dict[str, Any] = {
        "env": {},
        "nproc_per_node": 1,
        "python": None,
        "program": "/opt/train/train.py",
        "cwd": None,
    }
    fields.update(kwargs)
    return p.check(**fields)


def start_args(**kwargs: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "job": "llm",
        "attempt": 0,
        "command": ["train.py"],
        "nproc_per_node": 1,
        "nnodes": 1,
        "rdzv_endpoint": "127.0.0.1:29500",
        "rdzv_id": "llm-0",
    }
    args.update(kwargs)
    return args


# --- who a job runs as -----------------------------------------------------------------------


def test_root_agent_without_run_as_user_refuses_every_job_naming_the_settings() -> None:
    user, refusal = resolve_user(run_as_user="", allow_as_root=False, socket_gid=None, euid=0)
    assert user is None
    assert "jobs.run_as_user" in refusal and "jobs.allow_jobs_as_root" in refusal
    with pytest.raises(JobRefused, match=r"jobs\.run_as_user"):
        check(JobPolicy(user=None, refusal=refusal))
    # jobs are off (a Slurm node's agent never launches any): nothing to warn about at start,
    # the start line says so and a start_job's refusal names the settings
    assert JobPolicy(user=None, refusal=refusal).startup_warnings() == []
    assert JobPolicy(user=None, refusal=refusal).summary() == "off"


def test_root_agent_with_allow_jobs_as_root_runs_jobs_as_itself_and_says_so() -> None:
    user, refusal = resolve_user(run_as_user="", allow_as_root=True, socket_gid=None, euid=0)
    assert user is not None and refusal == ""
    assert user.switch is False and user.popen_kwargs() == {}
    p = JobPolicy(user=JobUser(name="root", uid=0, gid=0, groups=(), home="/root", switch=False))
    assert any("event=jobs_run_as_root" in w for w in p.startup_warnings())


def test_root_agent_runs_jobs_as_run_as_user_with_its_groups_and_the_socket_group() -> None:
    nobody = pwd.getpwnam("nobody")
    for name in ("nobody", str(nobody.pw_uid)):
        user, _ = resolve_user(run_as_user=name, allow_as_root=False, socket_gid=4242, euid=0)
        assert user is not None and user.switch
        assert (user.name, user.uid, user.gid) == ("nobody", nobody.pw_uid, nobody.pw_gid)
        assert 4242 in user.groups
        assert set(os.getgrouplist("nobody", nobody.pw_gid)) <= set(user.groups)
        assert user.popen_kwargs() == {
            "user": nobody.pw_uid,
            "group": nobody.pw_gid,
            "extra_groups": list(user.groups),
        }
        assert user.env() == {"HOME": nobody.pw_dir, "USER": "nobody", "LOGNAME": "nobody"}


def test_root_group_of_an_unset_socket_group_is_never_handed_to_the_job() -> None:
    user, _ = resolve_user(run_as_user="nobody", allow_as_root=False, socket_gid=0, euid=0)
    assert user is not None and 0 not in user.groups


@pytest.mark.parametrize(
    ("run_as_user", "allow", "euid", "expect"),
    [
        ("no-such-user-tg", False, 0, "jobs.run_as_user: no such user 'no-such-user-tg'"),
        ("root", False, 0, r"is root \(uid 0\).*jobs.allow_jobs_as_root"),
        ("nobody", False, 12345, "cannot start jobs as another user"),
    ],
    ids=["unknown-user", "root-without-allow", "non-root-agent-other-user"],
)
def test_settings_this_machine_cannot_honour_are_startup_errors(
    run_as_user: str, allow: bool, euid: int, expect: str
) -> None:
    with pytest.raises(PolicyError, match=expect):
        resolve_user(run_as_user=run_as_user, allow_as_root=allow, socket_gid=None, euid=euid)


def test_non_root_agent_runs_jobs_as_itself() -> None:
    euid = os.geteuid()
    for name in ("", ME.name):
        if euid == 0 and name:
            continue  # as root, naming root is the root case above
        user, refusal = resolve_user(run_as_user=name, allow_as_root=False, socket_gid=None)
        if euid == 0:
            assert user is None and refusal
        else:
            assert user is not None and user.uid == euid and not user.switch


# --- what a job may run ----------------------------------------------------------------------


@pytest.mark.parametrize("name", [*DEFAULT_ENV_DENY, "DYLD_INSERT_LIBRARIES"])
def test_env_naming_a_denied_variable_is_refused_with_the_variable_named(name: str) -> None:
    p = policy(env_deny=(*DEFAULT_ENV_DENY, "DYLD_*"))
    with pytest.raises(JobRefused, match=f"env {name}: denied by jobs.env_deny"):
        check(p, env={"OMP_NUM_THREADS": "4", name: "/tmp/x"})


def test_every_denied_variable_of_a_job_is_named_and_harmless_ones_pass() -> None:
    with pytest.raises(JobRefused, match="env LD_PRELOAD, PYTHONPATH: denied"):
        check(policy(), env={"PYTHONPATH": "/x", "LD_PRELOAD": "/y", "NCCL_DEBUG": "INFO"})
    # the controller's rollback variable and other TRAINGUARD_* variables pass
    env = {"TRAINGUARD_RESUME_SKIP_BATCHES": "3", "TRAINGUARD_CHAOS": "x", "NCCL_DEBUG": "INFO"}
    assert check(policy(), env=env) == ME


def test_the_default_deny_list_is_the_documented_one() -> None:
    assert JobsConfig().env_deny == [
        "LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONPATH", "PYTHONHOME",
        "PYTHONSTARTUP", "PYTHONINSPECT", "PYTHONUSERBASE", "BASH_ENV", "ENV", "PERL5OPT",
        "NODE_OPTIONS",
    ]  # fmt: skip


def test_variables_the_agent_sets_are_refused_before_any_policy() -> None:
    with pytest.raises(ValueError, match=r"env\.TRAINGUARD_JOB"):
        StartJobArgs(**start_args(env={"TRAINGUARD_JOB": "other"}))


def test_more_processes_than_max_nproc_per_node_is_refused() -> None:
    assert check(policy(max_nproc_per_node=8), nproc_per_node=8) == ME
    with pytest.raises(JobRefused, match=r"nproc_per_node=9 exceeds jobs\.max_nproc_per_node=8"):
        check(policy(max_nproc_per_node=8), nproc_per_node=9)


def test_relative_cwd_or_python_is_refused() -> None:
    with pytest.raises(JobRefused, match="cwd must be an absolute path, got 'work'"):
        check(policy(), cwd="work")
    with pytest.raises(JobRefused, match="python must be an absolute path, got 'python3'"):
        check(policy(), python="python3")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """allowed/{train.py, venv/bin/python -> the agent's interpreter, escape.py -> outside},
    outside/evil.py"""
    (tmp_path / "allowed" / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "allowed" / "train.py").write_text("")
    (tmp_path / "outside" / "evil.py").write_text("")
    (tmp_path / "allowed" / "escape.py").symlink_to(tmp_path / "outside" / "evil.py")
    (tmp_path / "allowed" / "venv" / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    return tmp_path


def test_program_under_an_allowed_path_runs_and_one_outside_is_refused(tree: Path) -> None:
    p = policy(allowed_paths=(str(tree / "allowed"),))
    assert check(p, program=str(tree / "allowed" / "train.py")) == ME
    assert check(p, program="train.py", cwd=str(tree / "allowed")) == ME  # against cwd
    with pytest.raises(JobRefused, match=r"program '.*/outside/evil\.py' is not under"):
        check(p, program=str(tree / "outside" / "evil.py"))
    with pytest.raises(JobRefused, match=r"'\.\./outside/evil.py' \(= .*/outside/evil.py\)"):
        check(p, program="../outside/evil.py", cwd=str(tree / "allowed"))


def test_a_module_job_is_allowed_only_from_a_working_directory_under_the_allowed_paths(
    tree: Path,
) -> None:
    p = policy(allowed_paths=(str(tree / "allowed"),))
    assert check(p, program="-m", module="pkg.train", cwd=str(tree / "allowed")) == ME
    with pytest.raises(
        JobRefused,
        match=r"module 'pkg\.train': its working directory '.*/outside' is not under "
        r"jobs\.allowed_paths \(.*/allowed\); `-m` imports from the working directory first",
    ):
        check(p, program="-m", module="pkg.train", cwd=str(tree / "outside"))
    # a link inside an allowed dir to a directory outside it does not count as inside
    (tree / "allowed" / "away").symlink_to(tree / "outside")
    with pytest.raises(JobRefused, match=r"module 'pkg\.train': its working directory"):
        check(p, program="-m", module="pkg.train", cwd=str(tree / "allowed" / "away"))
    assert check(policy(), program="-m", module="pkg.train", cwd=str(tree / "outside")) == ME


def test_a_symlink_inside_an_allowed_dir_pointing_outside_is_refused(tree: Path) -> None:
    p = policy(allowed_paths=(str(tree / "allowed"),))
    with pytest.raises(JobRefused, match=r"escape.py' \(= .*/outside/evil.py\) is not under"):
        check(p, program=str(tree / "allowed" / "escape.py"))


def test_an_allowed_entry_may_be_one_executable(tree: Path) -> None:
    p = policy(allowed_paths=(str(tree / "allowed" / "train.py"),))
    assert check(p, program=str(tree / "allowed" / "train.py")) == ME
    with pytest.raises(JobRefused, match=r"not under jobs\.allowed_paths"):
        check(p, program=str(tree / "allowed" / "train.py.bak"))


def test_interpreter_must_be_allowed_but_the_agents_own_always_is(tree: Path) -> None:
    p = policy(
        allowed_paths=(str(tree / "allowed"),), agent_python=str(tree / "agent-venv" / "python")
    )
    program = str(tree / "allowed" / "train.py")
    # a venv's python under an allowed dir: a symlink to the base interpreter elsewhere
    assert check(p, python=str(tree / "allowed" / "venv" / "bin" / "python"), program=program)
    with pytest.raises(JobRefused, match=r"python '/usr/bin/env' is not under jobs.allowed_paths"):
        check(p, python="/usr/bin/env", program=program)
    own = policy(allowed_paths=(str(tree / "allowed"),), agent_python=sys.executable)
    assert check(own, python=None, program=program) == ME
    assert check(own, python=sys.executable, program=program) == ME


def test_empty_allow_list_allows_any_program_and_warns_at_start() -> None:
    p = policy()
    assert check(p, program="/anything/at/all.py", python="/usr/bin/env") == ME
    assert any("event=jobs_allowed_paths_empty" in w for w in p.startup_warnings())
    assert not any(
        "allowed_paths_empty" in w for w in policy(allowed_paths=("/opt",)).startup_warnings()
    )


# --- refusals are failed command results, nothing is launched ---------------------------------


@pytest.mark.parametrize(
    ("p", "args", "expect"),
    [
        (JobPolicy(user=None, refusal="set jobs.run_as_user"), {}, "set jobs.run_as_user"),
        (policy(), {"env": {"LD_PRELOAD": "/x.so"}}, "env LD_PRELOAD: denied by jobs.env_deny"),
        (policy(), {"nproc_per_node": 100000}, "exceeds jobs.max_nproc_per_node=8"),
        (policy(), {"cwd": "rel"}, "cwd must be an absolute path"),
        (
            policy(allowed_paths=("/opt/train",)),
            {"command": ["/srv/other/train.py"]},
            "program '/srv/other/train.py' is not under jobs.allowed_paths (/opt/train)",
        ),
    ],
    ids=["root-without-user", "env", "nproc", "cwd", "program"],
)
def test_a_refused_start_job_is_a_failed_result_and_launches_nothing(
    tmp_path: Path, p: JobPolicy, args: dict[str, Any], expect: str
) -> None:
    runner = JobRunner(
        node_name="node-1",
        work_dir=str(tmp_path / "work"),
        heartbeat_socket=str(tmp_path / "hb.sock"),
        policy=p,
        clock=FakeClock(),
    )
    executor = CommandExecutor(job_handlers(runner))
    result = executor.execute(Command(id="c1", kind="start_job", args=start_args(**args)))
    assert result.ok is False
    assert "job 'llm' refused on node node-1: " in result.message
    assert expect in result.message
    assert runner.processes() == ()
    assert not (tmp_path / "work" / "llm-0.log").exists()


def test_a_switched_user_gets_its_login_variables_unless_the_job_sets_them() -> None:
    spec = StartJobArgs(**start_args(env={"USER": "trainer"}))
    env = build_env(
        spec,
        base={"HOME": "/root", "USER": "root", "PATH": "/usr/bin"},
        node_name="n",
        heartbeat_socket="/run/hb.sock",
        control_dir=None,
        launch_id="x",
        user_env={"HOME": "/home/tgjobs", "USER": "tgjobs", "LOGNAME": "tgjobs"},
    )
    assert (env["HOME"], env["USER"], env["LOGNAME"]) == ("/home/tgjobs", "trainer", "tgjobs")
    assert env["PATH"] == "/usr/bin"


# --- configuration and start -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        ({"env_deny": ["LD PRELOAD"]}, r"jobs.env_deny\[0\]: must be a variable name"),
        ({"env_deny": ["*"]}, r"jobs.env_deny\[0\]"),
        ({"allowed_paths": ["opt/train"]}, r"jobs.allowed_paths\[0\]: must be an absolute path"),
        ({"max_nproc_per_node": 0}, r"jobs.max_nproc_per_node: must be in \[1, 1024\]"),
        ({"max_nproc_per_node": 1025}, r"jobs.max_nproc_per_node: must be in \[1, 1024\]"),
        ({"run_as_user": "a b"}, "jobs.run_as_user: must be a user name or uid"),
        ({"allow_jobs_as_root": "yes"}, "jobs.allow_jobs_as_root"),
    ],
    ids=["env-space", "env-star-only", "relative-path", "nproc-0", "nproc-1025", "user", "bool"],
)
def test_bad_policy_settings_fail_at_load(raw: dict[str, Any], expect: str) -> None:
    with pytest.raises(ConfigError, match=expect):
        build(AgentConfig, {"jobs": raw}, source="agent.yaml")


def test_policy_from_config_carries_every_setting() -> None:
    jc = JobsConfig(
        allow_jobs_as_root=True, env_deny=["X_*"], allowed_paths=["/opt"], max_nproc_per_node=3
    )
    p = policy_from_config(jc, socket_gid=None)
    assert p.user is not None
    assert (p.env_deny, p.allowed_paths, p.max_nproc_per_node) == (("X_*",), ("/opt",), 3)


def test_the_control_dir_is_the_agents_and_open_to_every_user_like_tmp(short_tmp: Path) -> None:
    sock = short_tmp / "hb.sock"
    sock.write_text("")
    ctl = prepare_control_dir(heartbeat_socket=sock, control_dir="")
    assert ctl == str(short_tmp / "ctl")
    st = os.lstat(ctl)
    assert (st.st_uid, st.st_mode & 0o7777) == (os.geteuid(), 0o1777)
    # a configured one is used as it is
    assert prepare_control_dir(heartbeat_socket=sock, control_dir="/c") == "/c"


def test_a_control_dir_someone_else_made_is_refused(short_tmp: Path) -> None:
    sock = short_tmp / "hb.sock"
    (short_tmp / "ctl").symlink_to("/tmp")
    with pytest.raises(OSError, match="not a directory of the agent's"):
        prepare_control_dir(heartbeat_socket=sock, control_dir="")


def test_a_switched_user_gets_the_socket_group_only_for_a_closed_socket(short_tmp: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another group needs root")
    sock = short_tmp / "hb.sock"
    sock.write_text("")
    nobody = pwd.getpwnam("nobody")
    user, _ = resolve_user(run_as_user="nobody", allow_as_root=False, socket_gid=None, euid=0)
    assert user is not None
    os.chmod(sock, 0o666)
    prepare_access(user, heartbeat_socket=sock, socket_group_set=False)
    assert sock.stat().st_gid == 0  # every user may send already
    os.chmod(sock, 0o660)
    prepare_access(user, heartbeat_socket=sock, socket_group_set=False)
    assert sock.stat().st_gid == nobody.pw_gid
    # a configured socket group is left as it is
    os.chown(sock, -1, 0)
    prepare_access(user, heartbeat_socket=sock, socket_group_set=True)
    assert sock.stat().st_gid == 0


def test_agent_start_warns_about_root_jobs_and_an_empty_allow_list(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = AgentConfig(
        hardware=HardwareConfig(gpu_backend="sim", sim_gpus=1, sim_ib_ports=1, kmsg_path=""),
        heartbeat=HeartbeatConfig(socket_path=str(short_tmp / "hb.sock")),
        jobs=JobsConfig(work_dir=str(short_tmp / "jobs"), allow_jobs_as_root=True),
    )
    agent = Agent(cfg, clock=FakeClock(), serve_http=False)
    with caplog.at_level(logging.WARNING, logger="trainguard.agent"):
        agent.start()
    agent.close()
    text = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "event=jobs_allowed_paths_empty" in text
    assert ("event=jobs_run_as_root" in text) == (os.geteuid() == 0)


def test_agent_start_with_jobs_off_warns_nothing_and_says_so_once(
    short_tmp: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a root agent without jobs.run_as_user (a Slurm node's): jobs are off, which is no
    # warning; every line the agent logs gets node= from the log format alone
    cfg = AgentConfig(
        hardware=HardwareConfig(gpu_backend="sim", sim_gpus=1, sim_ib_ports=1, kmsg_path=""),
        heartbeat=HeartbeatConfig(socket_path=str(short_tmp / "hb.sock")),
        jobs=JobsConfig(work_dir=str(short_tmp / "jobs")),
    )
    agent = Agent(cfg, clock=FakeClock(), serve_http=False)
    with caplog.at_level(logging.INFO, logger="trainguard"):
        agent.start()
        agent.close()
    records = [r for r in caplog.records if r.name.startswith("trainguard.agent")]
    assert all("node=" not in r.getMessage() for r in records)
    started = [r.getMessage() for r in records if "event=agent_started" in r.getMessage()]
    assert len(started) == 1
    if os.geteuid() == 0:
        assert [r for r in records if r.levelno >= logging.WARNING] == []
        assert " jobs=off " in started[0]
    assert f" control_dir={short_tmp / 'ctl'} " in started[0]
