"""Local drain backend against the real Controller's node operations."""

from __future__ import annotations

import pytest

from tests.builders import Reporter
from trainguard.controller.actions.base import PermanentError
from trainguard.controller.actions.drain import LocalDrainBackend


def test_idle_node_drains_at_once_and_repeat_is_a_no_op(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    backend = LocalDrainBackend(c)
    assert backend.drain("n1", reason="r", key="k")[0] == "drained"
    assert backend.drain("n1", reason="r", key="k")[0] == "drained"
    assert c.pending_commands("n1") == []


def test_busy_node_gets_one_stop_job_command_per_key(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now(), job="job-a"), actor="a")
    backend = LocalDrainBackend(c, stop_grace_s=12.0)
    state, progress = backend.drain("n1", reason="r", key="k")
    backend.drain("n1", reason="r", key="k")
    assert state == "draining" and c.node_state("n1") == "draining"
    (cmd,) = c.pending_commands("n1")
    assert cmd.kind == "stop_job" and cmd.args == {"job": "job-a", "grace_s": 12.0}
    assert backend.poll("n1", key="k", progress=progress) == "draining"


def test_a_job_killed_at_once_is_drained_without_waiting_for_the_stop(make_core, core_clock):
    # a job recovered in process: its ranks on the node are fenced by the next epoch
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now(), job="job-a"), actor="a")
    backend = LocalDrainBackend(c, stop_grace_s=12.0, grace_of=lambda job: 0.0)
    state, progress = backend.drain("n1", reason="r", key="k")
    assert (state, c.node_state("n1"), progress["fenced"]) == ("drained", "drained", True)
    (cmd,) = c.pending_commands("n1")
    assert cmd.kind == "stop_job" and cmd.args == {"job": "job-a", "grace_s": 0.0}


def test_undrain_returns_node_to_active(make_core, core_clock):
    c = make_core()
    c.ingest_report(Reporter("n1").report(now=core_clock.now()), actor="a")
    backend = LocalDrainBackend(c)
    backend.drain("n1", reason="r", key="k")
    backend.undrain("n1", key="u")
    assert c.node_state("n1") == "active"


def test_unknown_node_is_a_permanent_error(make_core):
    backend = LocalDrainBackend(make_core())
    with pytest.raises(PermanentError, match="unknown node"):
        backend.drain("ghost", reason="r", key="k")
