"""controller.growplan.plan_grows on plain snapshots: which shrunk job grows back, with
which spares, and every condition that holds a grow back."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from trainguard.controller.growplan import (
    GROW_SETTLE_S,
    Grow,
    GrowIncident,
    GrowJob,
    GrowNode,
    GrowStep,
    grow_key,
    plan_grows,
)

NOW = 1000.0
JOB = GrowJob(
    name="job",
    state="running",
    attempt=2,
    nodes=("n2",),
    nproc_per_node=2,
    full_world_size=4,
    shrink="world",
    spare_selector={"pool": "a"},
    confirmed_at=NOW - GROW_SETTLE_S,
)
NODES = (
    GrowNode(name="n2", role="active", state="active", reporting=True, job="job"),
    GrowNode(name="s1", role="spare", state="active", reporting=True, labels={"pool": "a"}),
    GrowNode(name="s2", role="spare", state="active", reporting=True, labels={"pool": "a"}),
)


def plan(
    *,
    jobs: tuple[GrowJob, ...] = (JOB,),
    nodes: tuple[GrowNode, ...] = NODES,
    steps: tuple[GrowStep, ...] = (),
    incidents: tuple[GrowIncident, ...] = (),
) -> list[Grow]:
    return plan_grows(
        jobs=jobs,
        nodes=nodes,
        spares=[n for n in nodes if n.role == "spare"],
        open_steps=steps,
        incidents=incidents,
        now=NOW,
    )


def spare(name: str, **changes: Any) -> tuple[GrowNode, ...]:
    """NODES with spare `name` changed (the other spare taken by another job)."""
    other = "s2" if name == "s1" else "s1"
    return tuple(
        replace(n, **changes)
        if n.name == name
        else replace(n, job="other")
        if n.name == other
        else n
        for n in NODES
    )


def test_a_shrunk_running_job_grows_with_the_first_free_spare():
    assert plan() == [Grow(job="job", attempt=2, spares=("s1",), ranks_from=2, ranks_to=4)]
    assert plan()[0].key == grow_key("job", 2) == "grow:job:2"


def test_two_jobs_never_take_the_same_spare():
    other = replace(JOB, name="other", nodes=("n9",))
    nodes = (*NODES, GrowNode(name="n9", role="active", state="active", reporting=True))
    grows = plan(jobs=(JOB, other), nodes=nodes)
    assert [(g.job, g.spares) for g in grows] == [("job", ("s1",)), ("other", ("s2",))]


def test_a_job_missing_two_nodes_needs_two_spares():
    job = replace(JOB, full_world_size=6)
    assert plan(jobs=(job,))[0].spares == ("s1", "s2")
    assert plan(jobs=(job,), nodes=spare("s1")) == []


@pytest.mark.parametrize(
    "job",
    [
        replace(JOB, shrink="pack"),
        replace(JOB, nodes=("n2", "s9")),
        replace(JOB, state="restarting"),
        replace(JOB, state="waiting"),
        replace(JOB, confirmed_at=None),
        replace(JOB, confirmed_at=NOW - GROW_SETTLE_S + 0.5),
        replace(JOB, growable=False),
        replace(JOB, full_world_size=5),
    ],
    ids=[
        "shrink-pack",
        "at-full-size",
        "not-running",
        "waiting",
        "attempt-not-confirmed",
        "confirmed-too-recently",
        "backend-cannot-grow",
        "full-size-not-a-whole-node",
    ],
)
def test_no_grow_for_a_job_that_is_not_a_settled_shrunk_torchrun_job(job):
    nodes = (*NODES, GrowNode(name="s9", role="active", state="active", reporting=True))
    assert plan(jobs=(job,), nodes=nodes) == []


@pytest.mark.parametrize(
    "step",
    [
        GrowStep(kind="restart", job="job"),
        GrowStep(kind="drain", node="n2"),
        GrowStep("grow", "job"),
    ],
    ids=["step-on-the-job", "step-on-its-node", "its-grow-still-open"],
)
def test_no_grow_while_a_step_is_open_on_the_job_or_its_nodes(step):
    assert plan(steps=(step,)) == []


def test_a_step_on_another_job_or_node_does_not_hold_the_grow():
    steps = (GrowStep(kind="restart", job="other"), GrowStep(kind="drain", node="n7"))
    assert len(plan(steps=steps)) == 1


@pytest.mark.parametrize(
    ("incident", "grows"),
    [
        (GrowIncident(state="open", job="job"), False),
        (GrowIncident(state="acting", node="n2"), False),
        (GrowIncident(state="mitigated", node="n2"), True),
        (GrowIncident(state="acting", node="n1"), True),
    ],
    ids=["open-on-the-job", "acting-on-its-node", "mitigated-on-its-node", "on-a-node-it-left"],
)
def test_an_open_or_acting_incident_on_the_job_or_its_nodes_holds_the_grow(incident, grows):
    assert bool(plan(incidents=(incident,))) is grows


def test_no_grow_while_a_node_of_the_job_is_not_reporting():
    nodes = tuple(replace(n, reporting=False) if n.name == "n2" else n for n in NODES)
    assert plan(nodes=nodes) == []


@pytest.mark.parametrize(
    "changes",
    [
        {"labels": {"pool": "b"}},
        {"labels": {}},
        {"reporting": False},
        {"state": "drained"},
        {"job": "other"},
        {"role": "active"},
    ],
    ids=["other-pool", "no-labels", "not-reporting", "drained", "taken-by-a-job", "not-a-spare"],
)
def test_a_spare_that_is_not_free_and_matching_is_not_used(changes):
    assert plan(nodes=spare("s1", **changes)) == []


def test_a_spare_with_an_open_incident_is_not_used():
    incident = GrowIncident(state="mitigated", node="s1")
    grows = plan(nodes=spare("s1"), incidents=(incident,))
    assert grows == []
    assert plan(incidents=(incident,))[0].spares == ("s2",)
