"""Lemon nodes on the FakeClock sim: a node with lifecycle.lemon_incidents hardware incidents
within lifecycle.lemon_window_s is retired (flagged for RMA) when it is drained next, and a
lemon spare leaves the pool before any preflight; the history in `describe node` and on
/metrics; incidents outside the window or of other kinds do not count."""

from __future__ import annotations

from prometheus_client import generate_latest

from tests.builders import gpu
from tests.integration.postgres_proc import BOTH_STORES
from tests.unit.controller.job_sim import Sim, running

_DAY_S = 86400.0


def _past_incident(sim: Sim, node: str, *, rule: str = "gpu_dbe", days_ago: float = 1.0) -> int:
    """A resolved incident of `rule` on `node`, opened `days_ago` days before now."""
    ts = sim.clock.now() - days_ago * _DAY_S
    store = sim.c.store
    incident_id = store.incidents.create(
        rule=rule,
        target_key=f"{node}/gpu0/{ts}",
        target={"node": node},
        target_text=f"{node} gpu 0",
        severity="critical",
        summary=f"{rule} on {node}",
        node=node,
        job=None,
        ts=ts,
        timeline=(),
    )
    store.incidents.set_state(incident_id, "resolved", ts=ts + 60, kind="resolved", message="ok")
    return incident_id


@BOTH_STORES
def test_a_node_over_the_threshold_is_retired_when_it_is_drained_next(sim: Sim) -> None:
    _past_incident(sim, "n1", days_ago=20)
    _past_incident(sim, "n1", rule="xid_fatal", days_ago=3)
    _past_incident(sim, "n1", days_ago=40)  # outside the 30-day window
    _past_incident(sim, "n1", rule="nan_loss", days_ago=2)  # not hardware
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    node = sim.c.get_node("n1")
    assert node.state == "retired"
    assert node.drain_reason == "lemon: 3 hardware incidents in 30 days"
    assert [h.rule for h in node.hardware_incidents] == ["gpu_dbe", "xid_fatal", "gpu_dbe"]
    sim.second()
    text = generate_latest(sim.c.metrics.registry).decode()
    assert 'trainguard_controller_node_hardware_incidents{node="n1"} 3.0' in text
    assert 'trainguard_controller_node_hardware_incidents{node="n2"} 0.0' in text
    # a node below the threshold stays drained as before
    assert sim.c.get_node("n2").state == "active"


def test_below_the_threshold_a_drained_node_stays_drained(sim: Sim) -> None:
    _past_incident(sim, "n1", days_ago=5)
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    node = sim.c.get_node("n1")
    assert node.state == "drained" and len(node.hardware_incidents) == 2


def test_a_lemon_spare_is_retired_from_the_pool_before_any_preflight(sim: Sim) -> None:
    sim.add("n4", role="spare")
    for days in (1, 2, 3):
        _past_incident(sim, "n3", days_ago=days)
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the next spare")
    assert set(sim.c.get_job("job").nodes) == {"n2", "n4"}
    node = sim.c.get_node("n3")
    assert node.state == "retired"
    assert node.drain_reason == "lemon: 3 hardware incidents in 30 days"
    assert sim.cmds("n3", "preflight") == [] and sim.cmds("n3", "start_job") == []
    assert "n3" not in [n.name for n in sim.c.list_spares()]
