"""The warm standby pool's decisions, on a fake clock with a recording launcher."""

from __future__ import annotations

import pytest

from trainguard.agent.config import StandbyConfig
from trainguard.agent.standby import (
    Decision,
    StandbyPool,
    backoff_s,
    keeps_standby,
    standby_argv,
)
from trainguard.clock import FakeClock
from trainguard.strict import ConfigError, build


class FakeChild:
    pid = 4242

    def poll(self) -> int | None:
        return None


class FakeLauncher:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.is_alive = False
        self.is_ready = False

    def start(self, config: StandbyConfig) -> None:
        self.calls.append("start")
        self.is_alive, self.is_ready = True, False

    def alive(self) -> bool:
        return self.is_alive

    def ready(self) -> bool:
        return self.is_alive and self.is_ready

    def assign(self, membership_json: str) -> FakeChild:
        self.calls.append(f"assign {membership_json}")
        self.is_alive = self.is_ready = False  # gone from the pool: the job's process now
        return FakeChild()

    def stop(self) -> None:
        self.calls.append("stop")
        self.is_alive = self.is_ready = False

    def output_tail(self) -> str:
        return "Traceback: ImportError"


CONFIG = StandbyConfig(enabled=True, module="examples.job", restart_backoff_s=5.0)


def _pool() -> tuple[StandbyPool, FakeLauncher, FakeClock]:
    clock = FakeClock()
    launcher = FakeLauncher()
    return StandbyPool(config=CONFIG, launcher=launcher, clock=clock), launcher, clock


def test_a_spare_node_starts_one_standby_and_reports_it_ready() -> None:
    pool, launcher, clock = _pool()
    assert pool.tick(spare=True) is Decision.START
    assert pool.tick(spare=True) is Decision.NOTHING  # one at a time
    assert not pool.is_ready
    clock.advance(3.0)
    launcher.is_ready = True
    pool.tick(spare=True)
    assert pool.is_ready
    assert pool.ready_s == pytest.approx(3.0)
    assert launcher.calls == ["start"]
    assert pool.started_total == 1


def test_an_active_node_or_a_disabled_pool_starts_nothing() -> None:
    pool, launcher, _ = _pool()
    assert pool.tick(spare=False) is Decision.NOTHING
    off = StandbyPool(config=StandbyConfig(), launcher=launcher, clock=FakeClock())
    assert off.tick(spare=True) is Decision.NOTHING
    assert launcher.calls == []


def test_a_taken_standby_is_replaced_at_once() -> None:
    pool, launcher, _ = _pool()
    pool.tick(spare=True)
    launcher.is_ready = True
    pool.tick(spare=True)
    taken = pool.take('{"rank": 1}')
    assert taken is not None and taken.pid == 4242
    assert not pool.is_ready
    assert pool.take("{}") is None  # none ready until the replacement is
    assert pool.tick(spare=True) is Decision.START
    assert launcher.calls == ["start", 'assign {"rank": 1}', "start"]
    assert pool.started_total == 2


def test_a_dead_standby_is_restarted_after_a_doubling_backoff() -> None:
    pool, launcher, clock = _pool()
    pool.tick(spare=True)
    launcher.is_alive = False  # died while importing
    assert pool.tick(spare=True) is Decision.NOTHING  # noticed; waits 5 s
    clock.advance(4.9)
    assert pool.tick(spare=True) is Decision.NOTHING
    clock.advance(0.2)
    assert pool.tick(spare=True) is Decision.START
    launcher.is_alive = False  # died again: 10 s now
    pool.tick(spare=True)
    clock.advance(9.0)
    assert pool.tick(spare=True) is Decision.NOTHING
    clock.advance(1.1)
    assert pool.tick(spare=True) is Decision.START
    launcher.is_ready = True  # became ready: the backoff starts over
    pool.tick(spare=True)
    launcher.is_alive = False
    pool.tick(spare=True)
    clock.advance(5.1)
    assert pool.tick(spare=True) is Decision.START


def test_a_standby_not_ready_in_time_is_stopped_and_retried() -> None:
    pool, launcher, clock = _pool()
    pool.tick(spare=True)
    clock.advance(CONFIG.ready_timeout_s + 1)
    pool.tick(spare=True)
    assert launcher.calls == ["start", "stop"]
    clock.advance(5.1)
    assert pool.tick(spare=True) is Decision.START


def test_the_standby_stops_when_the_node_is_no_longer_a_spare() -> None:
    pool, launcher, _ = _pool()
    pool.tick(spare=True)
    assert pool.tick(spare=False) is Decision.STOP
    assert launcher.calls == ["start", "stop"]
    assert pool.tick(spare=False) is Decision.NOTHING
    assert pool.tick(spare=True) is Decision.START  # a spare again: no backoff, not a death


def test_a_standby_that_cannot_be_started_is_retried_with_the_backoff() -> None:
    pool, launcher, clock = _pool()

    def refuse(config: StandbyConfig) -> None:
        raise FileNotFoundError("/opt/job/bin/python")

    launcher.start = refuse  # type: ignore[method-assign]
    pool.tick(spare=True)
    assert pool.started_total == 0 and not pool.is_ready
    clock.advance(4.0)
    assert pool.tick(spare=True) is Decision.NOTHING
    clock.advance(1.1)
    assert pool.tick(spare=True) is Decision.START


def test_the_backoff_is_capped() -> None:
    assert backoff_s(failures=0, config=CONFIG) == 0.0
    assert backoff_s(failures=30, config=CONFIG) == CONFIG.max_backoff_s


def test_the_standby_is_an_argument_list_of_the_configured_interpreter() -> None:
    cfg = StandbyConfig(enabled=True, python="/opt/job/bin/python", module="m.x", args=("--a",))
    assert standby_argv(cfg, ready_file="/w/ready") == [
        "/opt/job/bin/python", "-m", "trainguard.trainer.standby_child", "--ready-file",
        "/w/ready", "m.x", "--a",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "data",
    [
        {"enabled": True},
        {"module": "not a module"},
        {"max_standbys": 2},
        {"restart_backoff_s": 10.0, "max_backoff_s": 5.0},
        {"enabled": True, "modul": "x"},
    ],
    ids=["enabled-without-module", "bad-module", "two-standbys", "cap-below-backoff", "typo"],
)
def test_bad_standby_config_is_refused(data: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        build(StandbyConfig, data, source="test")


@pytest.mark.parametrize(
    ("said", "role_hint", "running", "keeps"),
    [
        (None, "spare", frozenset(), True),  # before the controller said: the hint
        (None, "active", frozenset(), False),
        (True, "active", frozenset(), True),  # the controller made it a spare
        (False, "spare", frozenset(), False),  # ... or took it out of the spares
        (True, "spare", frozenset({"bench"}), False),  # a rank of a job runs here
    ],
)
def test_a_node_keeps_a_standby_while_the_controller_calls_it_a_spare_and_it_runs_no_rank(
    said: bool | None, role_hint: str, running: frozenset[str], keeps: bool
) -> None:
    assert keeps_standby(said=said, role_hint=role_hint, running_jobs=running) is keeps
