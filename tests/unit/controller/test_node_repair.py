"""The node lifecycle after a hardware drain (lifecycle.auto_repair) on the FakeClock sim: a DBE
(XID 48) drain is diagnosed, the GPU reset, the node validated and back as a spare; a failing
repair or validation keeps it drained with the reason and counts toward the lemon verdict; a
reboot waits for the policy and its rate limit; a controller killed at any second of the run
repeats no step and loses none."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.builders import gpu
from tests.unit.controller.job_sim import Sim, running
from trainguard.clock import FakeClock
from trainguard.command_args import PREFLIGHT_CHECKS
from trainguard.controller.composition import Controller
from trainguard.controller.config import LifecycleConfig
from trainguard.controller.repairplan import DIAGNOSIS_CHECKS, RepairNeed, diagnose, repair_need
from trainguard.strict import build
from trainguard.xid_catalog import XidCatalog

DBE_XID = "NVRM: Xid (PCI:0000:00:00): 48, pid=0, An uncorrectable double bit error"


class RepairSim(Sim):
    """Sim with the lifecycle's automatic repair on (and `lifecycle` overrides)."""

    def __init__(
        self,
        make_core: Callable[..., Controller],
        clock: FakeClock,
        tmp: Path,
        **lifecycle: Any,
    ) -> None:
        self.lifecycle = {"spare_preflight_ahead": False, "auto_repair": True, **lifecycle}
        super().__init__(make_core, clock, tmp)

    def new_controller(self) -> Controller:
        return self.make_core(
            rules=[self.rules],
            jobs={
                "checkpoint_timeout_s": 5.0,
                "stop_grace_s": 2.0,
                "stop_timeout_s": 5.0,
                "spare_wait_s": 10.0,
                "progress_timeout_s": 60.0,
                "start_timeout_s": 90.0,
            },
            lifecycle=self.lifecycle,
        )


@pytest.fixture
def make_sim(
    make_core: Callable[..., Controller], core_clock: FakeClock, tmp_path: Path
) -> Callable[..., RepairSim]:
    def make(**lifecycle: Any) -> RepairSim:
        s = RepairSim(make_core, core_clock, tmp_path, **lifecycle)
        for name in ("n1", "n2"):
            s.add(name)
        s.add("n3", role="spare")
        return s

    return make


def _fault(sim: Sim, node: str, *, code: int = 48, message: str = DBE_XID) -> None:
    """A running job on n1, n2; `node`'s GPU 0 reports a DBE and the XID `code` with it."""
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)
    sim.agents[node].gpus = (gpu(0, dbe=1),)
    sim.agents[node].event("xid", gpu=0, code=code, message=message)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")


def _steps(sim: Sim) -> list[tuple[str, str]]:
    rows = sim.c.store.db.query(
        "SELECT kind, state FROM actions WHERE idempotency_key LIKE 'lifecycle:%' ORDER BY id"
    )
    return [(str(r[0]), str(r[1])) for r in rows]


def _commands(sim: Sim, kind: str, *, node: str = "n1") -> int:
    rows = sim.c.store.db.query(
        "SELECT COUNT(*) FROM commands WHERE kind = ? AND node = ?", (kind, node)
    )
    return int(rows[0][0])


def test_a_dbe_drain_is_diagnosed_reset_validated_and_back_as_a_spare(
    make_sim: Callable[..., RepairSim],
) -> None:
    sim = make_sim()
    seen: list[str] = []
    _fault(sim, "n1")
    for _ in range(20):
        seen.append(sim.c.get_node("n1").state)
        if seen[-1] == "active":
            break
        sim.second()
    node = sim.c.get_node("n1")
    assert (node.state, node.role, node.drain_reason) == ("active", "spare", None)
    assert "n1" in [n.name for n in sim.c.list_spares()]
    assert _steps(sim) == [
        ("diagnose", "succeeded"),
        ("repair", "succeeded"),
        ("validate", "succeeded"),
    ]
    assert sim.cmds("n1", "repair") == [{"method": "gpu_reset", "gpus": [0]}]
    diagnosis, validation = sim.cmds("n1", "preflight")
    assert diagnosis["checks"] == list(DIAGNOSIS_CHECKS)
    assert validation["checks"] == list(PREFLIGHT_CHECKS)
    drain = next(a for a in sim.incident("gpu_dbe").actions if a.kind == "drain")
    assert "diagnosis planned (XID 48 on GPU 0: reset_gpu)" in drain.result
    assert node.last_preflight is not None and node.last_preflight.passed


def test_a_repair_refused_while_the_old_attempt_still_runs_is_sent_again_once_it_left(
    make_sim: Callable[..., RepairSim],
) -> None:
    sim = make_sim()
    sim.agents["n1"].repair_busy = 2  # the drained job's ranks take a while to stop
    _fault(sim, "n1")
    sim.until(lambda: sim.c.get_node("n1").state == "active", max_s=30, what="n1 back")
    assert _steps(sim) == [
        ("diagnose", "succeeded"),
        ("repair", "succeeded"),
        ("validate", "succeeded"),
    ]
    ids = [c.id for c in sim.agents["n1"].commands if c.kind == "repair"]
    assert len(ids) == 3 and len(set(ids)) == 3, ids
    assert sim.c.get_node("n1").role == "spare"


def test_a_failing_validation_keeps_the_node_drained_and_counts_as_hardware(
    make_sim: Callable[..., RepairSim],
) -> None:
    sim = make_sim()
    agent = sim.agents["n1"]
    agent.repair_fixes = False
    agent.preflight_fails = {"compute_burn": "GPU 0: wrong result (silent data corruption)"}
    _fault(sim, "n1")
    sim.until(lambda: ("validate", "failed") in _steps(sim), max_s=20, what="validation")
    node = sim.c.get_node("n1")
    assert node.state == "drained"
    assert node.drain_reason == (
        "preflight failed: compute_burn: GPU 0: wrong result (silent data corruption)"
    )
    assert [h.rule for h in node.hardware_incidents] == ["gpu_dbe", "validate_failed"]
    assert "n1" not in [n.name for n in sim.c.list_spares()]


def test_a_failing_reset_keeps_the_node_drained_with_the_reason(
    make_sim: Callable[..., RepairSim],
) -> None:
    sim = make_sim()
    sim.agents["n1"].repair_fails = "gpu_reset failed: GPU 0: reset failed (simulated)"
    _fault(sim, "n1")
    sim.until(lambda: ("repair", "failed") in _steps(sim), max_s=20, what="repair fails")
    node = sim.c.get_node("n1")
    assert node.state == "drained"
    assert node.drain_reason == ("repair: gpu_reset failed: GPU 0: reset failed (simulated)")
    assert _steps(sim) == [("diagnose", "succeeded"), ("repair", "failed")]
    assert [h.rule for h in node.hardware_incidents] == ["gpu_dbe", "repair_failed"]


def test_a_failing_repair_retires_a_lemon(make_sim: Callable[..., RepairSim]) -> None:
    sim = make_sim(lemon_incidents=2)
    sim.agents["n1"].repair_fails = "gpu_reset failed: GPU 0: reset failed (simulated)"
    _fault(sim, "n1")
    sim.until(lambda: ("repair", "failed") in _steps(sim), max_s=20, what="repair fails")
    node = sim.c.get_node("n1")
    assert (node.state, node.drain_reason) == ("retired", "lemon: 2 hardware incidents in 30 days")


def test_a_reboot_the_policy_refuses_leaves_the_node_drained_saying_so(
    make_sim: Callable[..., RepairSim],
) -> None:
    sim = make_sim()
    _fault(
        sim, "n1", code=79, message="NVRM: Xid (PCI:0000:00:00): 79, GPU has fallen off the bus."
    )
    sim.second(3)
    node = sim.c.get_node("n1")
    assert node.state == "drained"
    assert node.drain_reason is not None and node.drain_reason.endswith(
        "; XID 79 on GPU 0: needs a node reboot; lifecycle.reboot_enabled is off"
    )
    assert _steps(sim) == []


def test_an_allowed_reboot_runs_once_and_the_node_comes_back(
    make_sim: Callable[..., RepairSim],
) -> None:
    sim = make_sim(reboot_enabled=True, repair_return_role="active")
    _fault(
        sim, "n1", code=79, message="NVRM: Xid (PCI:0000:00:00): 79, GPU has fallen off the bus."
    )
    sim.until(lambda: sim.c.get_node("n1").state == "active", max_s=20, what="back")
    assert sim.cmds("n1", "repair") == [{"method": "reboot", "gpus": []}]
    assert sim.c.get_node("n1").role == "active"


def test_a_controller_killed_every_second_of_the_run_repeats_no_step_and_loses_none(
    make_sim: Callable[..., RepairSim],
) -> None:
    sim = make_sim()
    _fault(sim, "n1")
    for _ in range(25):
        if sim.c.get_node("n1").state == "active":
            break
        sim.c = sim.new_controller()  # kill -9: only the store is left
        sim.second()
    assert sim.c.get_node("n1").state == "active"
    assert _steps(sim) == [
        ("diagnose", "succeeded"),
        ("repair", "succeeded"),
        ("validate", "succeeded"),
    ]
    assert (_commands(sim, "preflight"), _commands(sim, "repair")) == (2, 1)
    assert len(sim.cmds("n1", "repair")) == 1


@pytest.mark.parametrize(
    ("failed", "action", "method"),
    [
        ((), "reset_gpu", "gpu_reset"),
        (("row_remaps", "ecc"), "reset_gpu", "gpu_reset"),
        (("nvml_health",), "reset_gpu", "reboot"),
        ((), "reboot_node", "reboot"),
        (("ckpt_storage",), "reset_gpu", None),
    ],
    ids=["clean-reset", "remaps-reset", "nvml-lost-reboot", "catalog-reboot", "storage-no-repair"],
)
def test_the_diagnosis_picks_the_repair(
    failed: tuple[str, ...], action: str, method: str | None
) -> None:
    checks = [{"name": n, "passed": n not in failed, "detail": "x"} for n in ("nvml_health", "ecc")]
    checks += [{"name": n, "passed": False, "detail": "x"} for n in failed]
    assert diagnose(action=action, checks=checks).method == method


def test_the_repair_need_takes_the_most_severe_catalog_action() -> None:
    catalog = XidCatalog.load(None)
    events = [
        {"kind": "xid", "gpu": 1, "code": 48, "message": DBE_XID},
        {"kind": "xid", "gpu": 2, "code": 13, "message": "graphics exception"},
    ]
    assert repair_need(events, catalog) == RepairNeed("reset_gpu", (1,), "XID 48 on GPU 1")
    events.append({"kind": "gpu_lost", "gpu": 3})
    assert repair_need(events, catalog) == RepairNeed("reboot_node", (3,), "GPU lost on GPU 3")
    assert repair_need([events[1]], catalog) is None


def test_the_reboot_rate_limit_counts_reboots_in_the_window(
    make_sim: Callable[..., RepairSim],
) -> None:
    sim = make_sim(reboot_enabled=True, reboot_max=1, reboot_window_s=600.0)
    plan = sim.c.repairs
    assert plan.start_repair("n1", method="reboot", gpus=(), root="a", why="XID 79") is None
    # the same step again (a re-run after a crash) is no second reboot
    assert plan.start_repair("n1", method="reboot", gpus=(), root="a", why="XID 79") is None
    refused = plan.start_repair("n2", method="reboot", gpus=(), root="b", why="XID 79")
    assert refused == (
        "needs a node reboot; the rate limit is reached (1 lifecycle reboots in 600 s,"
        " lifecycle.reboot_max 1)"
    )
    assert plan.start_repair("n2", method="gpu_reset", gpus=(0,), root="c", why="x") is None
    sim.clock.advance(601.0)
    assert plan.start_repair("n2", method="reboot", gpus=(), root="b", why="XID 79") is None


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        ("reboot_max", -1, "must be in [0, 1000]"),
        ("reboot_window_s", 0.0, "must be in (0, 604800]"),
        ("repair_timeout_s", 7200.0, "must be in (0, 3600]"),
        ("repair_return_role", "idle", "must be one of"),
    ],
    ids=["reboot-max", "window", "repair-timeout", "role"],
)
def test_lifecycle_repair_config_is_strict(key: str, value: Any, reason: str) -> None:
    with pytest.raises(Exception, match=reason.replace("(", r"\(").replace("[", r"\[")):
        build(LifecycleConfig, {key: value}, source="test")


class _Killed(BaseException):
    """A kill -9 at one exact point: nothing of the process runs on."""


@pytest.mark.parametrize("point", ["start_repair", "start_validation"])
def test_a_controller_killed_between_a_move_and_the_next_row_loses_no_step(
    make_sim: Callable[..., RepairSim], monkeypatch: pytest.MonkeyPatch, point: str
) -> None:
    sim = make_sim()

    def die(*args: Any, **kwargs: Any) -> None:
        raise _Killed(point)

    monkeypatch.setattr(sim.c.repairs, point, die)
    with pytest.raises(_Killed):
        _fault(sim, "n1")
        sim.until(lambda: False, max_s=20, what="the kill")
    held = sim.c.get_node("n1").state
    assert held == ("repairing" if point == "start_repair" else "validating")
    sim.c = sim.new_controller()  # the row that was running is resumed
    sim.until(lambda: sim.c.get_node("n1").state == "active", max_s=20, what="back")
    assert _steps(sim) == [
        ("diagnose", "succeeded"),
        ("repair", "succeeded"),
        ("validate", "succeeded"),
    ]
    assert (_commands(sim, "preflight"), _commands(sim, "repair")) == (2, 1)
