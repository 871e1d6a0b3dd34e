"""A small simulated cluster for rules tests: mutable per-node hardware and rank state that
reports into a real SignalState once per simulated second, driven by a FakeClock, with the
real engine evaluated after every second."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.clock import FakeClock
from trainguard.controller.model import Decision
from trainguard.controller.rules.engine import EngineMemory, evaluate
from trainguard.controller.rules.loader import RuleSet, default_rules_path, load_rules, parse_rules
from trainguard.controller.signals import SignalState
from trainguard.model import GpuSample, IbPortSample, NvLinkSample
from trainguard.protocol import Event, RankState, Report

HEALTHY_GPU: dict[str, Any] = {
    "temperature_celsius": 55.0,
    "power_watts": 400.0,
    "ecc_corrected_volatile_total": 0,
    "ecc_uncorrected_volatile_total": 0,
    "remapped_rows_pending": False,
    "remapped_rows_failure": False,
    "retired_pages_dbe": 0,
    "throttle_hw_slowdown": False,
    "throttle_hw_thermal": False,
}
HEALTHY_LINK: dict[str, Any] = {
    "up": True,
    "crc_flit_errors_total": 0,
    "crc_data_errors_total": 0,
    "replay_errors_total": 0,
    "recovery_errors_total": 0,
}
HEALTHY_IB_COUNTERS: dict[str, int] = {
    "symbol_error": 0,
    "port_rcv_errors": 0,
    "link_downed": 0,
    "port_xmit_data": 0,
}


@dataclass
class SimRank:
    job: str
    rank: int
    step: int = 100
    loss: float | None = 2.5
    step_time_s: float | None = 0.5
    compute_time_s: float | None = 0.4
    samples_per_s: float | None = 64.0
    heartbeat_age_s: float = 0.2
    step_age_s: float = 0.2
    phase: str = "train"
    world_size: int = 1
    # checkpoint health: a periodic checkpoint every 100 steps of 0.5 s, the newest a minute old
    ckpt_failures: int = 0
    ckpt_age_s: float | None = 60.0
    ckpt_interval_s: float | None = 50.0
    # the second-region copy (rank 0 of a job with a replica)
    ckpt_replica_step: int | None = None
    ckpt_replica_lag_s: float | None = None

    def state(self) -> RankState:
        return RankState(
            job=self.job,
            rank=self.rank,
            step=self.step,
            loss=self.loss,
            step_time_s=self.step_time_s,
            compute_time_s=self.compute_time_s,
            samples_per_s=self.samples_per_s,
            heartbeat_age_s=self.heartbeat_age_s,
            step_age_s=self.step_age_s,
            phase=self.phase,
            world_size=self.world_size,
            ckpt_failures=self.ckpt_failures,
            ckpt_age_s=self.ckpt_age_s,
            ckpt_interval_s=self.ckpt_interval_s,
            ckpt_replica_step=self.ckpt_replica_step,
            ckpt_replica_lag_s=self.ckpt_replica_lag_s,
        )


@dataclass
class SimNode:
    name: str
    gpus: list[dict[str, Any]] = field(default_factory=list)
    links: list[list[dict[str, Any]]] = field(default_factory=list)  # per GPU
    ib: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)
    ranks: list[SimRank] = field(default_factory=list)
    pending_events: list[Event] = field(default_factory=list)
    health: dict[str, float] = field(default_factory=dict)
    silent: bool = False
    next_event_id: int = 1

    def report(self, now: float) -> tuple[Report, list[Event]]:
        gpus = []
        for i, g in enumerate(self.gpus):
            links = tuple(NvLinkSample(link=j, **ln) for j, ln in enumerate(self.links[i]))
            gpus.append(
                GpuSample(
                    index=i,
                    uuid=f"GPU-{self.name}-{i}",
                    pci_bus_id=f"0000:{0x18 + i:02x}:00.0",
                    name="H100",
                    nvlinks=links,
                    **g,
                )
            )
        ports = []
        for (dev, port), p in self.ib.items():
            up = p["up"]
            ports.append(
                IbPortSample(
                    device=dev,
                    port=port,
                    state="ACTIVE" if up else "DOWN",
                    state_code=4 if up else 1,
                    phys_state="LinkUp" if up else "Polling",
                    phys_state_code=5 if up else 2,
                    rate_gbps=400.0,
                    counters=dict(p["counters"]),
                )
            )
        events, self.pending_events = self.pending_events, []
        rep = Report(
            node=self.name,
            instance="inst-1",
            seq=int(now),
            sent_at=now,
            gpus=tuple(gpus),
            ib_ports=tuple(ports),
            ranks=tuple(r.state() for r in self.ranks),
            events=tuple(events),
            health=dict(self.health),
        )
        return rep, events

    def event(self, kind: str, **kw: Any) -> None:
        self.pending_events.append(Event(id=self.next_event_id, kind=kind, ts=0.0, **kw))
        self.next_event_id += 1


def make_node(name: str, *, gpus: int = 2, links: int = 2, ib_ports: int = 1) -> SimNode:
    node = SimNode(name)
    for _ in range(gpus):
        node.gpus.append(dict(HEALTHY_GPU))
        node.links.append([dict(HEALTHY_LINK) for _ in range(links)])
    for p in range(ib_ports):
        node.ib[(f"mlx5_{p}", 1)] = {"up": True, "counters": dict(HEALTHY_IB_COUNTERS)}
    return node


class Cluster:
    """Nodes + SignalState + engine on a FakeClock; `run(seconds)` simulates that many seconds."""

    def __init__(
        self,
        rules: RuleSet | str | None = None,
        *,
        stale_after_s: float = 10.0,
        history_s: float = 900.0,
        min_spacing_s: float = 5.0,
    ) -> None:
        if rules is None:
            rules = load_rules([default_rules_path()])
        elif isinstance(rules, str):
            rules = RuleSet(rules=tuple(parse_rules(rules)), sources=("<test>",))
        self.rules = rules
        self.clock = FakeClock()
        self.signals = SignalState(history_s=history_s, min_spacing_s=min_spacing_s)
        self.signals.track(rules.history_needs())
        self.memory = EngineMemory()
        self.stale_after_s = stale_after_s
        self.nodes: dict[str, SimNode] = {}
        self.last: list[Decision] = []
        self.log: list[tuple[float, Decision]] = []
        self.hooks: list[Callable[[Cluster], None]] = []  # run at the start of every second

    def add(self, node: SimNode, *, role: str = "active", state: str = "active") -> SimNode:
        self.nodes[node.name] = node
        job = node.ranks[0].job if node.ranks else None
        self.signals.set_node_meta(node.name, role=role, state=state, job=job)
        return node

    def add_job(self, job: str, *, nodes: Sequence[str], ranks_per_node: int = 2) -> None:
        world = len(nodes) * ranks_per_node
        r = 0
        for name in nodes:
            node = self.nodes[name]
            for _ in range(ranks_per_node):
                node.ranks.append(SimRank(job=job, rank=r, world_size=world))
                r += 1
            self.signals.set_node_meta(name, role="active", state="active", job=job)
        self.signals.set_job_meta(job, nodes=list(nodes), state="running")

    def ranks(self, job: str) -> list[SimRank]:
        return [r for n in self.nodes.values() for r in n.ranks if r.job == job]

    def rank(self, job: str, rank: int) -> SimRank:
        return next(r for r in self.ranks(job) if r.rank == rank)

    def second(self) -> list[Decision]:
        """Advance one second: every non-silent node reports, then one engine tick."""
        self.clock.advance(1.0)
        now = self.clock.now()
        for hook in list(self.hooks):
            hook(self)
        for node in self.nodes.values():
            if node.silent:
                continue
            rep, events = node.report(now)
            self.signals.ingest(rep, now=now, new_events=events)
        return self.tick()

    def tick(self) -> list[Decision]:
        now = self.clock.now()
        self.last, self.memory = evaluate(
            rules=self.rules,
            signals=self.signals,
            now=now,
            memory=self.memory,
            stale_after_s=self.stale_after_s,
        )
        self.log.extend((now, d) for d in self.last)
        return self.last

    def run(self, seconds: int) -> list[Decision]:
        for _ in range(seconds):
            self.second()
        return self.last

    def states(self, rule: str) -> dict[str, str]:
        """target key -> state for `rule` in the last tick."""
        return {d.target.key: d.state for d in self.last if d.rule == rule}

    def ever(self, rule: str, state: str) -> list[tuple[float, Decision]]:
        return [(t, d) for t, d in self.log if d.rule == rule and d.state == state]

    def rules_seen(self, states: Iterable[str] = ("pending", "firing")) -> set[str]:
        wanted = set(states)
        return {d.rule for _, d in self.log if d.state in wanted}
