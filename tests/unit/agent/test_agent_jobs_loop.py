"""The daemon closes the loop on jobs: start/stop through commands (a stand-in launcher in
place of torchrun), Report.jobs, job_exit events, idempotent start, the last report on
shutdown, preemption notices, collect_stacks off the loop thread, the advertised address."""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.fakes.controller_service import FakeController
from tests.fakes.metadata_server import MetadataServer
from tests.helpers import wait_for
from trainguard.agent.config import (
    AgentConfig,
    ControllerConfig,
    HardwareConfig,
    HeartbeatConfig,
    JobsConfig,
    NodeConfig,
    PreemptionConfig,
)
from trainguard.agent.daemon import Agent
from trainguard.agent.metrics import metric_families
from trainguard.clock import SYSTEM_CLOCK, Clock, FakeClock
from trainguard.protocol import Command, Control, Event, Heartbeat, decode_json, encode_json
from trainguard.strict import ConfigError, build

# Stands in for `python -m torch.distributed.run ...`: prints, then waits; exits 0 on SIGTERM.
LAUNCHER = """\
#!{python}
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
print("launcher up", flush=True)
time.sleep(120)
"""


@pytest.fixture
def sockdir(short_tmp: Path) -> Path:
    return short_tmp


@pytest.fixture
def launcher(sockdir: Path) -> str:
    path = sockdir / "fake-python"
    path.write_text(LAUNCHER.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def config(
    sockdir: Path, *, url: str = "", token_text: str = "t0ken", **sections: Any
) -> AgentConfig:
    token = sockdir / "token"
    token.write_text(token_text)
    token.chmod(0o600)
    return AgentConfig(
        node=sections.pop("node", NodeConfig(name="node-3")),
        hardware=HardwareConfig(gpu_backend="sim", sim_gpus=1, sim_ib_ports=1),
        heartbeat=HeartbeatConfig(socket_path=str(sockdir / "hb.sock")),
        # a test agent: as root it would refuse jobs without it (ignored when not root)
        jobs=JobsConfig(work_dir=str(sockdir / "jobs"), stop_grace_s=5.0, allow_jobs_as_root=True),
        controller=ControllerConfig(
            url=url,
            token_file=str(token) if url else "",
            # one report at start, then only the last one on close (unless a test waits)
            report_interval_s=30.0,
            backoff_max_s=30.0,
        ),
        **sections,
    )


def start_job(launcher: str, *, cmd_id: str = "c1", attempt: int = 0) -> Command:
    return Command(
        id=cmd_id,
        kind="start_job",
        args={
            "job": "llm",
            "attempt": attempt,
            "command": ["train.py"],
            "nproc_per_node": 1,
            "nnodes": 1,
            "rdzv_endpoint": "127.0.0.1:29500",
            "rdzv_id": f"llm-{attempt}",
            "python": launcher,
        },
    )


def results(agent: Agent) -> dict[str, Event]:
    return {
        e.data["command_id"]: e for e in agent.spool.pending(1000) if e.kind == "command_result"
    }


def started(cfg: AgentConfig, clock: Clock = SYSTEM_CLOCK) -> Agent:
    agent = Agent(cfg, clock=clock, serve_http=False)
    agent.start()
    return agent


def shutdown(agent: Agent) -> None:
    """Close the agent; the agent leaves its jobs running, a test ends them."""
    if agent.jobs is not None:
        agent.jobs.close(grace_s=1)
    agent.close()


def test_start_job_runs_reports_and_exits_with_a_job_exit_event(
    sockdir: Path, launcher: str
) -> None:
    agent = started(config(sockdir, url="http://127.0.0.1:1"))
    try:
        agent.execute(start_job(launcher))
        assert results(agent)["c1"].data["ok"] is True
        wait_for(
            lambda: "launcher up" in agent.build_report(1, ()).jobs[0].output_tail,
            timeout_s=15,
            what="the launcher's output in Report.jobs",
        )
        (job,) = agent.build_report(1, ()).jobs
        assert (job.job, job.attempt, job.state) == ("llm", 0, "running")
        log_text = (sockdir / "jobs" / "llm-0.log").read_text()
        assert "launcher up" in log_text

        # the same attempt again under another command id: a no-op, not a second launch
        agent.execute(start_job(launcher, cmd_id="c2"))
        again = results(agent)["c2"]
        assert again.data["ok"] is True and again.data["already_running"] is True
        assert [j.pid for j in agent.build_report(2, ()).jobs] == [job.pid]
        # a newer attempt while one runs: the running one is stopped first, then it starts
        agent.execute(start_job(launcher, cmd_id="c3", attempt=1))
        replacing = results(agent)["c3"]
        assert replacing.data["ok"] is True and replacing.data["replaces_attempt"] == 0

        def exit_events() -> list[Event]:
            agent.tick()
            return [e for e in agent.spool.pending(1000) if e.kind == "job_exit"]

        (ev,) = wait_for(exit_events, timeout_s=15, what="the job_exit event of attempt 0")
        assert ev.job == "llm" and ev.code == 0
        assert ev.data["stopped"] is True and ev.data["attempt"] == 0
        assert ev.data["stop_reason"] == "replaced_by_1"
        assert "launcher up" in ev.data["output_tail"]
        (job1,) = agent.build_report(3, ()).jobs
        assert (job1.attempt, job1.state) == (1, "running") and job1.pid != job.pid
        # an older attempt than the one running is refused
        agent.execute(start_job(launcher, cmd_id="c4", attempt=0))
        assert results(agent)["c4"].data["ok"] is False

        agent.execute(Command(id="c5", kind="stop_job", args={"job": "llm", "grace_s": 5}))
        assert results(agent)["c5"].data["signalled"] is True
        wait_for(lambda: len(exit_events()) == 2, timeout_s=15, what="the job_exit of attempt 1")
        assert agent.build_report(4, ()).jobs[0].state == "exited"
        assert agent.snapshot is not None
        assert agent.snapshot.events_total["job_exit"] == 2
        assert list((sockdir / "jobs" / "launches").iterdir()) == []  # records removed
    finally:
        shutdown(agent)


def test_stop_of_the_agent_leaves_the_job_running_and_the_next_agent_adopts_it(
    sockdir: Path, launcher: str, fake_controller: FakeController
) -> None:
    cfg = config(sockdir, url=fake_controller.url, token_text=fake_controller.agent_token)
    agent = started(cfg)
    second: Agent | None = None
    try:
        wait_for(lambda: fake_controller.reports, timeout_s=15, what="the first report")
        agent.execute(start_job(launcher))
        wait_for(
            lambda: "launcher up" in (sockdir / "jobs" / "llm-0.log").read_text(),
            timeout_s=15,
            what="the launcher to run",
        )
        (job,) = agent.build_report(1, ()).jobs
        agent.close()  # leaves the job running
        assert fake_controller.events_of("job_exit") == []
        assert fake_controller.reports[-1].jobs[0].state == "running"

        second = started(cfg)
        instance = second.instance
        wait_for(
            lambda: fake_controller.reports[-1].instance == instance,
            timeout_s=15,
            what="the second agent's first report",
        )
        first_report = next(r for r in fake_controller.reports if r.instance == instance)
        (adopted,) = first_report.jobs
        assert (adopted.job, adopted.attempt, adopted.pid, adopted.state) == (
            "llm", 0, job.pid, "running",
        )  # fmt: skip
        assert "launcher up" in adopted.output_tail
        second.execute(Command(id="c2", kind="stop_job", args={"job": "llm", "grace_s": 5}))

        def exit_events() -> list[Event]:
            assert second is not None
            second.tick()
            return [e for e in second.spool.pending(1000) if e.kind == "job_exit"]

        (ev,) = wait_for(exit_events, timeout_s=15, what="the adopted job's exit")
        # the adopted job is not the new agent's child: its code comes from the wrapper
        assert ev.code == 0 and ev.data["stopped"] is True and ev.data["adopted"] is True
    finally:
        shutdown(agent)
        if second is not None:
            shutdown(second)


def test_last_report_to_a_controller_that_never_answers_gives_up(
    sockdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # a listening socket that accepts and never answers: the last report times out (its
    # bound, 2 s) and close() still completes
    caplog.set_level(logging.INFO, logger="trainguard.agent")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        cfg = config(sockdir, url=url)
        cfg = dataclasses.replace(
            cfg, controller=dataclasses.replace(cfg.controller, timeout_s=0.5)
        )
        agent = started(cfg)
        agent.close()
        assert "event=final_report result=error" in caplog.text
        assert "event=agent_stopped" in caplog.text
    finally:
        silent.close()


class ControlReceiver:
    """A rank's control socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)

    def received(self) -> list[Control]:
        out = []
        while True:
            try:
                out.append(decode_json(Control, self.sock.recv(4096)))
            except BlockingIOError:
                return out

    def close(self) -> None:
        self.sock.close()


def test_preemption_notice_asks_every_rank_once_to_checkpoint_and_stop(sockdir: Path) -> None:
    server = MetadataServer()
    clock = FakeClock()
    rank = ControlReceiver(sockdir / "ctl-r0.sock")
    cfg = config(
        sockdir,
        url="http://127.0.0.1:1",
        preemption=PreemptionConfig(provider="gcp", base_url=server.url, poll_interval_s=60.0),
    )
    agent = started(cfg, clock)
    try:
        assert agent.heartbeat is not None and agent.preemption is not None
        agent.heartbeat.handle_datagram(
            encode_json(Heartbeat(job="llm", rank=0, step=9, t=1.0, control_socket=str(rank.path)))
        )
        agent.preemption.check_once()
        agent.tick()
        assert rank.received() == []
        assert agent.snapshot is not None and not agent.snapshot.preemption_notice

        server.gcp_preempted = "TRUE"
        assert agent.preemption.check_once() is not None or agent.preemption.notice is not None
        agent.tick()
        (ctl,) = rank.received()
        assert ctl.action == "checkpoint_stop" and ctl.job == "llm"
        (ev,) = [e for e in agent.spool.pending(100) if e.kind == "preemption_notice"]
        assert ev.data["provider"] == "gcp" and ev.data["action"] == "preempt"
        assert ev.data["ranks_sent"] == 1 and ev.data["jobs"] == ["llm"]
        assert agent.snapshot.preemption_notice
        gauge = {
            m.name: m.samples[0].value
            for m in metric_families(agent.snapshot)
            if m.name == "trainguard_agent_preemption_notice"
        }
        assert gauge == {"trainguard_agent_preemption_notice": 1.0}

        agent.tick()
        assert rank.received() == []  # once
    finally:
        agent.close()
        rank.close()
        server.close()


def test_collect_stacks_runs_off_the_loop_and_its_result_is_spooled(sockdir: Path) -> None:
    agent = started(config(sockdir, url="http://127.0.0.1:1"), FakeClock())
    try:
        agent.execute(Command(id="s1", kind="collect_stacks", args={"job": "nope"}))
        ev = wait_for(
            lambda: results(agent).get("s1"), timeout_s=15, what="the collect_stacks result"
        )
        assert ev.data["ok"] is False and "not running under this agent" in ev.data["message"]
        agent.tick()
        assert agent.snapshot is not None
        assert agent.snapshot.commands_total == {("collect_stacks", "failed"): 1}
    finally:
        agent.close()


def test_advertise_address_is_sent_as_the_address_label(sockdir: Path) -> None:
    node = NodeConfig(name="node-3", labels={"rack": "r1"}, advertise_address="10.1.2.3")
    agent = started(config(sockdir, node=node), FakeClock())
    try:
        assert agent.build_report(1, ()).labels == {"rack": "r1", "address": "10.1.2.3"}
    finally:
        agent.close()


@pytest.mark.parametrize(
    ("section", "raw", "expect"),
    [
        ("node", {"advertise_address": "10.0.0.1", "labels": {"address": "x"}}, "labels.address"),
        ("node", {"advertise_address": "a b"}, "advertise_address: must be an IP"),
        ("jobs", {"control_dir": "/" + "d" * 40}, "jobs.control_dir: too long"),
        ("jobs", {"stop_grace_s": -1}, "jobs.stop_grace_s"),
        ("preemption", {"provider": "azure"}, "preemption.provider"),
        ("preemption", {"base_url": "169.254.169.254"}, "preemption.base_url"),
        ("preemption", {"poll_interval_s": 1, "timeout_s": 2}, "preemption.timeout_s"),
    ],
    ids=[
        "address-label-conflict",
        "address-with-space",
        "control-dir-too-long",
        "negative-grace",
        "unknown-provider",
        "url-without-scheme",
        "timeout-over-interval",
    ],
)
def test_new_config_keys_are_checked_at_load(
    section: str, raw: dict[str, Any], expect: str
) -> None:
    with pytest.raises(ConfigError, match=expect):
        build(AgentConfig, {section: raw}, source="agent.yaml")
