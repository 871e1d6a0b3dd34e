"""The node lifecycle's operator steps on a real controller over a FakeClock: `node return`
validates a drained or retired node with a preflight and brings it back only on a pass (a
failing or unanswered one keeps it drained with the reason); `node retire` takes it out for
good. Both survive a controller killed mid-step without running anything twice."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client import generate_latest

from tests.unit.controller.job_sim import Sim
from trainguard.controller.errors import BadRequest, Conflict


def _steps(sim: Sim, kind: str) -> list[tuple[str, str]]:
    rows = sim.c.store.db.query(
        "SELECT state, result FROM actions WHERE kind = ? ORDER BY id", (kind,)
    )
    return [(str(r[0]), str(r[1])) for r in rows]


def _drained(sim: Sim, node: str = "n3") -> None:
    """The `sim` fixture's spare n3 (or `node`), drained by an operator."""
    sim.c.drain(node, reason="xid 79 on gpu 3", actor="ops")
    assert sim.c.get_node(node).state == "drained"


def test_return_validates_with_a_preflight_and_brings_a_spare_back(sim: Sim) -> None:
    _drained(sim)
    view = sim.c.return_node("n3", actor="ops")
    assert view.state == "validating"
    sim.until(lambda: sim.c.get_node("n3").state == "active", max_s=5, what="back in service")
    node = sim.c.get_node("n3")
    assert node.role == "spare" and node.drain_reason is None
    assert "n3" in [n.name for n in sim.c.list_spares()]
    (preflight,) = sim.cmds("n3", "preflight")
    assert preflight["checks"] == [
        "nvml_health",
        "row_remaps",
        "ecc",
        "compute_burn",
        "collective_bandwidth",
        "ckpt_storage",
    ]
    assert node.last_preflight is not None and node.last_preflight.passed
    assert node.last_preflight.summary.startswith("passed (nvml_health, row_remaps")
    assert len(node.last_preflight.checks) == 6 and node.last_preflight.duration_s == 3.0
    assert _steps(sim, "validate") == [
        ("succeeded", "n3 passed its preflight and is back in service")
    ]
    assert ("ops", "validate") in [(a.actor, a.action) for a in sim.c.audit_log()]


def test_a_failing_preflight_keeps_the_node_drained_with_the_reason(sim: Sim) -> None:
    _drained(sim)
    sim.agents["n3"].preflight_fails = {"ecc": "2 uncorrectable errors on gpu 3"}
    sim.c.return_node("n3", actor="ops")
    sim.until(lambda: sim.c.get_node("n3").state != "validating", max_s=5, what="result")
    node = sim.c.get_node("n3")
    assert node.state == "drained"
    assert node.drain_reason == "preflight failed: ecc: 2 uncorrectable errors on gpu 3"
    assert node.last_preflight is not None and not node.last_preflight.passed
    assert "n3" not in [n.name for n in sim.c.list_spares()]
    ((state, result),) = _steps(sim, "validate")
    assert state == "failed" and "ecc: 2 uncorrectable" in result


def test_an_unanswered_preflight_fails_after_the_timeout(
    make_core, core_clock, tmp_path: Path
) -> None:
    sim = Sim(make_core, core_clock, tmp_path)
    sim.c = sim.make_core(rules=[sim.rules], lifecycle={"preflight_timeout_s": 5.0})
    sim.add("n3", role="spare")
    _drained(sim)
    sim.agents["n3"].preflight_answers = False
    sim.c.return_node("n3", actor="ops")
    sim.second(4)
    assert sim.c.get_node("n3").state == "validating"
    sim.until(lambda: sim.c.get_node("n3").state == "drained", max_s=5, what="timeout")
    assert sim.c.get_node("n3").drain_reason == "preflight did not answer within 5 s"
    assert len(sim.cmds("n3", "preflight")) == 1


def test_a_controller_killed_mid_validation_resumes_it_without_a_second_preflight(
    sim: Sim,
) -> None:
    _drained(sim)
    sim.agents["n3"].preflight_answers = False  # queued and delivered, not answered yet
    sim.c.return_node("n3", actor="ops")
    sim.second(2)
    assert len(sim.cmds("n3", "preflight")) == 1
    sim.c = sim.new_controller()  # kill -9: the old one never stops; the store is all that is left
    assert sim.c.get_node("n3").state == "validating"
    sim.agents["n3"].preflight_answers = True
    sim.agents["n3"]._preflight(sim.agents["n3"].commands[-1])  # the answer arrives late
    sim.until(lambda: sim.c.get_node("n3").state == "active", max_s=10, what="resumed")
    assert len(sim.cmds("n3", "preflight")) == 1
    assert [s for s, _ in _steps(sim, "validate")] == ["succeeded"]


def test_only_a_drained_or_retired_node_returns(sim: Sim) -> None:
    with pytest.raises(Conflict, match="n3 is active: only a drained or retired node returns"):
        sim.c.return_node("n3", actor="ops")


def test_retire_takes_a_spare_out_for_good_and_return_brings_it_back(sim: Sim) -> None:
    node = sim.c.retire("n3", reason="RMA 4411: row remap failures", actor="ops")
    assert (node.state, node.drain_reason) == ("retired", "retired: RMA 4411: row remap failures")
    assert "n3" not in [n.name for n in sim.c.list_spares()]
    with pytest.raises(BadRequest, match="node lifecycle holds it"):
        sim.c.undrain("n3", actor="ops")
    assert sim.c.get_node("n3").state == "retired"
    sim.c.return_node("n3", actor="ops")
    sim.until(lambda: sim.c.get_node("n3").state == "active", max_s=5, what="back from RMA")
    actions = [a.action for a in sim.c.audit_log() if a.target == "n3"]
    assert {"retire", "undrain", "validate"} <= set(actions)


def test_retire_refuses_a_blank_reason_and_a_node_running_a_job(sim: Sim) -> None:
    with pytest.raises(BadRequest, match=r"^reason: "):
        sim.c.retire("n3", reason="  ", actor="ops")
    sim.submit(nodes=["n1"])
    sim.until(lambda: sim.c.get_job("job").state == "running", max_s=10, what="job runs")
    with pytest.raises(BadRequest, match="n1 runs job job: drain it first"):
        sim.c.retire("n1", reason="RMA", actor="ops")
    assert sim.c.get_node("n1").state == "active"


def test_the_node_gauge_counts_every_lifecycle_state(sim: Sim) -> None:
    sim.c.retire("n3", reason="RMA", actor="ops")
    sim.second()
    text = generate_latest(sim.c.metrics.registry).decode()
    assert 'trainguard_controller_nodes{role="spare",state="retired"} 1.0' in text
    assert 'trainguard_controller_nodes{role="active",state="validating"} 0.0' in text
