"""The chaos tests' one-live-attempt check on recorded agent log lines: it passes when every
launch of attempt 1 ended before attempt 2 began, and finds an overlap, a launch repeated on
a node and a launch that never ended (no cluster: the agents are stand-ins holding logs)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import pytest

from tests.e2e.chaos import check_one_live_attempt, launches
from trainguard.devkit.devcluster import ClusterError, DevCluster, wait_until


@dataclass
class _Proc:
    text: str

    def log(self) -> str:
        return self.text


@dataclass
class _Agent:
    proc: _Proc


class _Cluster:
    def __init__(self, logs: dict[str, list[str]]) -> None:
        self.agents = {n: _Agent(_Proc("\n".join(lines) + "\n")) for n, lines in logs.items()}

    def wait(self, cond: Callable[[], Any], *, timeout_s: float, what: str) -> Any:
        return wait_until(cond, timeout_s=0.2, what=what, interval_s=0.05)


def line(node: str, hms: str, what: str, attempt: int, pid: int) -> str:
    tail = " user=root uid=0" if what == "started" else " exit_code=0 stopped=False"
    return (
        f"ts=2026-01-02 {hms} level=INFO node={node} logger=trainguard.agent.jobs "
        f"event=job_{what} job=j attempt={attempt} pid={pid}{tail}"
    )


def cluster(logs: dict[str, list[str]]) -> DevCluster:
    return cast(DevCluster, _Cluster(logs))


CLEAN = {
    "a": [line("a", "10:00:00,000", "started", 1, 11), line("a", "10:00:20,100", "exited", 1, 11)],
    "b": [line("b", "10:00:00,050", "started", 1, 12), line("b", "10:00:20,400", "exited", 1, 12)],
    "c": [line("c", "10:00:21,000", "started", 2, 13), line("c", "10:00:40,000", "exited", 2, 13)],
}


def test_attempts_one_after_the_other_pass_and_are_read_with_milliseconds() -> None:
    found = check_one_live_attempt(cluster(CLEAN), "j")
    assert [(x.node, x.attempt, x.pid) for x in found] == [("a", 1, 11), ("b", 1, 12), ("c", 2, 13)]
    assert round(found[1].exited_at - found[0].exited_at, 3) == 0.3  # type: ignore[operator]
    assert launches(cluster(CLEAN), "other") == []


def test_a_launch_of_attempt_1_ending_after_attempt_2_began_is_an_overlap() -> None:
    logs = dict(CLEAN)
    logs["b"] = [CLEAN["b"][0], line("b", "10:00:21,001", "exited", 1, 12)]
    with pytest.raises(AssertionError, match="attempt 1 still ran"):
        check_one_live_attempt(cluster(logs), "j")


def test_one_attempt_launched_twice_on_a_node_fails() -> None:
    logs = dict(CLEAN)
    logs["c"] = [*CLEAN["c"], line("c", "10:00:41,000", "started", 2, 14)]
    logs["c"].append(line("c", "10:00:50,000", "exited", 2, 14))
    with pytest.raises(AssertionError, match="launched twice"):
        check_one_live_attempt(cluster(logs), "j")


def test_a_launch_with_no_exit_fails_unless_its_node_was_killed_before_the_next_attempt() -> None:
    logs = dict(CLEAN)
    logs["b"] = [CLEAN["b"][0]]
    with pytest.raises(ClusterError, match="every launch of j to exit"):
        check_one_live_attempt(cluster(logs), "j")
    # the node (its agent with it) killed before attempt 2 began: no overlap; after: one
    found = launches(cluster(CLEAN), "j")
    check_one_live_attempt(cluster(logs), "j", ended={"b": found[2].started_at - 1})
    with pytest.raises(AssertionError, match="attempt 1 still ran"):
        check_one_live_attempt(cluster(logs), "j", ended={"b": found[2].started_at + 1})
