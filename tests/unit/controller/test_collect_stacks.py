"""collect_stacks keeps the stack text the agents return (their command_result data), bounded
and cut with a marker, in the step's output and its timeline entry, and `agentctl describe
incident` prints it as a block (FakeClock, FakeJobAgents, real SQLite)."""

from __future__ import annotations

import io

import pytest

from tests.unit.controller.job_sim import JOB_RULES, Sim, running
from trainguard.controller.actions.jobsteps import bounded_text
from trainguard.controller.cli.format import write_object

# stands in for rank_silent / training_stall (the fake agent does not age heartbeats): a rank
# condition the test turns on and off, with the same plan
STALL = """
  - name: training_stall
    scope: rank
    condition: loss > 100
    severity: critical
    actions: [notify, collect_stacks, restart]
    summary: training stalled
"""


def _stall_and_restart(sim: Sim) -> object:
    with open(sim.rules, "w") as f:
        f.write(JOB_RULES + STALL)
    sim.c.reload_rules(actor="test")
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)
    sim.agents["n1"].loss = 1000.0

    def stacks_done() -> bool:
        found = [i for i in sim.c.list_incidents() if i.rule == "training_stall"]
        actions = sim.c.get_incident(found[0].id).actions if found else ()
        return any(a.kind == "collect_stacks" and a.state == "succeeded" for a in actions)

    sim.until(stacks_done, max_s=60, what="stacks collected")
    sim.agents["n1"].loss = 1.0
    sim.until(running(sim, attempt=2), max_s=30, what="restart after the stall")
    return sim.incident("training_stall")


def test_stacks_from_every_node_are_in_the_step_output_and_its_timeline_entry(
    sim: Sim,
) -> None:
    sim.agents["n2"].stacks = "--- rank 1 pid 77 ---\nThread 0x1 (most recent call first):\n  hung"
    detail = _stall_and_restart(sim)
    step = next(a for a in detail.actions if a.kind == "collect_stacks")
    assert (step.state, step.result) == ("succeeded", "stacks from 2 of 2 node(s)")
    output = sim.c.store.actions.output(step.id)
    assert output["stacks"]["n1"] == sim.agents["n1"].stacks
    assert output["stacks"]["n2"] == sim.agents["n2"].stacks
    assert output["results"] == {"n1": "stacks of 1 of 1 rank(s)", "n2": "stacks of 1 of 1 rank(s)"}
    (entry,) = [
        t
        for t in detail.timeline
        if t.kind == "action_succeeded" and t.data.get("action_id") == step.id
    ]
    assert entry.data["stacks"] == output["stacks"]


def test_long_stacks_are_cut_per_node_with_a_marker_naming_the_full_log(
    sim: Sim,
) -> None:
    sim.agents["n1"].stacks = "x" * 20000
    detail = _stall_and_restart(sim)
    step = next(a for a in detail.actions if a.kind == "collect_stacks")
    text = sim.c.store.actions.output(step.id)["stacks"]["n1"]
    assert text.startswith("x" * 8000)
    assert text.endswith(
        "\n[... 12000 chars cut; the whole dump is in n1:/var/lib/trainguard/job.log ...]"
    )


@pytest.mark.parametrize(
    ("text", "limit", "expected"),
    [
        pytest.param("abc", 3, "abc", id="fits"),
        pytest.param("abcdef", 4, "abcd\n[... 2 chars cut ...]", id="cut-without-log"),
    ],
)
def test_bounded_text(text: str, limit: int, expected: str) -> None:
    assert bounded_text(text, limit_chars=limit) == expected


def test_describe_prints_multiline_text_as_an_indented_block() -> None:
    out = io.StringIO()
    entry = {"kind": "action_succeeded", "data": {"stacks": {"n1": "--- rank 0 ---\n  File x"}}}
    write_object(out, {"timeline": [entry]}, 0.0)
    assert "      stacks:\n        n1: |\n          --- rank 0 ---\n            File x\n" in (
        out.getvalue()
    )
