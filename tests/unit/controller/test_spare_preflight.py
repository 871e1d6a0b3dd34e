"""A spare joins a job only after a passing preflight, on the FakeClock sim: a spare whose
preflight fails is drained with the reason and skipped for the next one; a fresh passing result
is taken without a new preflight, an old one is not; a controller killed while a spare's
preflight runs finds the same preflight again. Ahead of need, the tick keeps the free spares'
passes fresh: a swap then waits for none, a spare failing its preflight leaves the pool at once,
and a swap that meets a running one waits for it rather than starting another."""

from __future__ import annotations

from pathlib import Path

from tests.builders import gpu
from tests.unit.controller.job_sim import Sim, running


def _sick_n1(sim: Sim) -> None:
    sim.submit(nodes=["n1", "n2"])
    sim.until(running(sim, attempt=1), max_s=5, what="job running")
    sim.second(3)
    sim.agents["n1"].gpus = (gpu(0, dbe=1),)


def _passed_preflight(sim: Sim, node: str) -> None:
    """`node` passes a preflight now (as `node return` or an earlier swap would leave it)."""
    sim.c.drain(node, reason="maintenance", actor="ops")
    sim.c.return_node(node, actor="ops")
    sim.until(lambda: sim.c.get_node(node).state == "active", max_s=5, what="validated")


def test_a_spare_whose_preflight_fails_is_drained_and_skipped_for_the_next(sim: Sim) -> None:
    sim.add("n4", role="spare")
    sim.agents["n3"].preflight_fails = {"row_remaps": "1 pending row remap on gpu 2"}
    _sick_n1(sim)
    sim.until(running(sim, attempt=2), max_s=40, what="restart onto the next spare")
    job = sim.c.get_job("job")
    assert set(job.nodes) == {"n2", "n4"}
    node = sim.c.get_node("n3")
    assert node.state == "drained"
    assert node.drain_reason == "preflight failed: row_remaps: 1 pending row remap on gpu 2"
    assert "n3" not in [n.name for n in sim.c.list_spares()]
    assert sim.cmds("n3", "start_job") == []
    assert len(sim.cmds("n3", "preflight")) == 1 and len(sim.cmds("n4", "preflight")) == 1
    assert [a["attempt"] for a in sim.cmds("n4", "start_job")] == [2]


def test_a_fresh_passing_preflight_is_reused_without_a_new_one(sim: Sim) -> None:
    _passed_preflight(sim, "n3")
    assert len(sim.cmds("n3", "preflight")) == 1
    _sick_n1(sim)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    assert set(sim.c.get_job("job").nodes) == {"n2", "n3"}
    assert len(sim.cmds("n3", "preflight")) == 1  # the one of `node return`, no second


def test_an_old_passing_preflight_is_run_again(make_core, core_clock, tmp_path: Path) -> None:
    sim = Sim(make_core, core_clock, tmp_path)
    sim.c = sim.make_core(
        rules=[sim.rules],
        jobs={"spare_wait_s": 10.0, "stop_grace_s": 2.0, "stop_timeout_s": 5.0},
        lifecycle={"spare_preflight_max_age_s": 5.0, "spare_preflight_ahead": False},
    )
    for name in ("n1", "n2"):
        sim.add(name)
    sim.add("n3", role="spare")
    _passed_preflight(sim, "n3")
    _sick_n1(sim)  # more than 5 s later
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    assert set(sim.c.get_job("job").nodes) == {"n2", "n3"}
    assert len(sim.cmds("n3", "preflight")) == 2


def test_a_controller_killed_while_a_spare_is_preflighted_finds_the_same_preflight(
    sim: Sim,
) -> None:
    _sick_n1(sim)
    sim.until(
        lambda: any(c.kind == "preflight" for c in sim.c.store.commands.pending("n3")),
        max_s=30,
        what="the spare's preflight queued",
    )
    sim.c.stop()
    sim.c = sim.new_controller()
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    assert set(sim.c.get_job("job").nodes) == {"n2", "n3"}
    assert len(sim.cmds("n3", "preflight")) == 1
    assert [a["attempt"] for a in sim.cmds("n3", "start_job")] == [2]


def _ahead(make_core, core_clock, tmp_path: Path, **lifecycle: object) -> Sim:
    sim = Sim(make_core, core_clock, tmp_path)
    sim.c = sim.make_core(
        rules=[sim.rules],
        jobs={"spare_wait_s": 10.0, "stop_grace_s": 2.0, "stop_timeout_s": 5.0},
        lifecycle={"spare_preflight_ahead": True, **lifecycle},
    )
    for name in ("n1", "n2"):
        sim.add(name)
    sim.add("n3", role="spare")
    return sim


def test_a_free_spare_is_preflighted_ahead_of_need_and_the_swap_waits_for_none(
    make_core, core_clock, tmp_path: Path
) -> None:
    sim = _ahead(make_core, core_clock, tmp_path)
    sim.until(
        lambda: (last := sim.c.store.commands.last_done("n3", kind="preflight")) and last.ok,
        max_s=30,
        what="the spare's preflight ahead of need",
    )
    sim.second(20)  # later ticks: the pass is fresh, no second preflight
    assert len(sim.cmds("n3", "preflight")) == 1
    _sick_n1(sim)
    sim.until(running(sim, attempt=2), max_s=30, what="restart onto the spare")
    assert set(sim.c.get_job("job").nodes) == {"n2", "n3"}
    assert len(sim.cmds("n3", "preflight")) == 1  # the swap took the pass it found


def test_a_spare_failing_its_preflight_ahead_of_need_leaves_the_pool_at_once(
    make_core, core_clock, tmp_path: Path
) -> None:
    sim = _ahead(make_core, core_clock, tmp_path)
    sim.agents["n3"].preflight_fails = {"ecc": "2 uncorrectable errors on gpu 1"}
    sim.until(lambda: sim.c.get_node("n3").state == "drained", max_s=60, what="n3 out")
    assert (
        sim.c.get_node("n3").drain_reason
        == "preflight failed: ecc: 2 uncorrectable errors on gpu 1"
    )
    assert "n3" not in [n.name for n in sim.c.list_spares()]


def test_a_swap_that_meets_a_running_preflight_ahead_of_need_waits_for_it(
    make_core, core_clock, tmp_path: Path
) -> None:
    sim = _ahead(make_core, core_clock, tmp_path)
    sim.agents["n3"].preflight_answers = False  # it runs, and does not answer yet
    _sick_n1(sim)
    sim.until(
        lambda: any(c.kind == "preflight" for c in sim.c.store.commands.pending("n3")),
        max_s=30,
        what="the spare's preflight queued",
    )
    sim.second(5)
    sim.agents["n3"].answer_held_preflights()
    sim.until(running(sim, attempt=2), max_s=60, what="restart onto the spare")
    assert set(sim.c.get_job("job").nodes) == {"n2", "n3"}
    assert len(sim.cmds("n3", "preflight")) == 1
