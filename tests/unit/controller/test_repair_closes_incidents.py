"""A DBE on the FakeClock sim with the shipped rules' windows and cooldowns (an ECC rule and a
fatal-XID rule): one DBE is one hardware incident in the node's lemon history, whatever the
order its two signals arrive in; after the repair, the passing validation ends the node's
hardware incidents (in their timelines) and starts its signal windows over, so a new XID on
the same GPU opens a new incident and is remediated, also across a controller restart; an
old XID replayed after a restart opens nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.builders import gpu
from tests.unit.controller.test_node_repair import DBE_XID, RepairSim
from trainguard.clock import FakeClock
from trainguard.controller.composition import Controller

# the shipped gpu_uncorrectable_ecc and gpu_fatal_xid (rules/default.yaml), beside the sim's
SHIPPED_GPU_RULES = """
  - name: gpu_uncorrectable_ecc
    scope: gpu
    condition: increase(ecc_uncorrected_volatile_total[10m]) > 0
    severity: critical
    actions: [notify, checkpoint, drain, replace, restart]
    cooldown: 15m
    summary: uncorrectable ECC (double-bit) error
  - name: gpu_fatal_xid
    scope: gpu
    condition: increase(xid_fatal_total[5m]) > 0
    severity: critical
    actions: [notify, checkpoint, drain, replace, restart]
    cooldown: 15m
    summary: fatal XID
"""


class WindowSim(RepairSim):
    RULES = "rules:" + SHIPPED_GPU_RULES


@pytest.fixture
def make_sim(
    make_core: Callable[..., Controller], core_clock: FakeClock, tmp_path: Path
) -> Callable[..., WindowSim]:
    def make(**lifecycle: Any) -> WindowSim:
        s = WindowSim(make_core, core_clock, tmp_path, **lifecycle)
        for name in ("n1", "n2"):
            s.add(name)
        s.add("n3", role="spare")
        for agent in s.agents.values():
            agent.gpus = (gpu(0),)  # a healthy GPU 0 first: a counter's rise is an increase
        return s

    return make


def _dbe(sim: WindowSim, node: str, *, xid_first_s: int = 0, dbe: int = 1) -> None:
    """GPU 0 of `node` reports a DBE: XID 48 and its ECC counter, `xid_first_s` apart."""
    sim.agents[node].event("xid", gpu=0, code=48, message=DBE_XID)
    if xid_first_s:
        sim.second(xid_first_s)
    sim.agents[node].gpus = (gpu(0, dbe=dbe),)


def _back(sim: WindowSim, node: str) -> None:
    sim.until(lambda: sim.c.get_node(node).state == "active", max_s=30, what=f"{node} back")


def _incidents(sim: WindowSim, node: str = "n3") -> list[tuple[str, str]]:
    return sorted(
        (i.rule, i.state) for i in sim.c.list_incidents() if i.target.startswith(f"gpu:{node}:")
    )


# the ECC counter seconds after the XID: the node is already in the lifecycle (diagnosing,
# repairing) when the ECC rule fires; it is the same fault's other signal, not a new fault
@pytest.mark.parametrize(
    "xid_first_s", [0, 1, 3, 5], ids=["same-report", "ecc-1s-later", "ecc-3s-later", "ecc-5s-later"]
)
def test_one_dbe_is_one_hardware_incident(
    make_sim: Callable[..., WindowSim], xid_first_s: int
) -> None:
    sim = make_sim()
    sim.second(2)
    _dbe(sim, "n3", xid_first_s=xid_first_s)
    sim.second(2)
    _back(sim, "n3")
    assert len(sim.c.get_node("n3").hardware_incidents) == 1
    assert len(_incidents(sim)) == 1


def test_a_passing_validation_ends_the_incident_and_the_next_xid_is_a_new_one(
    make_sim: Callable[..., WindowSim],
) -> None:
    sim = make_sim()
    sim.second(2)
    _dbe(sim, "n3")
    sim.second(2)
    _back(sim, "n3")
    (first,) = sim.c.list_incidents()
    assert first.state == "resolved"  # not left open for its 5 min window
    (ended,) = [e for e in sim.c.get_incident(first.id).timeline if e.kind == "resolved"]
    assert "n3 passed its validation" in ended.message
    sim.second(5)
    assert len(sim.c.list_incidents()) == 1  # the repaired fault opens nothing again
    # a new DBE on the same GPU, well inside the old XID's window and the rule's cooldown
    _dbe(sim, "n3", dbe=2)
    sim.until(lambda: len(sim.c.list_incidents()) == 2, max_s=5, what="a new incident")
    second = max(sim.c.list_incidents(), key=lambda i: i.id)
    assert sim.c.get_node("n3").state != "active" or second.state == "resolved"
    _back(sim, "n3")
    kinds = [a.kind for a in sim.c.get_incident(second.id).actions]
    assert "drain" in kinds
    assert len(sim.c.get_node("n3").hardware_incidents) == 2


def test_after_a_restart_the_repaired_xid_stays_repaired_and_a_new_one_opens_an_incident(
    make_sim: Callable[..., WindowSim],
) -> None:
    sim = make_sim()
    sim.second(2)
    _dbe(sim, "n3")
    sim.second(2)
    _back(sim, "n3")
    sim.second(2)
    sim.c = sim.new_controller()  # the old XID event is replayed into the new one
    sim.second(10)
    assert [i.state for i in sim.c.list_incidents()] == ["resolved"]
    assert sim.c.get_node("n3").state == "active"
    sim.agents["n3"].event("xid", gpu=0, code=48, message=DBE_XID)
    sim.until(lambda: len(sim.c.list_incidents()) == 2, max_s=5, what="a new incident")
