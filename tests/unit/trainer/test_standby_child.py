"""The warm standby's assignment line: a bare Membership, or the membership with the job's
environment the agent adds; anything else is refused."""

from __future__ import annotations

import json

import pytest

from trainguard.membership import Membership
from trainguard.trainer.standby_child import parse_assignment

M = Membership(rank=1, world_size=2, store_host="10.0.0.1", store_port=29650, epoch=4)


def test_a_bare_membership_is_an_assignment_without_environment() -> None:
    assert parse_assignment(M.to_json()) == (M, {})


def test_the_agents_assignment_carries_the_jobs_environment() -> None:
    line = json.dumps({"membership": json.loads(M.to_json()), "env": {"TRAINGUARD_JOB": "llm"}})
    assert parse_assignment(line) == (M, {"TRAINGUARD_JOB": "llm"})


@pytest.mark.parametrize(
    "line",
    [
        json.dumps({"membership": json.loads(M.to_json()), "envs": {}}),
        json.dumps({"membership": json.loads(M.to_json()), "env": {"A": 1}}),
        json.dumps({"membership": {"rank": 1}}),
    ],
    ids=["unknown-key", "env-not-strings", "membership-incomplete"],
)
def test_a_malformed_assignment_is_refused(line: str) -> None:
    with pytest.raises(ValueError):
        parse_assignment(line)
