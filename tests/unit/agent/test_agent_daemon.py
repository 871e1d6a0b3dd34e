"""Agent.tick and wiring on a FakeClock with the sim backend (no HTTP server)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest

from trainguard.agent import daemon
from trainguard.agent.config import (
    AgentConfig,
    ControllerConfig,
    HardwareConfig,
    HeartbeatConfig,
    JobsConfig,
    NodeConfig,
)
from trainguard.agent.daemon import Agent, Backends
from trainguard.agent.sim import SimHardware
from trainguard.clock import FakeClock
from trainguard.model import GpuCollection
from trainguard.protocol import Command, FaultSpec, Heartbeat, encode_json
from trainguard.systemd import SystemdNotifier


class RecordingNotifier(SystemdNotifier):
    def __init__(self) -> None:
        super().__init__({})
        self.sent: list[str] = []

    def notify(self, message: str) -> bool:
        self.sent.append(message)
        return True


@pytest.fixture
def sockdir(short_tmp: Path) -> Path:
    return short_tmp


def config(sockdir: Path, *, controller: bool = False) -> AgentConfig:
    token = sockdir / "token"
    token.write_text("t0ken")
    token.chmod(0o600)
    return AgentConfig(
        node=NodeConfig(name="node-7"),
        hardware=HardwareConfig(gpu_backend="sim", sim_gpus=4, sim_ib_ports=2),
        heartbeat=HeartbeatConfig(socket_path=str(sockdir / "hb.sock")),
        jobs=JobsConfig(work_dir=str(sockdir / "jobs")),
        controller=ControllerConfig(
            # a closed port: reports fail fast; these tests look at the spool, not delivery
            url="http://127.0.0.1:1" if controller else "",
            token_file=str(token) if controller else "",
        ),
    )


def started(cfg: AgentConfig, clock: FakeClock, **kw: object) -> Agent:
    # sources run inside tick() when due: deterministic on the FakeClock, no worker threads
    agent = Agent(cfg, clock=clock, serve_http=False, inline_sources=True, **kw)  # type: ignore[arg-type]
    agent.start()
    return agent


def test_each_xid_line_counts_under_its_own_severity(sockdir: Path) -> None:
    kmsg = sockdir / "kmsg"
    kmsg.write_text("")
    cfg = config(sockdir)
    cfg = dataclasses.replace(
        cfg, hardware=dataclasses.replace(cfg.hardware, sim_kmsg_path=str(kmsg))
    )
    clock = FakeClock()
    agent = started(cfg, clock)
    try:
        with kmsg.open("a") as f:  # sim GPU 1 is at 0000:2a:00.0
            f.write(
                "4,1,10,-;NVRM: Xid (PCI:0000:2a:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 00\n"
                "4,2,11,-;NVRM: Xid (PCI:0000:2a:00): 145, RLW_REMAP Nonfatal XC0 i0 Link 01\n"
                "4,3,12,-;NVRM: Xid (PCI:0000:2a:00): 145, RLW_REMAP Fatal XC0 i0 Link 00\n"
                "4,4,13,-;NVRM: Xid (PCI:0000:2a:00): 999, pid=1, something new\n"
                "4,5,14,-;NVRM: Xid (PCI:0000:2a:00): 123456789, pid=1, garbled\n"
                "12,6,15,-;NVRM: Xid (PCI:0000:2a:00): 79, pid=1, forged by a user process\n"
            )
        clock.advance(1.0)
        agent.tick()
        snap = agent.snapshot
        assert snap is not None
        assert snap.xid_total == {
            (1, "145", "informational"): 2,
            (1, "145", "fatal"): 1,
            (1, "999", "unknown"): 1,
            (1, "other", "unknown"): 1,
        }
        assert snap.kmsg_non_kernel_records_total == 1
    finally:
        agent.close()


def test_xid_series_are_bounded(sockdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(daemon, "MAX_XID_SERIES", 2)
    clock = FakeClock()
    agent = started(config(sockdir), clock)
    try:
        for code in (48, 79, 31, 48):
            agent.inject_fault(FaultSpec(kind="xid", gpu=0, code=code))
        clock.advance(1.0)
        agent.tick()
        assert agent.snapshot is not None
        assert agent.snapshot.xid_total == {(0, "48", "fatal"): 2, (0, "79", "fatal"): 1}
    finally:
        agent.close()


def test_start_announces_ready_and_each_tick_pets_the_watchdog(sockdir: Path) -> None:
    notifier = RecordingNotifier()
    agent = started(config(sockdir), FakeClock(), notifier=notifier)
    try:
        agent.tick()
        assert notifier.sent[0] == "WATCHDOG=1"  # first tick happens before READY
        assert notifier.sent[1].startswith("READY=1")
        assert notifier.sent[2] == "WATCHDOG=1"
    finally:
        agent.close()
    assert notifier.sent[-1] == "STOPPING=1"
    assert not (sockdir / "hb.sock").exists()


def test_tick_publishes_hardware_and_counts_xids(sockdir: Path) -> None:
    clock = FakeClock()
    agent = started(config(sockdir), clock)
    try:
        agent.inject_fault(FaultSpec(kind="dbe", gpu=3))
        clock.advance(1.0)
        agent.tick()
        snap = agent.snapshot
        assert snap is not None
        assert len(snap.gpus) == 4 and len(snap.ib_ports) == 2
        assert snap.xid_total == {(3, "48", "fatal"): 1}
        assert snap.events_total == {"fault_injected": 1, "xid": 1}
        assert len(agent.spool) == 0  # export-only: nothing would ever read the spool
    finally:
        agent.close()


def test_with_controller_events_and_command_results_are_spooled(sockdir: Path) -> None:
    clock = FakeClock()
    agent = started(config(sockdir, controller=True), clock)
    try:
        agent.execute(
            Command(id="c1", kind="inject_fault", args={"kind": "xid", "gpu": 1, "code": 74})
        )
        agent.execute(Command(id="c2", kind="start_job", args={"job": "j"}))
        clock.advance(1.0)  # the XID source's next poll is due
        agent.tick()
        kinds = [
            (e.kind, e.code, e.data.get("command_id"), e.data.get("ok"))
            for e in agent.spool.pending(10)
        ]
        assert kinds == [
            ("fault_injected", None, None, None),
            ("command_result", None, "c1", True),
            ("command_result", None, "c2", False),
            ("xid", 74, None, None),
        ]
        ids = [e.id for e in agent.spool.pending(10)]
        assert ids == sorted(ids) and len(set(ids)) == 4
        assert agent.snapshot is not None
        assert agent.snapshot.commands_total == {
            ("inject_fault", "ok"): 1,
            ("start_job", "failed"): 1,
        }
    finally:
        agent.close()


def test_trainer_events_reach_the_spool_and_ranks_reach_the_report(sockdir: Path) -> None:
    clock = FakeClock()
    agent = started(config(sockdir, controller=True), clock)
    try:
        assert agent.heartbeat is not None
        agent.heartbeat.handle_datagram(
            encode_json(
                Heartbeat(job="j", rank=0, step=3, t=1.0, loss=float("nan"), event="nan_loss")
            ),
            pid=10,
        )
        clock.advance(2.0)
        agent.tick()
        (ev,) = agent.spool.pending(10)
        assert (ev.kind, ev.job, ev.rank) == ("nan_loss", "j", 0)
        report = agent.build_report(1, agent.spool.pending(10))
        assert report.node == "node-7" and report.instance == agent.instance
        assert len(report.gpus) == 4
        (rank,) = report.ranks
        assert rank.step == 3 and rank.heartbeat_age_s == pytest.approx(2.0)
    finally:
        agent.close()


class FailingGpu:
    def collect(self) -> GpuCollection:
        raise RuntimeError("NVML_ERROR_UNKNOWN")


def test_failing_collector_is_counted_each_time_and_logged_once(
    sockdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    sim = SimHardware(gpus=1, ib_ports=1, node_name="n", seed=0, clock=clock)
    backends = Backends(gpu=FailingGpu(), ib=sim.ib, event_sources=[("xid", sim)])
    with caplog.at_level(logging.INFO):
        agent = started(config(sockdir), clock, backends=backends)
        try:
            for _ in range(2):
                clock.advance(1.0)  # each source runs once per interval
                agent.tick()
            snap = agent.snapshot
            assert snap is not None
            assert snap.collect_errors_total == {"gpu": 3}
            assert len(snap.ib_ports) == 1  # one broken collector never blanks the others
        finally:
            agent.close()
    assert caplog.text.count("event=collector_failed collector=gpu") == 1


def test_health_turns_stale_when_the_loop_stops_making_progress(sockdir: Path) -> None:
    clock = FakeClock()
    agent = started(config(sockdir), clock)
    try:
        assert agent.health() == (True, "ok")
        clock.advance(10.0)
        ok, why = agent.health()
        assert not ok and why.startswith("stale")
        agent.tick()
        assert agent.health()[0]
    finally:
        agent.close()
