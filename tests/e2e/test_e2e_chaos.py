"""Chaos on a real local cluster (controller, nine sim agents, torchrun jobs): a killed rank,
a dead node, XID 79, NaN at step K, a corrupt newest checkpoint, a stopped (stalled) rank, a
slow rank (a straggler), and a DBE on a job of each framework people already run (HF
Transformers Trainer, Lightning, FSDP2); kill -9 of the controller at each remediation step
is in test_e2e_crash.py. Each scenario runs a fresh job on the node set the previous one
left, injects its fault, and ends with the job trained to its last step, every loss equal to
an uninterrupted run's, one incident with one restart and a complete timeline
(tests/e2e/chaos.py); the dead node's swap first meets a spare whose preflight fails (silent
data corruption) and moves on to the next one. Then a job whose command fails right after
start: the restart-loop breaker holds it and pages. Last, the node lifecycle on free spares
(no job): a DBE is drained, diagnosed, reset, validated and the node is back as a spare; a
second one on a GPU whose reset fails stays out with the reason; and a node that reaches the
lemon threshold is retired, out of the spare pool, and a job that names it is refused."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.chaos import (
    check_one_live_attempt,
    check_recovery,
    job_spec,
    launches,
    new_incidents,
    now,
    reference_lines,
    run_until_step,
    start_reference,
)
from trainguard.devkit.devcluster import REPO_ROOT, ClusterConfig, DevCluster

pytestmark = pytest.mark.slow
FAULT_STEP = 12
LEMON_AT = 3  # lifecycle.lemon_incidents in this world


class World:
    def __init__(self, cluster: DevCluster, rules_file: Path) -> None:
        self.cluster = cluster
        self.rules_file = rules_file
        self.nodes = ["node-1", "node-2", "node-3"]
        self.reference: list[dict[str, Any]] = []

    def after(self, job: str) -> None:
        self.nodes = list(self.cluster.job(job)["nodes"])

    @contextlib.contextmanager
    def tuned_rules(self, overrides: dict[str, dict[str, Any]]) -> Iterator[None]:
        """The shipped rules with `overrides` (rule name -> fields) while the block runs:
        production thresholds would make a stall or straggler test minutes long."""
        write_rules(self.rules_file, overrides)
        self._reload()
        try:
            yield
        finally:
            write_rules(self.rules_file, {})
            self._reload()

    def _reload(self) -> None:
        proc = self.cluster.controller
        assert proc is not None and proc.popen is not None
        before = proc.log().count("event=sighup_reload ")
        proc.popen.send_signal(signal.SIGHUP)
        self.cluster.wait(
            lambda: proc.log().count("event=sighup_reload ") > before,
            timeout_s=20,
            what="the controller to reload its rules",
        )


def write_rules(path: Path, overrides: dict[str, dict[str, Any]]) -> None:
    doc = yaml.safe_load((REPO_ROOT / "rules" / "default.yaml").read_text())
    for rule in doc["rules"]:
        rule.update(overrides.get(rule["name"], {}))
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    config = ClusterConfig(
        # node-0: idle, no job's; the node-death scenario makes it a spare with a fault only a
        # preflight finds (it is never a spare before, so no preflight ahead of need ran there)
        active=("node-0", "node-1", "node-2", "node-3"),
        # a spare for each scenario that drains a node (node death, XID 79, straggler, DBEs),
        # and two for the lifecycle scenarios with no hardware incident behind them
        spares=tuple(f"spare-{i}" for i in range(1, 8)),
        safety={"drain_budget": 100, "breaker_threshold": 100},
        # the node lifecycle's repairs on (the default; the last scenarios). A lemon at 3
        # hardware incidents: no node of the job scenarios reaches it (a DBE'd node swapped
        # into a later job and DBE'd again has 2), the lemon scenario's node does
        lifecycle={"auto_repair": True, "preflight_burn_s": 1.0, "lemon_incidents": LEMON_AT},
        jobs={
            # a request is acted on within max(2 steps, 1 s), and a framework job's step
            # takes seconds on a loaded machine; a node that stops reporting falls back at once
            "checkpoint_timeout_s": 30,
            "stop_grace_s": 5,
            "stop_timeout_s": 10,
            "progress_timeout_s": 90,
            # the crash-loop scenario holds its job at the second restart, not the fourth:
            # each attempt of it costs a torchrun launch; every other job restarts once
            "restart_loop_restarts": 1,
        },
    )
    base = Path(tmp_path_factory.mktemp("chaos"))
    rules_file = base / "rules.yaml"
    write_rules(rules_file, {})
    config = dataclasses.replace(config, rules=(str(rules_file),))
    with DevCluster(base / "cluster", config) as cluster:
        cluster.start()
        ref = start_reference(cluster)
        w = World(cluster, rules_file)
        w.reference = reference_lines(cluster, ref)
        yield w
    assert cluster.leftover_pids() == set()


def test_kill9_of_a_rank_restarts_the_job_on_the_same_nodes(world: World) -> None:
    c = world.cluster
    run_until_step(c, job_spec(c, "rank-kill", world.nodes), FAULT_STEP)
    since = now()
    c.signal_rank("rank-kill", 1, signal.SIGKILL)
    check_recovery(
        c,
        "rank-kill",
        world.reference,
        since=since,
        fault_step=FAULT_STEP,
        rules={"job_process_failed"},
        steps=["replace", "restart"],
    )
    assert c.job("rank-kill")["nodes"] == world.nodes
    check_one_live_attempt(c, "rank-kill")
    world.after("rank-kill")


def test_node_death_moves_the_job_to_a_spare_past_one_whose_preflight_fails(
    world: World,
) -> None:
    # node-0 joins the spare pool just before the death with silent data corruption on GPU 0,
    # which only a preflight's compute burn finds. It is the first spare by name and has no
    # preflight behind it, so the swap's gate runs one (or meets the one ahead of need, when
    # the tick's 15 s round comes first): it fails, node-0 is drained with the reason and
    # the next spare takes the dead node's place.
    c = world.cluster
    dead = world.nodes[2]
    sick_spare = "node-0"
    next_spare = min(_free_spares(c))
    assert sick_spare < next_spare
    run_until_step(c, job_spec(c, "node-death", world.nodes), FAULT_STEP)
    c.inject(sick_spare, "sdc", gpu=0)
    c.api("PUT", f"/v1/nodes/{sick_spare}/role", json={"role": "spare"})
    since = now()
    c.kill_node(dead)
    killed_at = now()
    detail = check_recovery(
        c,
        "node-death",
        world.reference,
        since=since,
        fault_step=FAULT_STEP,
        rules={"job_process_failed", "node_silent"},
        steps=["restart"],
    )
    nodes = c.job("node-death")["nodes"]
    assert dead not in nodes and len(nodes) == 3
    assert set(nodes) - set(world.nodes) == {next_spare}, nodes
    # the spare that failed its preflight is out of the pool with the reason
    node0 = c.node(sick_spare)
    reason = str(node0.get("drain_reason"))
    assert node0["state"] == "drained", node0
    assert reason.startswith("preflight failed: compute_burn: GPU 0:"), node0
    assert "silent data corruption" in reason, node0
    assert not node0["last_preflight"]["passed"], node0["last_preflight"]
    assert sick_spare not in [n["name"] for n in c.api("GET", "/v1/spares")]
    assert not any(x.node == sick_spare for x in launches(c, "node-death"))
    # the silent node joined the same incident and was drained there
    assert c.wait(lambda: c.node(dead)["state"] == "drained", timeout_s=30, what=f"{dead} drained")
    kinds = [e["kind"] for e in c.incident(detail["incident"]["id"])["timeline"]]
    assert "correlated" in kinds or detail["incident"]["rule"] == "node_silent"
    check_one_live_attempt(c, "node-death", ended={dead: killed_at})
    world.after("node-death")


def test_xid_79_drains_the_node_and_swaps_in_a_spare(world: World) -> None:
    c = world.cluster
    sick = world.nodes[1]
    run_until_step(c, job_spec(c, "xid79", world.nodes), FAULT_STEP)
    since = now()
    c.inject(sick, "xid", gpu=0, code=79)
    check_recovery(
        c,
        "xid79",
        world.reference,
        since=since,
        fault_step=FAULT_STEP,
        rules={"gpu_fatal_xid", "gpu_lost"},
        steps=["checkpoint", "drain", "replace", "restart"],
    )
    nodes = c.job("xid79")["nodes"]
    assert sick not in nodes and c.node(sick)["state"] == "drained"
    check_one_live_attempt(c, "xid79")
    world.after("xid79")


def test_nan_at_step_k_rolls_back_to_the_last_good_checkpoint_without_a_drain(
    world: World,
) -> None:
    # The skip window is 0: this NaN comes from the chaos hook, not from the data, so with no
    # batch skipped the recovered run must equal the uninterrupted reference bitwise at every
    # step after the rollback (a stronger check than "finite after the fault"); the skip
    # window's arithmetic is the sampler's, covered by its unit tests.
    c = world.cluster
    spec = job_spec(
        c,
        "nan",
        world.nodes,
        env={"TRAINGUARD_CHAOS": f"nan@step{FAULT_STEP}:rank0"},
        rollback_skip_batches=0,
    )
    since = now()
    run_until_step(c, spec, FAULT_STEP - 2)
    detail = check_recovery(
        c,
        "nan",
        world.reference,
        since=since,
        fault_step=FAULT_STEP,
        rules={"nan_loss"},
        steps=["rollback"],
        poisoned_from=FAULT_STEP,
    )
    kinds = [a["kind"] for a in detail["actions"]]
    assert "drain" not in kinds and "replace" not in kinds, kinds
    assert c.job("nan")["nodes"] == world.nodes
    assert all(c.node(n)["state"] == "active" for n in world.nodes)
    # the rollback resumed from the newest checkpoint before the NaN, not from a later one
    second = [x["step"] for a, x in c.step_lines("nan") if a == 2]
    assert second[0] == (FAULT_STEP - 1) // 5 * 5 + 1, second[:3]
    check_one_live_attempt(c, "nan")
    world.after("nan")


def test_a_corrupt_latest_checkpoint_makes_the_restart_resume_from_the_previous_one(
    world: World,
) -> None:
    c = world.cluster
    spec = job_spec(c, "ckpt-corrupt", world.nodes)
    run_until_step(c, spec, FAULT_STEP)
    since = now()
    # kill first: with a rank gone the others block in the next collective, so no newer
    # checkpoint can commit after the byte flip below and before the restart loads one
    c.signal_rank("ckpt-corrupt", 1, signal.SIGKILL)
    ckpt_dir = Path(spec["ckpt_dir"])
    committed = sorted(p for p in ckpt_dir.glob("step_*") if (p / "manifest.json").exists())
    newest = committed[-1]
    assert newest.name == f"step_{FAULT_STEP // 5 * 5:06d}", [p.name for p in committed]
    shard = newest / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    check_recovery(
        c,
        "ckpt-corrupt",
        world.reference,
        since=since,
        fault_step=FAULT_STEP,
        rules={"job_process_failed"},
        steps=["replace", "restart"],
    )
    second = [x["step"] for a, x in c.step_lines("ckpt-corrupt") if a == 2]
    assert second[0] == FAULT_STEP // 5 * 5 - 5 + 1, second[:3]
    logs = [p.read_text(errors="replace") for _, a, p in c.job_logs("ckpt-corrupt") if a == 2]
    assert any("event=checkpoint_skipped" in text and newest.name in text for text in logs)
    check_one_live_attempt(c, "ckpt-corrupt")
    world.after("ckpt-corrupt")


def test_a_stopped_rank_stalls_the_job_and_gets_stacks_collected_and_a_restart(
    world: World,
) -> None:
    c = world.cluster
    run_until_step(c, job_spec(c, "stall", world.nodes), FAULT_STEP)
    stall = {"training_stall": {"condition": "step_age_s > 4 and heartbeat_age_s <= 30"}}
    with world.tuned_rules(stall):
        since = now()
        stopped = c.signal_rank("stall", 1, signal.SIGSTOP)
        try:
            detail = check_recovery(
                c,
                "stall",
                world.reference,
                since=since,
                fault_step=FAULT_STEP,
                rules={"training_stall"},
                steps=["collect_stacks", "restart"],
            )
        finally:
            # the restart kills the stopped worker; if it did not, leave nothing stopped behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped.pid, signal.SIGCONT)
                os.kill(stopped.pid, signal.SIGKILL)
    assert c.job("stall")["nodes"] == world.nodes
    kinds = [a["kind"] for a in detail["actions"]]
    assert "drain" not in kinds, kinds
    check_one_live_attempt(c, "stall")
    world.after("stall")


def test_a_slow_rank_is_told_by_its_compute_time_and_its_node_replaced(world: World) -> None:
    # Every rank's step time is the slowest rank's (they wait for it at the all-reduce); only
    # the compute time the trainer measures in Trainguard.compute() singles the slow one out.
    # The slowdown holds from FAULT_STEP on in the first attempt only: a slow node, cured by
    # its replacement. `for: 3s` instead of the shipped minute keeps the test short.
    c = world.cluster
    spec = job_spec(
        c, "straggler", world.nodes, env={"TRAINGUARD_CHAOS": f"slow=1.0@step{FAULT_STEP}:rank1"}
    )
    with world.tuned_rules({"straggler": {"for": "3s"}}):
        run_until_step(c, spec, FAULT_STEP)
        since = now()
        slow = next(r for r in c.rank_procs("straggler") if r.rank == 1)
        detail = check_recovery(
            c,
            "straggler",
            world.reference,
            since=since,
            fault_step=FAULT_STEP,
            rules={"straggler"},
            steps=["checkpoint", "drain", "replace", "restart"],
        )
    incident = detail["incident"]
    assert (incident["target"], incident["node"]) == ("rank:straggler:1", slow.node), incident
    nodes = c.job("straggler")["nodes"]
    assert slow.node not in nodes and len(nodes) == 3
    assert c.node(slow.node)["state"] == "drained"
    check_one_live_attempt(c, "straggler")
    world.after("straggler")


# The DBE loop on jobs of the frameworks people already run, 2 ranks each, tiny models built
# from config on CPU: (the job's command, the flag that names its checkpoint directory).
# Their launches import transformers or lightning (seconds of CPU each): generous waits.
FRAMEWORK_STEPS = 30
FRAMEWORK_FAULT_STEP = 6
FRAMEWORK_WAIT_S = 240
_PACE = ["--seed", "0", "--step-time-s", "0.3"]
_COMMITTED = re.compile(r"event=checkpoint_committed job=\S+ rank=\d+ step=(\d+)")
FRAMEWORK_JOBS = {
    "hf": (
        ["examples/train_hf.py", "--steps", str(FRAMEWORK_STEPS), "--save-steps", "10", *_PACE],
        "--output-dir",
    ),
    "lightning": (
        [
            "examples/train_lightning.py",
            "--steps",
            str(FRAMEWORK_STEPS),
            "--checkpoint-every",
            "10",
            *_PACE,
        ],
        "--ckpt-dir",
    ),
    "fsdp2": (
        [
            "examples/train.py",
            "--fsdp2",
            "--steps",
            str(FRAMEWORK_STEPS),
            "--checkpoint-every",
            "10",
            *_PACE,
        ],
        "--ckpt-dir",
    ),
}


@pytest.mark.parametrize("framework", FRAMEWORK_JOBS)
def test_a_dbe_on_a_framework_job_resumes_it_on_a_spare_from_the_proactive_checkpoint(
    world: World, framework: str
) -> None:
    # The remediation's own checkpoint commits (it is no fallback to a periodic one), and the
    # restart resumes from the newest checkpoint of the first attempt: that one, or a later
    # one the trainer saved before it stopped (its save on the restart's SIGTERM, one step or
    # so on), never an older one. Every loss after it equals the uninterrupted run's bitwise
    # (2 gloo ranks sum a gradient in one order whatever the bucket layout, so DDP and FSDP2
    # resume exactly). The reference runs alongside the job, at the same world size.
    c = world.cluster
    command, ckpt_flag = FRAMEWORK_JOBS[framework]
    job = f"dbe-{framework}"
    nodes, idle = world.nodes[:2], world.nodes[2:]
    sick = nodes[1]
    ref = start_reference(c, world=2, name=f"{job}-reference", command=command, ckpt_flag=ckpt_flag)
    spec = job_spec(c, job, nodes, command=command)
    run_until_step(c, spec, FRAMEWORK_FAULT_STEP, timeout_s=FRAMEWORK_WAIT_S)
    since = now()
    c.inject(sick, "dbe", gpu=0)
    reference = reference_lines(
        c, ref, name=f"{job}-reference", last_step=FRAMEWORK_STEPS, timeout_s=FRAMEWORK_WAIT_S
    )
    detail = check_recovery(
        c,
        job,
        reference,
        since=since,
        fault_step=FRAMEWORK_FAULT_STEP,
        rules={"gpu_fatal_xid", "gpu_uncorrectable_ecc"},
        steps=["checkpoint", "drain", "replace", "restart"],
        last_step=FRAMEWORK_STEPS,
        finish_timeout_s=FRAMEWORK_WAIT_S,
    )
    view = c.job(job)
    world.nodes = [*view["nodes"], *idle]  # the next scenario's, whatever is checked below
    checkpoint = next(a for a in detail["actions"] if a["kind"] == "checkpoint")
    committed = re.match(r"checkpoint committed at step (\d+)", checkpoint["result"])
    assert committed is not None, checkpoint  # proactive: not the fallback to a periodic one
    first_logs = [p.read_text(errors="replace") for _, a, p in c.job_logs(job) if a == 1]
    saved = {int(m[1]) for text in first_logs for m in _COMMITTED.finditer(text)}
    proactive = int(committed[1])
    assert proactive in saved, (proactive, saved)
    second = [x["step"] for a, x in c.step_lines(job) if a == 2]
    assert second[0] - 1 == max(saved) >= proactive, (proactive, saved, second[:3])
    assert sick not in view["nodes"] and len(view["nodes"]) == 2, view
    # drained, then (lifecycle.auto_repair in this world) diagnosed, reset, validated and
    # back as a spare, wherever it is in that by now
    sick_now = c.node(sick)
    assert sick_now["state"] in ("drained", "diagnosing", "repairing", "validating") or (
        sick_now["role"] == "spare" and sick_now.get("job") is None
    ), sick_now
    check_one_live_attempt(c, job)


def test_a_crash_looping_job_is_held_by_the_restart_loop_breaker(
    world: World,
) -> None:
    # A job whose command fails right after it starts (an option the script does not know):
    # every restart crashes again with nothing saved. After jobs.restart_loop_restarts such
    # restarts (1 in this world) the next is not made: the job is held with the reason and the
    # incident pages the evidence. One node: the loop, not the placement, is under test.
    c = world.cluster
    node = world.nodes[0]
    spec = job_spec(c, "crash-loop", [node], max_restarts=10)
    spec["command"] = ["examples/train.py", "--no-such-option"]
    since = now()
    c.submit_job(spec)
    view = c.wait_job(
        "crash-loop", lambda j: j["state"] in ("held", "failed"), timeout_s=150, what="held"
    )
    assert view["state"] == "held", view
    assert view["restarts"] == 1 and view["attempt"] == 2, view
    assert view["state_reason"].startswith("restart loop: 1 restart in 30 min"), view
    assert "resumed from scratch" in view["state_reason"]
    # the second job_process_failed incident's restart step failed with the evidence, paged
    loops = [i for i in new_incidents(c, since) if i["rule"] == "job_process_failed"]
    assert len(loops) == 2, [(i["id"], i["state"]) for i in loops]
    detail = c.incident(max(i["id"] for i in loops))
    [restart] = [a for a in detail["actions"] if a["kind"] == "restart"]
    assert restart["state"] == "failed" and restart["result"].count("- restart #") == 1, restart
    # its evidence: each restart, what it answered and how it ended (torchrun's summary of
    # the script's exit 2, argparse's usage error)
    assert "exitcode  : 2" in restart["result"], restart["result"]
    kinds = [e["kind"] for e in detail["timeline"]]
    assert "escalated" in kinds or "escalation_unavailable" in kinds, kinds
    # nothing restarts a held job
    assert c.job("crash-loop")["attempt"] == 2


def _preflighted(c: DevCluster, name: str) -> bool:
    return c.node(name).get("last_preflight") is not None


def _free_spares(c: DevCluster, *, incidents: int | None = None) -> list[str]:
    """The free spares (role spare, active, no job), by name from the last; with `incidents`,
    only those with that many hardware incidents behind them (`describe node`)."""
    free = [
        n["name"]
        for n in sorted(c.nodes(), key=lambda n: str(n["name"]), reverse=True)
        if n["role"] == "spare" and n["state"] == "active" and not n.get("job")
    ]
    if incidents is None:
        return free
    return [n for n in free if len(c.node(n)["hardware_incidents"]) == incidents]


def _warm(c: DevCluster, *names: str) -> None:
    """Wait for the nodes' preflights ahead of need (an agent runs one preflight at a time,
    so a repair's diagnosis would queue behind one)."""
    for name in names:
        c.wait(
            functools.partial(_preflighted, c, name),
            timeout_s=180,
            what=f"{name}'s warm preflight",
        )


def _repair_a_dbe(c: DevCluster, spare: str) -> None:
    """A DBE on a free spare's GPU 1 (XID 48: the catalog's reset_gpu): drained, diagnosed,
    reset, validated and back as a spare with the pass, its reason cleared."""
    log_from = len(c.agents[spare].proc.log())
    c.inject(spare, "dbe", gpu=1)
    c.wait(lambda: c.node(spare)["state"] != "active", timeout_s=30, what=f"{spare} drained")
    c.wait(
        lambda: (
            c.node(spare)["state"] == "active"
            and "event=gpu_reset gpu=1" in c.agents[spare].proc.log()[log_from:]
        ),
        timeout_s=240,
        what=f"{spare} repaired and back",
    )
    node = c.node(spare)
    assert (node["role"], node.get("drain_reason")) == ("spare", None), node
    assert node["last_preflight"]["passed"], node["last_preflight"]


def test_a_dbe_on_a_free_spare_is_repaired_and_a_failed_reset_keeps_it_out(
    world: World,
) -> None:
    # Two free spares with no hardware incident behind them (the lemon count stays under
    # the threshold), GPU 1 of each (the earlier scenarios' faults were on GPU 0: a fatal
    # XID's incident stays open for the rule's window and cooldown, so a new one on a GPU hit
    # earlier would not open another).
    c = world.cluster
    free = _free_spares(c, incidents=0)
    assert len(free) >= 2, free
    spare, other = free[:2]
    _warm(c, spare, other)
    started = time.monotonic()
    _repair_a_dbe(c, spare)
    repaired_s = time.monotonic() - started
    # a DBE on the other spare's GPU 1, whose reset fails: diagnosed, the reset fails, kept
    # out with the reason (its second hardware incident: no lemon yet)
    c.inject(other, "reset_fail", gpu=1)
    c.inject(other, "dbe", gpu=1)

    def kept_out() -> bool:
        node = c.node(other)
        reason = str(node.get("drain_reason"))
        return (
            node["state"] == "drained"
            and reason.startswith("repair: gpu_reset failed:")
            and "GPU 1" in reason
        )

    c.wait(kept_out, timeout_s=180, what=f"{other} kept out by its failed reset")
    assert "event=gpu_reset_failed gpu=1" in c.agents[other].proc.log()
    assert other not in [n["name"] for n in c.api("GET", "/v1/spares")]
    rules = [h["rule"] for h in c.node(other)["hardware_incidents"]]
    assert "repair_failed" in rules and len(rules) == LEMON_AT - 1, rules
    print(f"lifecycle: repaired in {repaired_s:.1f} s, both in {time.monotonic() - started:.1f} s")


def test_a_node_at_the_lemon_threshold_is_retired_and_never_used_again(world: World) -> None:
    # A free spare with one hardware incident behind it (a DBE it was repaired of: the
    # scenario above leaves one; run alone, this test repairs one first) gets a DBE on a GPU
    # whose reset fails. The DBE's incident is its second hardware incident and the failed
    # reset its third, lifecycle.lemon_incidents in this world: it is retired with the lemon
    # reason instead of left drained, it leaves the spare pool, and a job that names it is
    # refused.
    c = world.cluster
    assert LEMON_AT == 3  # one repaired DBE, then a DBE and a failed reset
    once = _free_spares(c, incidents=1)
    if not once:
        fresh = _free_spares(c, incidents=0)
        assert fresh, _free_spares(c)
        _warm(c, fresh[0])
        _repair_a_dbe(c, fresh[0])
        once = [fresh[0]]
    lemon = once[0]
    _warm(c, lemon)
    started = time.monotonic()
    c.inject(lemon, "reset_fail", gpu=1)
    c.inject(lemon, "dbe", gpu=1)
    c.wait(
        lambda: c.node(lemon)["state"] == "retired",
        timeout_s=180,
        what=f"{lemon} retired as a lemon",
    )
    node = c.node(lemon)
    assert node["drain_reason"] == "lemon: 3 hardware incidents in 30 days", node
    rules = [h["rule"] for h in node["hardware_incidents"]]
    assert len(rules) == LEMON_AT and rules[-1] == "repair_failed", rules
    assert "event=gpu_reset_failed gpu=1" in c.agents[lemon].proc.log()
    assert lemon not in [n["name"] for n in c.api("GET", "/v1/spares")]
    # a job that names it is refused: only an active node is placed in a job
    r = c.client.post("/v1/jobs", json=job_spec(c, "lemon-placement", [lemon]))
    assert r.status_code == 400 and f"{lemon} is retired" in r.text, (r.status_code, r.text)
    assert c.client.get("/v1/jobs/lemon-placement").status_code == 404
    print(f"lemon: retired in {time.monotonic() - started:.1f} s")
