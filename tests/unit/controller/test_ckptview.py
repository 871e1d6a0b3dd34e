"""`agentctl describe job` shows the checkpoint interval advice in words (controller.cli
.ckptview): current and optimal side by side with their expected waste; JSON stays numbers."""

from __future__ import annotations

import json

from trainguard.controller.ckptinterval import advise
from trainguard.controller.cli.format import render
from trainguard.protocol import to_wire


def _job() -> dict[str, object]:
    advice = advise(
        checkpoint_s=300, restart_s=600, node_mtbf_s=96 * 3600, nodes=8, current_s=1800,
        step_time_s=2.0,
    )  # fmt: skip
    return {"name": "llm", "state": "running", "checkpoint_interval": to_wire(advice)}


def test_describe_job_shows_current_and_optimal_interval_with_their_waste() -> None:
    text = render("job", _job(), output="table", now=0.0)
    assert "current:         30m00s (every 900 steps), expected waste 20.1%" in text
    assert "optimal:         1h21m (every 2447 steps), expected waste 13.2%" in text
    assert "(Daly; Young 1h24m)" in text
    assert "mtbf:            12h00m (node 4.0d)" in text


def test_json_output_keeps_the_numbers() -> None:
    data = json.loads(render("job", _job(), output="json", now=0.0))
    assert round(data["checkpoint_interval"]["optimal_s"]) == 4893
    assert data["checkpoint_interval"]["current_every_steps"] == 900


def test_a_job_without_periodic_checkpoints_says_so() -> None:
    job = _job()
    advice = dict(job["checkpoint_interval"])  # type: ignore[call-overload]
    advice.update(current_s=None, current_waste=None, current_every_steps=None)
    text = render("job", {**job, "checkpoint_interval": advice}, output="table", now=0.0)
    assert "current:         - (no periodic checkpoints reported)" in text


def test_describe_job_shows_where_the_interval_comes_from() -> None:
    text = render("job", _job(), output="table", now=0.0)
    assert "source:          the program's own" in text
    auto = {
        **_job(),
        "checkpoint_interval_source": "auto",
        "checkpoint_every_steps": 2447,
        "checkpoint_interval_changes": [{"ts": 0.0, "kind": "checkpoint_interval"}],
    }
    text = render("job", auto, output="table", now=0.0)
    assert "source:          auto (set by the controller, every 2447 steps, 1 change(s))" in text
    fixed = {**_job(), "checkpoint_interval_source": "fixed", "checkpoint_every_steps": 900}
    text = render("job", fixed, output="table", now=0.0)
    assert "source:          fixed (job spec, every 900 steps)" in text
