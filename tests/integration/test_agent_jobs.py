"""The torchrun job backend with real torchrun: rendezvous of two "nodes" on one host,
exit reporting, stop with SIGKILL escalation, and no processes left behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.helpers import alive, free_port, wait_for
from trainguard.agent.jobpolicy import JobPolicy
from trainguard.agent.jobs import JobError, JobEvent, JobRunner
from trainguard.clock import FakeClock
from trainguard.command_args import StartJobArgs
from trainguard.protocol import EventKind

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "jobs"


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def make_runner(tmp_path: Path, node: str, **kwargs: object) -> JobRunner:
    return JobRunner(
        node_name=node,
        work_dir=str(tmp_path / node),
        heartbeat_socket=str(tmp_path / "hb.sock"),
        control_dir=str(tmp_path / "control"),
        policy=JobPolicy.unrestricted(),
        **kwargs,  # type: ignore[arg-type]
    )


def spec(job: str, command: list[str], *, nnodes: int = 1, **kwargs: object) -> StartJobArgs:
    fields: dict[str, object] = {
        "job": job,
        "attempt": 1,
        "command": command,
        "nproc_per_node": 1,
        "nnodes": nnodes,
        "rdzv_endpoint": f"127.0.0.1:{free_port()}",
        "rdzv_id": f"{job}-1",
        # a rendezvous that cannot complete fails the test quickly instead of in 600 s
        "rdzv_conf": {"join_timeout": "45"},
    }
    fields.update(kwargs)
    return StartJobArgs(**fields)  # type: ignore[arg-type]


def wait_exit(runner: JobRunner, job: str, *, timeout_s: float = 60.0) -> JobEvent:
    events: list[JobEvent] = []

    def check() -> JobEvent | None:
        events.extend(runner.poll())
        return next((e for e in events if e.job == job and e.kind == EventKind.JOB_EXIT), None)

    return wait_for(check, timeout_s=timeout_s, what=f"job_exit of {job}")


def tail_of(runner: JobRunner, job: str) -> str:
    return next((p.output_tail for p in runner.processes() if p.job == job), "")


def ready_pid(runner: JobRunner, job: str) -> int:
    def check() -> int | None:
        for line in tail_of(runner, job).splitlines():
            if line.startswith("ready pid="):
                return int(line.split("=", 1)[1])
        runner.poll()
        return None

    return wait_for(check, timeout_s=60, what=f"{job} worker ready")


def test_two_nodes_on_one_host_rendezvous_and_all_reduce(tmp_path: Path) -> None:
    script = str(FIXTURES / "allreduce.py")
    base = spec("ar", [script], nnodes=2)
    host_spec = StartJobArgs(**{**base.__dict__, "node_rank": 0})
    client_spec = StartJobArgs(**{**base.__dict__, "node_rank": 1})
    host = make_runner(tmp_path, "node-a")
    client = make_runner(tmp_path, "node-b")
    try:
        # the client starts first: it must wait for the host's store, not serve one itself
        client.start(client_spec)
        host.start(host_spec)
        exits = {"node-a": wait_exit(host, "ar"), "node-b": wait_exit(client, "ar")}
    finally:
        host.close(grace_s=1)
        client.close(grace_s=1)
    for node, event in exits.items():
        assert event.exit_code == 0, f"{node}: {event.message}\n{event.data['output_tail']}"
        tail = str(event.data["output_tail"])
        assert "world_size=2 sum=1" in tail, tail
        assert f"job=ar node={node}" in tail, tail
        log_text = (tmp_path / node / "ar-1.log").read_text()
        assert "world_size=2" in log_text


def test_a_module_command_runs_as_python_m(tmp_path: Path) -> None:
    # ["-m", "allreduce"] from the fixtures' directory: torchrun's --module form, 2 ranks
    runner = make_runner(tmp_path, "node-a")
    job = spec("mod", ["-m", "allreduce"], nproc_per_node=2, cwd=str(FIXTURES))
    try:
        runner.start(job)
        event = wait_exit(runner, "mod")
    finally:
        runner.close(grace_s=1)
    tail = str(event.data["output_tail"])
    assert event.exit_code == 0, f"{event.message}\n{tail}"
    assert "world_size=2 sum=1 job=mod node=node-a" in tail, tail


def test_failing_job_is_reaped_with_exit_code_tail_and_full_log(tmp_path: Path) -> None:
    runner = make_runner(tmp_path, "node-a", output_tail_lines=5)
    job = spec("fail", [str(FIXTURES / "exit_with.py"), "100", "7"], env={"EXTRA": "x y"})
    try:
        runner.start(job)
        with pytest.raises(JobError, match="already running"):
            runner.start(job)
        event = wait_exit(runner, "fail")
    finally:
        runner.close(grace_s=1)
    # torchrun reports a failed worker with its own exit code 1
    assert event.exit_code == 1, event.message
    assert event.attempt == 1
    assert event.data["stopped"] is False
    tail = str(event.data["output_tail"])
    assert len(tail.splitlines()) == 5
    log_text = (tmp_path / "node-a" / "fail-1.log").read_text()
    for needle in ("line 0\n", "line 99\n", "env TRAINGUARD_JOB=fail", "env TRAINGUARD_ATTEMPT=1"):
        assert needle in log_text
    assert "env TRAINGUARD_NODE=node-a" in log_text
    assert "env EXTRA=x y" in log_text
    (proc,) = runner.processes()
    assert proc.state == "exited"
    assert proc.exit_code == 1
    assert group_gone(proc.pid or 0)


def test_stop_escalates_to_sigkill_after_grace_and_leaves_no_process(tmp_path: Path) -> None:
    clock = FakeClock()
    runner = make_runner(tmp_path, "node-a", clock=clock)
    job = spec("stubborn", [str(FIXTURES / "sleeper.py"), "--on-sigterm", "ignore"])
    try:
        runner.start(job)
        worker = ready_pid(runner, "stubborn")
        (proc,) = runner.processes()
        pgid = proc.pid or 0
        assert runner.stop("stubborn", grace_s=30.0) is True
        # torchrun waits for its worker, which ignores SIGTERM: nothing ends before the grace
        assert runner.poll() == []
        assert runner.processes()[0].state == "stopping"
        assert alive(worker)
        clock.advance(30.0)
        event = wait_exit(runner, "stubborn")
    finally:
        runner.close(grace_s=1)
    assert event.exit_code == -signal.SIGKILL, event.message
    assert event.data["killed"] is True and event.data["stopped"] is True
    wait_for(lambda: group_gone(pgid), timeout_s=10, what="launcher's process group gone")
    wait_for(lambda: not alive(worker), timeout_s=10, what="worker gone")
    assert runner.stop("stubborn") is False


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat[stat.rfind(b")") + 2 :].split()[1]) == pid:
                out.append(int(entry))
    return out


def test_workers_orphaned_by_a_killed_launcher_are_ended(tmp_path: Path) -> None:
    runner = make_runner(tmp_path, "node-a")
    job = spec("orphan", [str(FIXTURES / "sleeper.py"), "--on-sigterm", "exit"])
    try:
        runner.start(job)
        worker = ready_pid(runner, "orphan")
        (proc,) = runner.processes()
        (torchrun,) = children(proc.pid or 0)  # the launch wrapper's one child
        # as the kernel's OOM killer would: the launcher dies, its worker is orphaned (and
        # re-parented to the wrapper, which ends it and records torchrun's exit)
        os.kill(torchrun, signal.SIGKILL)
        event = wait_exit(runner, "orphan")
        wait_for(lambda: not alive(worker), timeout_s=10, what="orphaned worker gone")
    finally:
        runner.close(grace_s=1)
    assert event.exit_code == -signal.SIGKILL
    assert event.data["stopped"] is False
    assert event.data["leftovers_killed"] == 1


def test_a_killed_launch_wrapper_ends_its_launch_and_reports_it_killed(tmp_path: Path) -> None:
    runner = make_runner(tmp_path, "node-a")
    job = spec("nowrap", [str(FIXTURES / "sleeper.py"), "--on-sigterm", "exit"])
    try:
        runner.start(job)
        worker = ready_pid(runner, "nowrap")
        (proc,) = runner.processes()
        (torchrun,) = children(proc.pid or 0)
        os.kill(proc.pid or 0, signal.SIGKILL)
        event = wait_exit(runner, "nowrap")
        wait_for(
            lambda: not any(alive(pid) for pid in (torchrun, worker)),
            timeout_s=10,
            what="every process gone",
        )
    finally:
        runner.close(grace_s=1)
    assert event.exit_code == -signal.SIGKILL, event.message


def test_stop_lets_a_job_that_honours_sigterm_exit_within_grace(tmp_path: Path) -> None:
    runner = make_runner(tmp_path, "node-a")
    job = spec("polite", [str(FIXTURES / "sleeper.py"), "--on-sigterm", "exit"])
    try:
        runner.start(job)
        worker = ready_pid(runner, "polite")
        (proc,) = runner.processes()
        runner.stop("polite", grace_s=60.0)
        event = wait_exit(runner, "polite")
    finally:
        runner.close(grace_s=1)
    assert event.data["stopped"] is True
    assert event.data["killed"] is False, event.message
    assert "got SIGTERM" in (tmp_path / "node-a" / "polite-1.log").read_text()
    assert not alive(worker)
    wait_for(lambda: group_gone(proc.pid or 0), timeout_s=10, what="launcher's process group gone")
