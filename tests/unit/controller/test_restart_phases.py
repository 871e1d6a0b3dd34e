"""The restart step's phases: an enum whose values are the strings the step's saved progress
always held, moves only stop -> start -> confirm -> done, and a restart saved by the previous
version (the same progress keys and phase strings) resumes after an upgrade without starting
a second attempt."""

from __future__ import annotations

import pytest

from tests.unit.controller.job_sim import Sim, running
from trainguard.controller.actions.restartphase import NEXT, RestartPhase, advance

# The progress the previous version saved in each phase a controller can stop in.
PREVIOUS_KEYS = {
    "stop": {
        "phase",
        "job",
        "ckpt_step",
        "last_step",
        "old_pids",
        "stop_sent_at",
        "stopping",
        "stop_nodes",
        "stop_attempt",
    },
}
PREVIOUS_KEYS["confirm"] = PREVIOUS_KEYS["stop"] | {"attempt", "nodes", "started_at"}


def test_the_phases_are_the_strings_the_progress_always_held() -> None:
    assert [p.value for p in RestartPhase] == ["stop", "start", "confirm", "done"]
    assert RestartPhase.stored({}) is RestartPhase.STOP  # a step not begun yet
    for value in ("stop", "confirm", "done"):
        assert RestartPhase.stored({"phase": value}).value == value


def test_the_phases_move_in_one_line() -> None:
    assert NEXT == {
        RestartPhase.STOP: RestartPhase.START,
        RestartPhase.START: RestartPhase.CONFIRM,
        RestartPhase.CONFIRM: RestartPhase.DONE,
        RestartPhase.DONE: None,
    }
    assert advance(RestartPhase.STOP, RestartPhase.START) is RestartPhase.START


@pytest.mark.parametrize(
    ("current", "wanted"),
    [
        (RestartPhase.STOP, RestartPhase.CONFIRM),
        (RestartPhase.CONFIRM, RestartPhase.STOP),
        (RestartPhase.DONE, RestartPhase.STOP),
        (RestartPhase.START, RestartPhase.DONE),
    ],
    ids=["stop-skips-start", "confirm-back-to-stop", "done-again", "start-skips-confirm"],
)
def test_a_phase_move_outside_the_line_is_refused(
    current: RestartPhase, wanted: RestartPhase
) -> None:
    with pytest.raises(ValueError, match=f"from {current.value} to {wanted.value}"):
        advance(current, wanted)


def test_an_unknown_stored_phase_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown phase 'paused'"):
        RestartPhase.stored({"phase": "paused"})


@pytest.mark.parametrize("phase", ["stop", "confirm"])
def test_a_restart_saved_by_the_previous_version_resumes_after_an_upgrade(
    sim: Sim, phase: str
) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)
    action = sim.c.job_action("job", "restart", actor="ops")

    def saved() -> dict[str, object]:
        return sim.c.store.actions.output(action.id)

    sim.until(lambda: saved().get("phase") == phase, max_s=10, what=f"restart in {phase}")
    # what is on disk is what the previous version wrote in this phase: plain strings
    progress = saved()
    assert type(progress["phase"]) is str and progress["phase"] == phase
    assert set(progress) == PREVIOUS_KEYS[phase]
    # the controller is replaced (an upgrade) and takes the step up from the stored row
    sim.c.stop()
    sim.c = sim.new_controller()
    sim.until(running(sim, attempt=2), max_s=20, what="restart confirmed after the upgrade")
    sim.until(
        lambda: sim.c.store.actions.get(action.id).state == "succeeded",
        max_s=5,
        what="restart step succeeded",
    )
    assert saved()["phase"] == "done"
    starts = sorted(a["attempt"] for n in ("n1", "n2") for a in sim.cmds(n, "start_job"))
    assert starts == [1, 1, 2, 2]
    assert sim.c.get_job("job").attempt == 2
