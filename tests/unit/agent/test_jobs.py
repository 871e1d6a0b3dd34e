"""The job backend's pure parts: argument parsing, torchrun argv, child env, process finding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trainguard.agent.commands import CommandExecutor
from trainguard.agent.jobpolicy import JobPolicy
from trainguard.agent.jobs import (
    JobError,
    JobEvent,
    JobRunner,
    build_env,
    find_launch_processes,
    job_handlers,
    parse_start_job,
    parse_stop_job,
    torchrun_argv,
)
from trainguard.clock import FakeClock
from trainguard.command_args import LAUNCH_ID_ENV
from trainguard.protocol import Command

MINIMAL: dict[str, Any] = {
    "job": "llama-7b",
    "attempt": 2,
    "command": ["examples/train.py", "--steps", "100"],
    "nproc_per_node": 8,
    "nnodes": 3,
    "rdzv_endpoint": "10.0.0.1:29500",
    "rdzv_id": "llama-7b-2",
}


def args(**changes: Any) -> dict[str, Any]:
    out = dict(MINIMAL)
    for key, value in changes.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


DROP = object()


def test_parse_start_job_fills_defaults() -> None:
    spec = parse_start_job(MINIMAL)
    assert spec.command == ["examples/train.py", "--steps", "100"]
    assert spec.env == {}
    assert spec.max_restarts == 0
    assert spec.python is None and spec.cwd is None and spec.ckpt_dir is None
    assert spec.is_host() is None  # no node_rank, several nodes: torch decides


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        pytest.param(
            {"comand": ["x.py"]},
            "args.comand: unknown key (did you mean 'command'?)",
            id="unknown-key",
        ),
        pytest.param({"command": DROP}, "args.command: required key is missing", id="no-command"),
        pytest.param({"command": []}, "args.command: must be a non-empty list", id="empty-command"),
        pytest.param(
            {"command": "train.py --steps 3"},
            "args.command: expected a list",
            id="command-as-string",
        ),
        pytest.param(
            {"command": ["train.py", 3]},
            "args.command[1]: expected a string",
            id="command-item-not-string",
        ),
        pytest.param(
            {"command": ["--standalone", "x.py"]},
            "args.command[0]: must be the training",
            id="command-starts-with-option",
        ),
        pytest.param(
            {"command": ["x.py", "a\0b"]}, "args.command[1]: contains a NUL", id="command-nul"
        ),
        pytest.param(
            {"command": ["-m"]}, "args.command[1]: missing: '-m' must be", id="module-missing"
        ),
        pytest.param(
            {"command": ["-m", "pkg/train.py"]},
            "args.command[1]: must be a dotted Python module name",
            id="module-a-path",
        ),
        pytest.param(
            {"command": ["-m", "pkg..train"]},
            "args.command[1]: must be a dotted Python module name",
            id="module-empty-part",
        ),
        pytest.param(
            {"command": ["--module", "pkg.train"]},
            "args.command[0]: must be the training program's path or '-m'",
            id="long-module-option-refused",
        ),
        pytest.param({"job": "../etc"}, "args.job: must match", id="job-with-path"),
        pytest.param({"job": ""}, "args.job: must match", id="job-empty"),
        pytest.param({"attempt": -1}, "args.attempt: must be >= 0", id="attempt-negative"),
        pytest.param({"attempt": True}, "args.attempt: expected an integer", id="attempt-bool"),
        pytest.param({"nproc_per_node": 0}, "args.nproc_per_node: must be >= 1", id="nproc-zero"),
        pytest.param({"nnodes": 0}, "args.nnodes: must be >= 1", id="nnodes-zero"),
        pytest.param(
            {"max_restarts": -2}, "args.max_restarts: must be >= 0", id="max-restarts-negative"
        ),
        pytest.param(
            {"node_rank": 3}, "args.node_rank: must be in [0, nnodes=3)", id="node-rank-too-big"
        ),
        pytest.param(
            {"rdzv_endpoint": "10.0.0.1"},
            "args.rdzv_endpoint: must be HOST:PORT",
            id="endpoint-without-port",
        ),
        pytest.param({"rdzv_endpoint": "10.0.0.1:0"}, "args.rdzv_endpoint", id="endpoint-port-0"),
        pytest.param({"rdzv_endpoint": "h:70000"}, "args.rdzv_endpoint", id="endpoint-port-big"),
        pytest.param({"rdzv_endpoint": ":29500"}, "args.rdzv_endpoint", id="endpoint-no-host"),
        pytest.param(
            {"rdzv_id": "a b"},
            "args.rdzv_id: must be a non-empty string without",
            id="rdzv-id-space",
        ),
        pytest.param(
            {"env": {"TRAINGUARD_JOB": "other"}},
            "args.env.TRAINGUARD_JOB: is set by",
            id="env-reserved",
        ),
        pytest.param(
            {"env": {"TRAINGUARD_CKPT_DIR": "/x"}}, "(use ckpt_dir)", id="env-ckpt-dir-reserved"
        ),
        pytest.param(
            {"env": {"1BAD": "x"}}, "args.env.1BAD: not a valid environment", id="env-bad-name"
        ),
        pytest.param({"env": {"N": 4}}, "args.env.N: expected a string", id="env-value-not-str"),
        pytest.param({"env": ["A=1"]}, "args.env: expected a mapping", id="env-as-list"),
        pytest.param(
            {"rdzv_conf": {"is_host": "true"}}, "set rdzv_host instead", id="rdzv-conf-is-host"
        ),
        pytest.param(
            {"rdzv_conf": {"join_timeout": "1,x=2"}},
            "args.rdzv_conf.join_timeout",
            id="rdzv-conf-injection",
        ),
        pytest.param(
            {"rdzv_host": "yes"}, "args.rdzv_host: expected true or false", id="rdzv-host-not-bool"
        ),
        pytest.param({"python": ""}, "args.python: must be a non-empty", id="python-empty"),
    ],
)
def test_parse_start_job_rejects_bad_args_naming_the_key(
    changes: dict[str, Any], expected: str
) -> None:
    with pytest.raises(JobError) as err:
        parse_start_job(args(**changes))
    assert str(err.value).startswith("start_job: ")
    assert expected in str(err.value)


def test_parse_start_job_rejects_a_non_mapping() -> None:
    with pytest.raises(JobError, match="expected a mapping"):
        parse_start_job(["job"])  # type: ignore[arg-type]


def test_parse_stop_job_defaults_and_checks_grace() -> None:
    assert parse_stop_job({"job": "j"}).grace_s == 30.0
    assert parse_stop_job({"job": "j", "grace_s": 5}).grace_s == 5.0
    with pytest.raises(JobError, match=r"args.grace_s: must be in \[0, 3600\]"):
        parse_stop_job({"job": "j", "grace_s": -1})
    with pytest.raises(JobError, match=r"args\.force: unknown key"):
        parse_stop_job({"job": "j", "force": True})


TORCHRUN = ["/py", "-m", "torch.distributed.run", "--nnodes", "3", "--nproc-per-node", "8",
            "--rdzv-backend", "c10d"]  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "tail"),
    [
        pytest.param({}, [], id="multi-node-no-rank-torch-decides"),
        pytest.param({"node_rank": 0}, ["--rdzv-conf", "is_host=true"], id="node-rank-0-hosts"),
        pytest.param({"node_rank": 2}, ["--rdzv-conf", "is_host=false"], id="other-rank-client"),
        pytest.param(
            {"node_rank": 2, "rdzv_host": True},
            ["--rdzv-conf", "is_host=true"],
            id="explicit-host-wins",
        ),
        pytest.param({"nnodes": 1}, ["--rdzv-conf", "is_host=true"], id="single-node-hosts"),
        pytest.param(
            {"node_rank": 1, "rdzv_conf": {"join_timeout": "60", "close_timeout": "5"}},
            ["--rdzv-conf", "close_timeout=5,is_host=false,join_timeout=60"],
            id="extra-rdzv-conf-sorted",
        ),
        pytest.param(
            {"local_addr": "10.0.0.7"}, ["--local-addr", "10.0.0.7"], id="explicit-local-addr"
        ),
    ],
)
def test_torchrun_argv(changes: dict[str, Any], tail: list[str]) -> None:
    spec = parse_start_job(args(**changes))
    argv = torchrun_argv(spec, python="/py")
    head = [*TORCHRUN, "--rdzv-endpoint", "10.0.0.1:29500", "--rdzv-id", "llama-7b-2",
            "--max-restarts", "0"]  # fmt: skip
    if "nnodes" in changes:
        head[4] = str(changes["nnodes"])
    assert argv == [*head, *tail, "examples/train.py", "--steps", "100"]


def test_static_rendezvous_fixes_ranks_by_node_rank_and_sets_no_host_flag() -> None:
    spec = parse_start_job(args(node_rank=2, rdzv_backend="static"))
    argv = torchrun_argv(spec, python="/py")
    # torchrun with a short exit barrier (trainer/torchrun.py), the same arguments
    assert argv[:3] == ["/py", "-m", "trainguard.trainer.torchrun"]
    assert argv[argv.index("--rdzv-backend") + 1] == "static"
    assert argv[argv.index("--node-rank") + 1] == "2"
    assert "--rdzv-conf" not in argv  # the node rank decides who serves the store
    assert argv[-3:] == ["examples/train.py", "--steps", "100"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"rdzv_backend": "etcd"}, "rdzv_backend"), ({"rdzv_backend": "static"}, "node_rank")],
    ids=["unknown-backend", "static-without-node-rank"],
)
def test_a_rendezvous_the_agent_cannot_run_is_refused_naming_the_field(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(JobError, match=rf"args\.{field}: "):
        parse_start_job(args(**changes))


def test_a_module_command_runs_as_torchruns_module_form() -> None:
    spec = parse_start_job(args(command=["-m", "torchtitan.train", "--job.config_file", "x.toml"]))
    argv = torchrun_argv(spec, python="/py")
    # every launcher option first, then `--module MODULE` and the module's own arguments
    assert argv[-4:] == ["--module", "torchtitan.train", "--job.config_file", "x.toml"]
    assert argv.count("--module") == 1 and argv.index("--module") > argv.index("--max-restarts")


@pytest.mark.parametrize(
    "endpoint", ["127.0.0.1:29500", "localhost:29500", "[::1]:29500"], ids=["v4", "name", "v6"]
)
def test_loopback_endpoint_advertises_the_loopback_address(endpoint: str) -> None:
    spec = parse_start_job(args(rdzv_endpoint=endpoint, node_rank=1))
    argv = torchrun_argv(spec, python="/py")
    host = endpoint.rpartition(":")[0].strip("[]")
    i = argv.index("--local-addr")
    assert argv[i + 1] == host
    # the training program comes after every launcher option, untouched
    assert argv[-3:] == ["examples/train.py", "--steps", "100"]


def test_child_env_layers_agent_then_job_then_agent_variables() -> None:
    spec = parse_start_job(
        args(
            env={"NCCL_DEBUG": "INFO", "PATH": "/job/bin", "PYTHONUNBUFFERED": "0"},
            ckpt_dir="/ckpt/llama",
        )
    )
    env = build_env(
        spec,
        base={"PATH": "/usr/bin", "HOME": "/root", "TRAINGUARD_CONTROL_DIR": "/stale"},
        node_name="node-12",
        heartbeat_socket="/run/trainguard/heartbeat.sock",
        control_dir="/run/trainguard/control",
        launch_id="abc",
    )
    assert env == {
        "PATH": "/job/bin",
        "HOME": "/root",
        "NCCL_DEBUG": "INFO",
        "PYTHONUNBUFFERED": "0",
        "TRAINGUARD_JOB": "llama-7b",
        "TRAINGUARD_ATTEMPT": "2",
        "TRAINGUARD_NODE": "node-12",
        "TRAINGUARD_AGENT_SOCKET": "/run/trainguard/heartbeat.sock",
        "TRAINGUARD_CONTROL_DIR": "/run/trainguard/control",
        "TRAINGUARD_CKPT_DIR": "/ckpt/llama",
        LAUNCH_ID_ENV: "abc",
    }


def test_child_env_drops_inherited_agent_variables_the_job_does_not_set() -> None:
    env = build_env(
        parse_start_job(MINIMAL),
        base={"TRAINGUARD_CONTROL_DIR": "/stale", "TRAINGUARD_CKPT_DIR": "/stale"},
        node_name="n",
        heartbeat_socket="/s",
        control_dir=None,
        launch_id="x",
    )
    assert "TRAINGUARD_CONTROL_DIR" not in env
    assert "TRAINGUARD_CKPT_DIR" not in env
    assert env["PYTHONUNBUFFERED"] == "1"


def _proc(root: Path, pid: int, *, ppid: int, state: str = "S", env: bytes | None = b"A=1\0",
          comm: str = "python") -> None:  # fmt: skip
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_text(f"{pid} ({comm}) {state} {ppid} {pid} {pid} 0 -1 4194560\n")
    if env is not None:
        (d / "environ").write_bytes(env)


def test_find_launch_processes_follows_descendants_and_the_launch_marker(tmp_path: Path) -> None:
    marker = f"{LAUNCH_ID_ENV}=L1\0".encode()
    _proc(tmp_path, 100, ppid=1, env=b"A=1\0" + marker)  # the launcher
    _proc(tmp_path, 101, ppid=100, env=b"")  # worker that cleared its environment
    _proc(tmp_path, 102, ppid=101, comm="pt_data_worker (1)")  # its child, odd comm
    _proc(tmp_path, 200, ppid=1, env=marker + b"B=2\0")  # orphaned worker: re-parented
    _proc(tmp_path, 201, ppid=1, env=f"{LAUNCH_ID_ENV}=L10\0".encode())  # another launch
    _proc(tmp_path, 202, ppid=1, env=f"X{LAUNCH_ID_ENV}=L1\0".encode())  # not the variable
    _proc(tmp_path, 300, ppid=100, state="Z")  # dead already
    _proc(tmp_path, 301, ppid=1, env=None)  # environ unreadable
    (tmp_path / "self").mkdir()
    (tmp_path / "404").mkdir()  # vanished between listing and reading
    found = find_launch_processes(leader_pid=100, launch_id="L1", proc_root=str(tmp_path))
    assert found == {100, 101, 102, 200}


def test_find_launch_processes_on_a_missing_proc_root_finds_nothing(tmp_path: Path) -> None:
    assert (
        find_launch_processes(leader_pid=1, launch_id="x", proc_root=str(tmp_path / "no")) == set()
    )


def runner(tmp_path: Path) -> JobRunner:
    return JobRunner(
        node_name="node-1",
        work_dir=str(tmp_path / "work"),
        heartbeat_socket=str(tmp_path / "hb.sock"),
        policy=JobPolicy.unrestricted(),
        clock=FakeClock(),
    )


def test_start_with_a_missing_python_names_the_path(tmp_path: Path) -> None:
    r = runner(tmp_path)
    missing = str(tmp_path / "no-such-python")
    with pytest.raises(JobError, match=f"python interpreter not found: '{missing}'"):
        r.start(parse_start_job(args(python=missing)))
    assert r.processes() == ()
    assert r.poll() == []


def test_start_with_a_missing_cwd_names_the_directory(tmp_path: Path) -> None:
    r = runner(tmp_path)
    with pytest.raises(JobError, match="working directory not found: '/no/such/dir'"):
        r.start(parse_start_job(args(cwd="/no/such/dir")))
    assert r.processes() == ()


def test_stop_of_a_job_not_running_here_is_a_harmless_no_op(tmp_path: Path) -> None:
    r = runner(tmp_path)
    assert r.stop("nobody") is False
    with pytest.raises(JobError, match="grace_s must be >= 0"):
        r.stop("nobody", grace_s=-1)
    r.close(grace_s=0)


def test_job_event_becomes_a_protocol_event() -> None:
    event = JobEvent(
        kind="job_exit", job="j", attempt=3, ts=12.5, exit_code=-9, message="killed by SIGKILL",
        data={"output_tail": "boom"},
    )  # fmt: skip
    wire = event.to_event(event_id=41)
    assert (wire.id, wire.kind, wire.ts, wire.job, wire.code) == (41, "job_exit", 12.5, "j", -9)
    assert wire.data == {"attempt": 3, "output_tail": "boom"}
    assert wire.message == "killed by SIGKILL"


def test_command_handlers_answer_bad_args_and_unknown_stops(tmp_path: Path) -> None:
    executor = CommandExecutor(job_handlers(runner(tmp_path)))
    bad = executor.execute(Command(id="c1", kind="start_job", args=args(command=[])))
    assert not bad.ok
    assert "args.command: must be a non-empty list" in bad.message
    stop = executor.execute(Command(id="c2", kind="stop_job", args={"job": "nobody"}))
    assert stop.ok
    assert stop.data == {"job": "nobody", "signalled": False}


def test_importing_the_backend_never_imports_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import agent.jobs; print('ok')"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
