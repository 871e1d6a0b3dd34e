"""Per-source schedules and deadlines on a FakeClock: SourceState, Source run inline, and the
agent's stale/recovered handling (metric, event, report) with one source hung."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_for
from trainguard.agent.config import (
    AgentConfig,
    ControllerConfig,
    HardwareConfig,
    HeartbeatConfig,
    JobsConfig,
    NodeConfig,
)
from trainguard.agent.daemon import Agent, Backends
from trainguard.agent.metrics import metric_families
from trainguard.agent.sim import SimHardware
from trainguard.agent.sources import MAX_PENDING_OUTCOMES, Source, SourceState
from trainguard.clock import FakeClock
from trainguard.model import GpuCollection
from trainguard.protocol import FaultSpec

# --- SourceState: the schedule and deadline state machine -----------------------------------


def state(**kw: float) -> SourceState:
    args = {"interval_s": 1.0, "deadline_s": 5.0, "now_mono": 100.0, **kw}
    return SourceState(name="gpu", **args)


def test_first_call_is_due_at_once_then_the_cadence_follows_each_start() -> None:
    s = state()
    assert s.due(100.0)
    s.begin(100.0)
    assert not s.due(100.0) and not s.due(150.0)  # never two calls in flight
    assert s.finish(100.3, ok=True, now_unix=1.0) == (pytest.approx(0.3), False, None)
    assert not s.due(100.9) and s.due(101.0)
    assert s.wait_s(100.5) == pytest.approx(0.5)
    assert s.last_success_unix == 1.0


def test_a_call_that_overran_is_followed_at_once_without_a_burst_of_catch_up_calls() -> None:
    s = state()
    s.begin(100.0)
    s.finish(103.0, ok=True, now_unix=1.0)
    assert s.due(103.0)
    s.begin(103.0)
    s.finish(103.1, ok=True, now_unix=2.0)
    assert not s.due(103.5) and s.due(104.0)


def test_a_call_past_its_deadline_makes_one_stale_episode_until_a_call_is_on_time() -> None:
    s = state()
    s.begin(100.0)
    assert s.check(105.0) is None  # at the deadline: not yet
    t = s.check(105.5)
    assert t is not None and (t.kind, t.source, t.running_s) == ("stale", "gpu", 5.5)
    assert s.check(200.0) is None  # once per episode
    # the hung call returns at last: its values are used, but the source stays stale
    assert s.finish(300.0, ok=True, now_unix=9.0) == (pytest.approx(200.0), True, None)
    assert s.stale and s.last_success_unix == 9.0
    s.begin(300.0)
    assert s.check(304.0) is None
    _, late, t = s.finish(300.2, ok=True, now_unix=10.0)
    assert not late and t is not None
    assert (t.kind, t.stale_for_s) == ("recovered", pytest.approx(194.7))
    assert not s.stale


def test_an_overrun_the_loop_never_saw_still_makes_an_episode() -> None:
    s = state()
    s.begin(100.0)
    _, late, t = s.finish(107.0, ok=True, now_unix=1.0)
    assert late and t is not None and t.kind == "stale" and t.running_s == 7.0
    s.begin(107.0)
    assert s.finish(107.1, ok=False, now_unix=2.0)[2].kind == "recovered"  # type: ignore[union-attr]
    assert s.last_success_unix == 1.0  # an error is on time, but no success


def test_failing_calls_on_time_are_not_stale() -> None:
    s = state()
    for i in range(3):
        s.begin(100.0 + i)
        assert s.finish(100.1 + i, ok=False, now_unix=float(i)) == (pytest.approx(0.1), False, None)
    assert not s.stale and s.last_success_unix is None


@pytest.mark.parametrize(("interval_s", "deadline_s"), [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)])
def test_non_positive_interval_or_deadline_is_refused(interval_s: float, deadline_s: float) -> None:
    with pytest.raises(ValueError, match="gpu"):
        state(interval_s=interval_s, deadline_s=deadline_s)


# --- Source: one body, run inline on the fake clock ------------------------------------------


class Gate:
    """A body that blocks while closed (an NVML call stuck in the driver)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        self.entered.set()
        assert self.open.wait(30.0)
        return self.calls


def test_source_outcomes_and_errors_are_handed_over_once() -> None:
    clock = FakeClock()
    results = iter([1, ValueError("bad read"), 3])

    def body() -> int:
        r = next(results)
        if isinstance(r, Exception):
            raise r
        return r

    src = Source("ib", body, interval_s=1.0, deadline_s=5.0, clock=clock)
    assert src.run_if_due() and not src.run_if_due()
    clock.advance(1.0)
    assert src.run_if_due()
    h = src.take()
    assert [(o.value, o.error) for o in h.outcomes] == [(1, None), (None, "ValueError: bad read")]
    assert not h.stale and h.last_success_unix == clock.now() - 1.0  # the error is no success
    assert src.take().outcomes == ()


def test_hung_source_is_stale_without_a_second_call_and_recovers_after() -> None:
    clock = FakeClock()
    gate = Gate()
    src = Source("gpu", gate, interval_s=1.0, deadline_s=5.0, clock=clock)
    src.run_if_due()
    src.take()
    gate.open.clear()
    gate.entered.clear()
    clock.advance(1.0)
    hung = threading.Thread(target=src.run_if_due, daemon=True)
    hung.start()
    assert gate.entered.wait(5.0)
    for _ in range(30):  # 30 s of ticks: one stale transition, and never a second call
        clock.advance(1.0)
        assert not src.run_if_due()
        h = src.take()
        assert h.stale is (clock.monotonic() - 1001.0 > 5.0)
    assert gate.calls == 2
    gate.open.set()
    hung.join(5.0)
    h = src.take()
    assert [o.late for o in h.outcomes] == [True] and h.stale
    clock.advance(1.0)
    assert src.run_if_due()
    h = src.take()
    assert [t.kind for t in h.transitions] == ["recovered"] and not h.stale


def test_stale_transition_is_seen_once_across_takes() -> None:
    clock = FakeClock()
    gate = Gate()
    gate.open.clear()
    src = Source("gpu", gate, interval_s=1.0, deadline_s=2.0, clock=clock)
    threading.Thread(target=src.run_if_due, daemon=True).start()
    assert gate.entered.wait(5.0)
    kinds = []
    for _ in range(5):
        clock.advance(1.0)
        kinds.extend(t.kind for t in src.take().transitions)
    assert kinds == ["stale"]
    gate.open.set()


def test_pending_outcomes_are_bounded() -> None:
    clock = FakeClock()
    src = Source("xid", lambda: [], interval_s=1.0, deadline_s=1.0, clock=clock)
    for _ in range(MAX_PENDING_OUTCOMES + 5):
        src.run_once()
    assert len(src.take().outcomes) == MAX_PENDING_OUTCOMES
    assert src.outcomes_dropped_total == 5


# --- the agent with one source hung ----------------------------------------------------------


class HangingGpu:
    """The sim's GPUs behind a gate: collect blocks while the gate is closed."""

    def __init__(self, sim: SimHardware) -> None:
        self.sim = sim
        self.gate = Gate()

    def collect(self) -> GpuCollection:
        self.gate()
        return self.sim.collect()


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tgsrc", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_agent_marks_a_hung_gpu_source_stale_while_ib_xid_and_the_watchdog_go_on(
    sockdir: Path,
) -> None:
    token = sockdir / "token"
    token.write_text("t0ken")
    token.chmod(0o600)
    cfg = AgentConfig(
        node=NodeConfig(name="node-3"),
        hardware=HardwareConfig(gpu_backend="sim"),
        heartbeat=HeartbeatConfig(socket_path=str(sockdir / "hb.sock")),
        jobs=JobsConfig(work_dir=str(sockdir / "jobs")),
        # a closed port: reports fail; the test reads the spool and build_report
        controller=ControllerConfig(url="http://127.0.0.1:1", token_file=str(token)),
    )
    clock = FakeClock()
    sim = SimHardware(gpus=2, ib_ports=1, node_name="node-3", seed=0, clock=clock)
    gpu = HangingGpu(sim)
    backends = Backends(gpu=gpu, ib=sim.ib, event_sources=[("xid", sim)], sim=sim)
    agent = Agent(cfg, clock=clock, serve_http=False, inline_sources=True, backends=backends)
    agent.start()
    try:
        assert agent.snapshot is not None and len(agent.snapshot.gpus) == 2
        gpu.gate.open.clear()
        gpu.gate.entered.clear()
        clock.advance(1.0)
        hung = threading.Thread(target=agent.sources["gpu"].run_if_due, daemon=True)
        hung.start()
        assert gpu.gate.entered.wait(5.0)
        ib_before = agent.snapshot.ib_ports[0].counters["port_xmit_data"]
        loops_before = agent.snapshot.loop_iterations_total
        for _ in range(7):
            clock.advance(1.0)
            agent.tick()
        agent.inject_fault(FaultSpec(kind="xid", gpu=1, code=79))
        clock.advance(1.0)
        agent.tick()

        snap = agent.snapshot
        assert snap.loop_iterations_total == loops_before + 8
        assert snap.source_stale == {"gpu": True, "ib": False, "xid": False}
        assert snap.ib_ports[0].counters["port_xmit_data"] > ib_before  # IB keeps updating
        assert snap.xid_total == {(1, "79", "fatal"): 1}  # and XIDs keep arriving
        assert len(snap.gpus) == 2  # the last GPU values stay, marked stale
        stale = [e for e in agent.spool.pending(100) if e.kind == "source_stale"]
        assert [(e.data["source"], e.data["deadline_s"]) for e in stale] == [("gpu", 5.0)]
        health = agent.build_report(1, ()).health
        assert health["sources_stale"] == 1.0
        assert (health["source_stale.gpu"], health["source_stale.ib"]) == (1.0, 0.0)
        fams = {f.name: f for f in metric_families(snap)}
        values = {
            s.labels["source"]: s.value for s in fams["trainguard_agent_source_stale"].samples
        }
        assert values == {"gpu": 1.0, "ib": 0.0, "xid": 0.0}
        success = {
            s.labels["source"]: s.value
            for s in fams["trainguard_agent_source_last_success_timestamp_seconds"].samples
        }
        assert success["ib"] == clock.now() and success["gpu"] < clock.now() - 7

        gpu.gate.open.set()
        hung.join(5.0)
        wait_for(lambda: not hung.is_alive(), timeout_s=5.0, what="the hung call to return")
        clock.advance(1.0)
        agent.tick()  # the late result is taken, and the next call is on time
        snap = agent.snapshot
        assert snap.source_stale["gpu"] is False
        kinds = [e.kind for e in agent.spool.pending(100) if e.kind.startswith("source_")]
        assert kinds == ["source_stale", "source_recovered"]
        assert agent.build_report(2, ()).health["sources_stale"] == 0.0
    finally:
        gpu.gate.open.set()
        agent.close()
