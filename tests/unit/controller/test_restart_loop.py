"""The restart-loop breaker on the FakeClock: a job whose restarts crash again before any new
checkpoint is held after jobs.restart_loop_restarts of them (not restarted again, paged with
the evidence, its reason in the job view); the window's edges; checkpoint progress and an
operator's restart reset the count; a controller killed between the decision and its effect
holds the job once, with one page."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.controller.job_sim import Sim, running
from trainguard.controller.actions.notify import RecordingNotifier
from trainguard.controller.actions.restartloop import LOOP_KEY, PastRestart, find_loop
from trainguard.controller.jobs import JobManager
from trainguard.controller.jobstate import JobState
from trainguard.strict import ConfigError

WINDOW_S = 1800.0


def _r(at: float, ckpt: int | None, *, operator: bool = False, i: int = 0) -> PastRestart:
    return PastRestart(
        action_id=i or int(at),
        kind="restart",
        at=at,
        ckpt_step=ckpt,
        operator=operator,
        state="failed",
        result="attempt exited (code 1)",
    )


def _loop(history: list[PastRestart], *, ckpt_now: int | None, now: float = 10_000.0):
    return find_loop("job", history, ckpt_now=ckpt_now, now=now, limit=3, window_s=WINDOW_S)


def test_three_restarts_from_the_same_checkpoint_are_a_loop() -> None:
    loop = _loop([_r(9000, 40), _r(9100, 40), _r(9200, 40)], ckpt_now=40)
    assert loop is not None
    assert [r.at for r in loop.restarts] == [9000, 9100, 9200]
    assert "3 restarts in 30 min without checkpoint progress" in loop.reason()
    assert "resumed from step 40" in loop.reason()
    assert "newest committed checkpoint: step 40" in loop.reason()
    text = loop.evidence()
    assert text.count("- restart #") == 3 and "attempt exited (code 1)" in text


def test_two_restarts_are_not_yet_a_loop() -> None:
    assert _loop([_r(9100, 40), _r(9200, 40)], ckpt_now=40) is None


@pytest.mark.parametrize(
    ("oldest_at", "held"),
    [(10_000.0 - WINDOW_S, True), (10_000.0 - WINDOW_S - 0.001, False)],
    ids=["oldest-at-the-window-edge-counts", "oldest-just-outside-does-not"],
)
def test_the_window_edge(oldest_at: float, held: bool) -> None:
    history = [_r(oldest_at, 40, i=1), _r(9500, 40, i=2), _r(9900, 40, i=3)]
    assert (_loop(history, ckpt_now=40) is not None) is held


def test_a_newer_checkpoint_between_restarts_resets_the_count() -> None:
    # 40 -> 40 -> 50 (progress after the second) -> 50 -> 50: two without progress since
    history = [_r(9000, 40), _r(9100, 40), _r(9200, 50), _r(9300, 50)]
    assert _loop(history, ckpt_now=50) is None
    assert _loop([*history, _r(9400, 50)], ckpt_now=50) is not None


def test_a_checkpoint_after_the_last_restart_is_progress() -> None:
    history = [_r(9000, 40), _r(9100, 40), _r(9200, 40)]
    assert _loop(history, ckpt_now=45) is None


def test_from_scratch_to_a_first_checkpoint_is_progress() -> None:
    assert _loop([_r(9000, None), _r(9100, None), _r(9200, None)], ckpt_now=None) is not None
    assert _loop([_r(9000, None), _r(9100, None), _r(9200, None)], ckpt_now=5) is None


def test_an_operator_restart_resets_the_count() -> None:
    history = [_r(9000, 40), _r(9100, 40), _r(9150, 40, operator=True), _r(9200, 40)]
    assert _loop(history, ckpt_now=40) is None


def test_limit_zero_never_holds() -> None:
    history = [_r(9000 + i, 40) for i in range(10)]
    assert find_loop("job", history, ckpt_now=40, now=10_000.0, limit=0, window_s=WINDOW_S) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("restart_loop_restarts", -1),
        ("restart_loop_restarts", 101),
        ("restart_loop_window_s", 59.0),
        ("restart_loop_window_s", float("inf")),
    ],
)
def test_the_config_is_bounded(make_core, field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        make_core(jobs={field: value})


# --- on the simulated cluster ------------------------------------------------------------


def _crash_loop(sim: Sim) -> None:
    """The job runs, then every launch dies before its first step."""
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)  # no checkpoint yet (every 10 steps)
    for agent in sim.agents.values():
        agent.fail_start = "RuntimeError: CUDA error: an illegal memory access"
    sim.agents["n1"].crash("job")


def _held(sim: Sim) -> bool:
    return sim.c.get_job("job").state == JobState.HELD.value


def _loop_pages(notifier: RecordingNotifier) -> list[str]:
    return [n.reason for n in notifier.sent if n.page and "restart loop" in (n.reason or "")]


def test_a_crash_looping_job_is_held_after_three_restarts_and_pages_the_evidence(
    sim: Sim, core_notifier: RecordingNotifier
) -> None:
    _crash_loop(sim)
    sim.until(lambda: _held(sim), max_s=200, what="the job held")
    job = sim.c.get_job("job")
    assert job.attempt == 4 and job.restarts == 3  # three restarts, no fourth
    assert job.state_reason.startswith("restart loop: 3 restarts in 30 min")
    assert "resumed from scratch" in job.state_reason
    sim.second(60)
    assert sim.c.get_job("job").attempt == 4  # nothing restarts a held job
    assert sorted(a["attempt"] for a in sim.cmds("n1", "start_job")) == [1, 2, 3, 4]
    pages = _loop_pages(core_notifier)
    assert len(pages) == 1
    assert pages[0].count("- restart #") == 3
    assert "CUDA error: an illegal memory access" in pages[0]
    assert "from scratch" in pages[0] and "- then: " in pages[0]
    # the failed restart step's timeline entry carries the same evidence
    failed = [
        a
        for a, _ in sim.c.store.actions.restarts_of("job", since=0.0, limit=10)
        if a.state == "failed" and "restart loop" in a.result
    ]
    assert len(failed) == 1


def test_a_restart_that_reaches_a_new_checkpoint_resets_the_count(sim: Sim) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    for attempt in range(2, 7):  # five crashes, each after a new checkpoint
        sim.second(12)  # past the next checkpoint (every 10 steps)
        sim.agents["n1"].crash("job")
        sim.until(running(sim, attempt=attempt), max_s=60, what=f"attempt {attempt}")
    assert not _held(sim)
    assert sim.c.get_job("job").restarts == 5


def test_an_operator_restart_of_a_held_job_runs_and_the_count_starts_again(
    sim: Sim, core_notifier: RecordingNotifier
) -> None:
    _crash_loop(sim)
    sim.until(lambda: _held(sim), max_s=200, what="the job held")
    for agent in sim.agents.values():
        agent.fail_start = None  # fixed
    sim.c.job_action("job", "restart", actor="ops")
    sim.until(running(sim, attempt=5), max_s=60, what="the operator's restart trains")
    # it crashes again at once: the count starts after the operator's restart
    for agent in sim.agents.values():
        agent.fail_start = "boom"
    sim.agents["n1"].crash("job")
    sim.until(lambda: _held(sim), max_s=200, what="held again")
    assert sim.c.get_job("job").attempt == 8  # three more restarts after the operator's


class _Killed(BaseException):
    """kill -9 of the controller at the point where it is raised."""


def test_a_controller_killed_between_the_decision_and_its_effect_holds_the_job_once(
    sim: Sim, core_notifier: RecordingNotifier, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = JobManager.set_state
    kills = []

    def set_state(self: JobManager, name: str, state: JobState, *, reason: str = ""):
        if state is JobState.HELD and not kills:
            kills.append(name)
            raise _Killed
        return real(self, name, state, reason=reason)

    monkeypatch.setattr(JobManager, "set_state", set_state)
    _crash_loop(sim)
    with pytest.raises(_Killed):
        sim.until(lambda: _held(sim), max_s=200, what="the breaker's decision")
    # the decision is stored, its effect is not
    decided = [
        (a, out)
        for a, out in sim.c.store.actions.restarts_of("job", since=0.0, limit=10)
        if LOOP_KEY in out
    ]
    assert len(decided) == 1 and decided[0][0].state == "running"
    assert not _held(sim) and _loop_pages(core_notifier) == []
    sim.c.stop()
    sim.c = sim.new_controller()
    sim.until(lambda: _held(sim), max_s=30, what="the job held after the restart")
    sim.second(30)
    assert len(_loop_pages(core_notifier)) == 1
    job = sim.c.get_job("job")
    assert job.attempt == 4 and job.state_reason.startswith("restart loop:")
    again = [
        a
        for a, out in sim.c.store.actions.restarts_of("job", since=0.0, limit=10)
        if LOOP_KEY in out
    ]
    assert [a.id for a in again] == [decided[0][0].id]  # decided once


def test_restart_loop_restarts_zero_never_holds(make_core, core_clock, tmp_path: Path) -> None:
    sim = Sim(make_core, core_clock, tmp_path)
    sim.c = sim.make_core(
        rules=[sim.rules],
        jobs={"stop_grace_s": 2.0, "stop_timeout_s": 5.0, "restart_loop_restarts": 0},
        lifecycle={"spare_preflight_ahead": False},
    )
    for name in ("n1", "n2"):
        sim.add(name)
    sim.add("n3", role="spare")
    _crash_loop(sim)
    sim.second(200)
    assert not _held(sim)
    assert sim.c.get_job("job").restarts > 3
