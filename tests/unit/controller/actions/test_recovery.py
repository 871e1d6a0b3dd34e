"""controller.actions.recovery, the pieces every backend's restart step shares: which rank
confirms the new run, and the one shape of a confirmed restart's result."""

from __future__ import annotations

from typing import Any

from trainguard.controller.actions.base import ActionContext
from trainguard.controller.actions.recovery import first_step_past, restart_confirmed
from trainguard.controller.views import ActionView
from trainguard.protocol import RankState


def _rank(step: int, *, pid: int, phase: str = "train") -> RankState:
    return RankState(job="job", rank=0, step=step, pid=pid, phase=phase)


def test_only_a_rank_of_the_new_run_past_the_checkpoint_confirms_it() -> None:
    ranks = [
        ("n1", _rank(30, pid=1)),  # the stopped run's rank, by its pid
        ("n9", _rank(31, pid=5)),  # a node outside the new set
        ("n2", _rank(12, pid=6, phase="exit")),  # exiting
        ("n2", _rank(10, pid=7)),  # at the checkpoint, not past it
        ("n3", _rank(14, pid=8)),  # on a node that still runs something older
    ]
    common: dict[str, Any] = {"nodes": {"n1", "n2", "n3"}, "floor": 10, "old_pids": {1}}
    assert first_step_past(ranks, **common) == 14
    assert first_step_past(ranks, **common, stale=lambda node: node == "n3") is None
    assert first_step_past([*ranks, ("n2", _rank(11, pid=9))], **common) == 11


def test_a_confirmed_restart_reports_its_phases_and_lost_steps_once() -> None:
    view = ActionView(
        id=1, incident_id=None, kind="restart", target="job", state="running", attempts=1,
        idempotency_key="k", created_at=0.0, updated_at=0.0, params={},
    )  # fmt: skip
    ctx = ActionContext(action=view, incident=None, now=50.0, attempt=1)
    observed: list[tuple[dict[str, float], int | None]] = []
    progress = {"ckpt_step": 15, "last_step": 20, "stop_sent_at": 40.0, "started_at": 40.0}
    outcome = restart_confirmed(
        ctx, progress, first=16, phases={"restart": 10.0},
        observe=lambda phases, lost: observed.append((phases, lost)),
        what="Slurm job 7 (restart 1)", where=" on n1,n4",
    )  # fmt: skip
    assert observed == [({"restart": 10.0}, 5)]
    assert outcome.done and outcome.message == (
        "Slurm job 7 (restart 1) trains past checkpoint 15 on n1,n4 (step 16); restart 10.0 s;"
        " lost steps 5"
    )
    assert outcome.output == {
        **progress,
        "phase": "done",
        "first_step": 16,
        "restarted_at": 50.0,
        "phases_s": {"restart": 10.0},
        "lost_steps": 5,
    }
