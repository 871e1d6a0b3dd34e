"""The agent's hand in an in-process recovery: `rejoin` relays each named rank its own
membership and makes the launch the new attempt's first; `assign_standby` hands the ready
standby its membership with the job's environment and tracks it as the job's rank."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass, field

import pytest

from trainguard.agent.commands import CommandExecutor
from trainguard.agent.config import JobsConfig, StandbyConfig
from trainguard.agent.inprocess import StandbyEnv, inprocess_handlers
from trainguard.agent.jobpolicy import policy_from_config
from trainguard.agent.standby import StandbyPool
from trainguard.agent.standby_ranks import StandbyRanks
from trainguard.clock import FakeClock
from trainguard.command_args import AssignStandbyArgs, RejoinArgs, RejoinRank, command
from trainguard.membership import Membership
from trainguard.protocol import Control, EventKind


def member(rank: int, *, epoch: int = 5) -> Membership:
    return Membership(
        rank=rank,
        world_size=2,
        store_host="10.0.0.1",
        store_port=29650,
        epoch=epoch,
        host_store=rank == 0,
    )


@dataclass
class FakeSender:
    reachable: set[int] = field(default_factory=lambda: {0, 1})
    sent: list[tuple[str, int, Control]] = field(default_factory=list)

    def send_control_to(self, job: str, rank: int, control: Control) -> bool:
        if rank not in self.reachable:
            return False
        self.sent.append((job, rank, control))
        return True


@dataclass
class FakeLaunches:
    calls: list[str] = field(default_factory=list)

    def retag(self, job: str, *, attempt: int) -> bool:
        self.calls.append(f"retag {job} {attempt}")
        return True


class FakeChild:
    def __init__(self, pid: int = 4242) -> None:
        self.pid = pid
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


class FakeLauncher:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.is_ready = True
        self.child = FakeChild()

    def start(self, config: StandbyConfig) -> None:
        pass

    def alive(self) -> bool:
        return True

    def ready(self) -> bool:
        return self.is_ready

    def assign(self, membership_json: str) -> FakeChild:
        self.lines.append(membership_json)
        return self.child

    def stop(self) -> None:
        pass

    def output_tail(self) -> str:
        return ""


@dataclass
class Agent:
    executor: CommandExecutor
    sender: FakeSender
    launches: FakeLaunches
    ranks: StandbyRanks
    launcher: FakeLauncher
    clock: FakeClock


def agent(*, with_pool: bool = True, ready: bool = True) -> Agent:
    clock = FakeClock()
    sender, launches, ranks = FakeSender(), FakeLaunches(), StandbyRanks(clock=clock)
    launcher = FakeLauncher()
    pool = None
    if with_pool:
        pool = StandbyPool(
            config=StandbyConfig(enabled=True, module="train_rejoin"),
            launcher=launcher,
            clock=clock,
        )
        pool.tick(spare=True)
        launcher.is_ready = ready
        pool.tick(spare=True)
    handlers = inprocess_handlers(
        sender=sender,
        launches=launches,
        ranks=ranks,
        pool=lambda: pool,
        policy=policy_from_config(JobsConfig(allow_jobs_as_root=True), socket_gid=None),
        where=StandbyEnv(node="spare-1", heartbeat_socket="/run/tg/hb.sock", control_dir="/c"),
    )
    return Agent(CommandExecutor(handlers), sender, launches, ranks, launcher, clock)


def rejoin_args(*ranks: tuple[int, int]) -> RejoinArgs:
    return RejoinArgs(
        job="llm",
        epoch=5,
        ranks=tuple(RejoinRank(rank=now, membership=member(new).to_json()) for now, new in ranks),
    )


def test_rejoin_retags_the_launch_then_sends_each_rank_its_own_membership() -> None:
    a = agent()
    result = a.executor.execute(command("c-1", rejoin_args((1, 0), (2, 1))))
    assert result.ok is False  # rank 2 named no control socket here
    a.sender.reachable = {1, 2}
    result = a.executor.execute(command("c-2", rejoin_args((1, 0), (2, 1))))
    assert result.ok, result.message
    assert a.launches.calls == ["retag llm 5", "retag llm 5"]
    sent = {rank: Membership.from_json(c.membership or "") for _, rank, c in a.sender.sent[1:]}
    assert sent == {1: member(0), 2: member(1)}
    assert all(c.action == "rejoin" and c.request_id == "c-2" for _, _, c in a.sender.sent[1:])


def test_a_rejoin_to_an_unreachable_rank_fails_naming_it() -> None:
    a = agent()
    a.sender.reachable = set()
    result = a.executor.execute(command("c-1", rejoin_args((1, 0))))
    assert not result.ok
    assert result.data["ranks_missing"] == [1]


def assign(module: str = "train_rejoin") -> AssignStandbyArgs:
    return AssignStandbyArgs(
        job="llm",
        epoch=5,
        membership=member(1).to_json(),
        module=module,
        env={"NCCL_DEBUG": "WARN"},
        ckpt_dir="/ckpt/llm",
    )


def test_the_ready_standby_becomes_the_jobs_rank_with_the_jobs_environment() -> None:
    a = agent()
    result = a.executor.execute(command("a-1", assign()))
    assert result.ok, result.message
    line = json.loads(a.launcher.lines[0])
    assert Membership.from_json(json.dumps(line["membership"])) == member(1)
    env = line["env"]
    assert env["TRAINGUARD_JOB"] == "llm" and env["TRAINGUARD_ATTEMPT"] == "5"
    assert env["TRAINGUARD_AGENT_SOCKET"] == "/run/tg/hb.sock"
    assert env["TRAINGUARD_CKPT_DIR"] == "/ckpt/llm" and env["NCCL_DEBUG"] == "WARN"
    assert (env["RANK"], env["WORLD_SIZE"], env["TRAINGUARD_NODE"]) == ("1", "2", "spare-1")
    (proc,) = a.ranks.processes()
    assert (proc.job, proc.attempt, proc.state, proc.pid) == ("llm", 5, "running", 4242)
    # the same job again (a re-sent decision under another id) is refused, never two ranks
    again = a.executor.execute(command("a-2", assign()))
    assert not again.ok and "already runs" in again.message


@pytest.mark.parametrize(
    ("kw", "module", "reason"),
    [
        ({"with_pool": False}, "train_rejoin", "no warm standby"),
        ({"ready": False}, "train_rejoin", "not ready"),
        ({}, "other.module", "the standby runs module 'train_rejoin'"),
    ],
    ids=["no-pool", "not-ready", "other-module"],
)
def test_an_assignment_the_standby_cannot_take_fails_with_the_reason(
    kw: dict[str, bool], module: str, reason: str
) -> None:
    a = agent(**kw)
    result = a.executor.execute(command("a-1", assign(module)))
    assert not result.ok and reason in result.message
    assert a.ranks.processes() == ()


def test_a_standby_rank_is_stopped_fenced_and_reaped_as_a_launch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    signals: list[tuple[int, int]] = []
    monkeypatch.setattr("os.killpg", lambda pid, sig: signals.append((pid, sig)))
    a = agent()
    assert a.executor.execute(command("a-1", assign())).ok
    assert not a.ranks.stop_stale("llm", current_attempt=5)  # its own attempt: kept
    assert a.ranks.stop("llm", grace_s=10.0)
    assert signals == [(4242, signal.SIGTERM)]
    a.clock.advance(11.0)
    assert a.ranks.poll() == []
    assert signals[-1] == (4242, signal.SIGKILL)
    a.launcher.child.code = -9
    (exit_event,) = a.ranks.poll()
    assert exit_event.kind is EventKind.JOB_EXIT and exit_event.attempt == 5
    assert exit_event.data["stopped"] is True
    assert a.ranks.poll() == []  # once
    assert a.ranks.processes()[0].state == "exited"
    assert a.ranks.running_jobs() == frozenset()


def test_a_rejoin_makes_a_standby_rank_the_new_attempts_too() -> None:
    a = agent()
    assert a.executor.execute(command("a-1", assign())).ok
    assert a.ranks.retag("llm", attempt=6)
    assert a.ranks.processes()[0].attempt == 6
    assert not a.ranks.stop_stale("llm", current_attempt=6)
