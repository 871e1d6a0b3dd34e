"""The closed loop on real Slurm: munged + slurmctld + 4 slurmd (n1..n4; n4 a spare held in
the `trainguard_spares` reservation), four sim agents named n1..n4, and the controller with
the Slurm backend, all started once for the module. A real `sbatch` of
examples/slurm/train.sbatch, submitted as the unprivileged `trainguard-user` (created when
missing; its ranks are watched through the agents' open heartbeat socket, devkit.slurm), trains
on 3 nodes with the trainer library, and:

- a DBE on n2's agent -> proactive checkpoint -> `sinfo -R` shows n2 drained with
  trainguard's reason -> the job is requeued and runs on n1, n3, n4 -> every loss equals
  the uninterrupted run's, bitwise;
- a node dies under Slurm (its slurmd, its ranks and its agent killed) -> the job moves to a
  spare the same way;
- drains made by others show with their reason and are never undone by trainguard; a Slurm
  command that fails fails the step with Slurm's own message;
- the controller killed -9 while the restart (requeue) step of a DBE remediation runs, and
  started again: the job is requeued once, onto the spare, and its losses are bitwise equal.

Needs root (slurmd); skipped otherwise. As root the Debian packages must be installed
(`make deps` does it): their absence is a failure, not a skip.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.chaos import STEPS, new_incidents, now, train_args
from tests.e2e.reference import Reference
from trainguard.controller.backends.slurm.cli import SlurmCli, SlurmCommands, SlurmError
from trainguard.devkit.devcluster import DevCluster, compare_losses
from trainguard.devkit.slurm import (
    SUBMIT_USER,
    SlurmCluster,
    SlurmSite,
    attempt_lines,
    missing_reason,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="a local Slurm cluster needs root (slurmd)"),
]
FAULT_STEP = 12
# Each step padded to 0.5 s (the losses are the reference's whatever the padding): the steps
# after FAULT_STEP (14 s) outlast a remediation (checkpoint, drain, requeue) run beside another
# e2e module on a loaded machine, so the requeued attempt always has steps left to train.
SLURM_TRAIN_ARGS = train_args(step_time_s=0.5)
_OUR_REASON = re.compile(r"^trainguard: (\w+) incident (\d+)$")


@dataclass
class World:
    site: SlurmSite
    reference: list[dict[str, Any]]

    @property
    def cluster(self) -> DevCluster:
        return self.site.cluster

    @property
    def slurm(self) -> SlurmCluster:
        return self.site.slurm

    def submit(self, tag: str) -> tuple[str, Path]:
        self.spares_preflighted()
        return self.site.submit(tag, SLURM_TRAIN_ARGS)

    def spares_preflighted(self) -> None:
        """Every free spare holds a passing preflight, as a spare pool at rest does (they are
        preflighted ahead of need), so a swap takes one at once. A job of these tests (40
        steps of 0.5 s) would otherwise finish while the swap waits for a spare's first
        preflight, and its requeue would have nothing left to train."""
        c = self.cluster

        def ready() -> bool:
            spares = [
                str(n["name"])
                for n in c.nodes()
                if n["role"] == "spare" and n["state"] == "active" and not n.get("job")
            ]
            return all((c.node(s).get("last_preflight") or {}).get("passed") for s in spares)

        c.wait(ready, timeout_s=180, what="the free spares' passing preflights")

    def run_until_step(self, job_id: str, step: int) -> dict[str, Any]:
        return self.cluster.wait_job(
            f"slurm-{job_id}",
            lambda j: j["state"] == "running" and (j.get("last_step") or 0) >= step,
            timeout_s=90,
            what=f"Slurm job {job_id} at step {step}",
        )

    def finished(self, job_id: str) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            job = self.slurm.jobs().get(job_id)
            running = ("RUNNING", "PENDING", "COMPLETING")
            return job if job and job["job_state"] not in running else None

        return self.cluster.wait(done, timeout_s=150, what=f"Slurm job {job_id} to finish")


@pytest.fixture(scope="module")
def world(reference: Reference) -> Iterator[World]:
    why = missing_reason()
    if why is not None:
        pytest.fail(f"{why}: `make deps` installs them (as root)")
    reference.start()  # trains while the Slurm site comes up
    jobs = {"checkpoint_timeout_s": 5, "progress_timeout_s": 90, "spare_wait_s": 30}
    # not under pytest's base temp dir: every pytest run on the machine makes that 0700 again,
    # and the job's user must reach slurm.conf and its own jobs dir in here
    run_dir = Path(tempfile.mkdtemp(prefix="tg-slurm-loop-", dir="/tmp"))
    try:
        # n2 stays drained in Slurm after its DBE, as these checks expect: the node lifecycle
        # after a drain (lifecycle.auto_repair) is test_e2e_chaos.py's and the unit tests'
        with SlurmSite(run_dir, jobs=jobs, lifecycle={"auto_repair": False}) as site:
            site.start()
            yield World(site, reference.lines())
        assert site.cluster.leftover_pids() == set()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _check_losses(world: World, out: Path, *, restarts: int) -> dict[int, list[dict[str, Any]]]:
    attempts = attempt_lines(out)
    assert min(attempts) == 0 and max(attempts) == restarts, (
        sorted(attempts),
        out.read_text()[-3000:],
    )
    assert compare_losses(list(attempts.values()), world.reference) == []
    logged = {x["step"] for lines in attempts.values() for x in lines}
    assert logged == set(range(1, STEPS + 1))
    return attempts


def _incident_steps(world: World, since: float) -> dict[str, Any]:
    detail = world.cluster.wait(
        lambda: world.cluster.restarted_since(since),
        timeout_s=120,
        what="a restart step to succeed",
    )
    kinds = {a["kind"]: a["state"] for a in detail["actions"]}
    assert kinds.get("drain") == "succeeded", detail["actions"]
    assert kinds.get("replace") == "succeeded", detail["actions"]
    return detail


def test_dbe_drains_the_node_in_slurm_and_requeues_the_job_onto_the_spare(world: World) -> None:
    c, slurm = world.cluster, world.slurm
    job_id, out = world.submit("dbe")
    # the job is an ordinary user's, and watched: its heartbeats give the controller its steps
    world.run_until_step(job_id, FAULT_STEP)
    assert slurm.jobs()[job_id]["user_name"] == SUBMIT_USER
    assert slurm.job_nodes(job_id) == ["n1", "n2", "n3"]
    # agentctl get jobs shows the Slurm job with its id
    view = c.job(f"slurm-{job_id}")
    assert (view["scheduler"], view["scheduler_job_id"]) == ("slurm", job_id)
    since = now()
    c.inject("n2", "dbe", gpu=0)
    detail = _incident_steps(world, since)
    incident = detail["incident"]
    checkpoint = next(a for a in detail["actions"] if a["kind"] == "checkpoint")
    # the request reached the user's ranks through their control sockets
    assert checkpoint["state"] == "succeeded" and "committed" in checkpoint["result"]
    # sinfo -R: n2 drained with trainguard's reason naming the rule and the incident
    reason = slurm.drain_reasons()["n2"]
    m = _OUR_REASON.match(reason)
    assert m is not None, reason
    assert int(m.group(2)) == incident["id"] or m.group(1) in ("gpu_fatal_xid",)
    finished = world.finished(job_id)
    assert finished["job_state"] == "COMPLETED", finished
    assert finished["restart_cnt"] == 1
    assert slurm.job_nodes(job_id) == ["n1", "n3", "n4"]
    attempts = _check_losses(world, out, restarts=1)
    restart = next(a for a in detail["actions"] if a["kind"] == "restart")
    ckpt_step = checkpoint_step(detail)
    # resumed from the proactive checkpoint, or from the emergency one the trainer takes on
    # the requeue's SIGTERM: never from before the proactive one, never past the last step
    assert ckpt_step + 1 <= attempts[1][0]["step"] <= attempts[0][-1]["step"] + 1
    assert ckpt_step >= FAULT_STEP
    assert "requeue" in restart["result"] and "allocation" in restart["result"], restart
    # agentctl get nodes: n2 drained with the same reason; n4 no longer a spare
    n2 = c.node("n2")
    assert (n2["state"], n2["drain_reason"]) == ("drained", reason)
    assert c.wait(lambda: c.node("n4")["role"] == "active", timeout_s=10, what="n4 active")
    incidents = new_incidents(c, since)
    assert all(i["state"] in ("acting", "mitigated", "resolved") for i in incidents)


def checkpoint_step(detail: dict[str, Any]) -> int:
    for a in detail["actions"]:
        if a["kind"] == "checkpoint":
            m = re.search(r"committed at step (\d+)", a["result"])
            if m:
                return int(m.group(1))
    raise AssertionError(f"no committed checkpoint in {detail['actions']}")


def test_drains_made_by_others_show_with_their_reason_and_are_never_undone(world: World) -> None:
    c, slurm = world.cluster, world.slurm
    slurm.scontrol("update", "nodename=n3", "state=drain", "reason=admin: fan replaced")
    node = c.wait(
        lambda: (n := c.node("n3"))["state"] == "drained" and n,
        timeout_s=15,
        what="n3 drained by the admin to show",
    )
    assert node["drain_reason"].startswith("admin: fan replaced (Slurm drain, set by")
    r = c.client.post("/v1/nodes/n3/undrain")
    assert r.status_code == 400 and "someone else" in r.text, r.text
    assert slurm.drain_reasons()["n3"] == "admin: fan replaced"
    # a drain trainguard made is undone on request (n2 from the DBE test), in Slurm
    r = c.client.post("/v1/nodes/n2/undrain")
    assert r.status_code == 200, r.text
    assert "n2" not in slurm.drain_reasons()
    slurm.scontrol("update", "nodename=n3", "state=resume")
    c.wait(lambda: c.node("n3")["state"] == "active", timeout_s=15, what="n3 active again")
    # `agentctl drain n3` on a Slurm site drains it in Slurm, and undrain resumes it there
    r = c.client.post("/v1/nodes/n3/drain", json={"reason": "bad cable"})
    assert r.status_code == 200 and r.json()["state"] == "drained", r.text
    assert slurm.drain_reasons()["n3"] == "trainguard: bad cable"
    assert c.client.post("/v1/nodes/n3/undrain").status_code == 200
    assert "n3" not in slurm.drain_reasons()


def test_a_failing_slurm_command_fails_with_slurms_own_message(world: World) -> None:
    commands = SlurmCommands(SlurmCli(slurm_conf=str(world.slurm.conf_path), timeout_s=10))
    with pytest.raises(SlurmError, match="Invalid node name specified") as err:
        commands.drain("n9", reason="trainguard: test")
    assert not err.value.transient
    with pytest.raises(SlurmError, match="Invalid job id specified"):
        commands.requeue_hold("999999")


def _a_spare(world: World) -> str:
    """The spare held in the reservation; when an earlier test used it, an admin puts a
    healthy idle node into the reservation."""
    c, slurm = world.cluster, world.slurm
    spares = slurm.reservation_nodes()
    if not spares:
        idle = [n for n, v in slurm.nodes().items() if v["state"] == ["IDLE"]]
        slurm.scontrol(
            "create", "reservation", "reservationname=trainguard_spares", f"nodes={idle[0]}",
            "starttime=now", "duration=infinite", "users=root", "flags=ignore_jobs",
        )  # fmt: skip
        spares = [idle[0]]
    spare = spares[0]
    c.wait(lambda: c.node(spare)["role"] == "spare", timeout_s=15, what=f"{spare} a spare")
    return spare


def test_kill9_of_the_controller_mid_requeue_resumes_the_restart_once(world: World) -> None:
    c, slurm = world.cluster, world.slurm
    spare = _a_spare(world)
    job_id, out = world.submit("ctl-kill")
    world.run_until_step(job_id, FAULT_STEP)
    nodes = slurm.job_nodes(job_id)
    assert len(nodes) == 3 and spare not in nodes, nodes
    sick = nodes[1]  # not the batch host
    since = now()
    c.inject(sick, "dbe", gpu=0)

    def restart_running() -> bool:
        return any(
            a["kind"] == "restart" and a["state"] == "running"
            for inc in new_incidents(c, since)
            for a in c.incident(inc["id"])["actions"]
        )

    c.wait(restart_running, timeout_s=60, what="the restart (requeue) step to run")
    c.kill_controller(signal.SIGKILL)
    c.start_controller()
    detail = _incident_steps(world, since)
    finished = world.finished(job_id)
    assert finished["job_state"] == "COMPLETED", finished
    # requeued once, onto the spare: the resumed step found its requeue and did not repeat it
    assert finished["restart_cnt"] == 1
    assert slurm.job_nodes(job_id) == sorted([*(n for n in nodes if n != sick), spare])
    _check_losses(world, out, restarts=1)
    incidents = new_incidents(c, since)
    assert [i["id"] for i in incidents] == [detail["incident"]["id"]], incidents
    kinds = sorted(a["kind"] for a in detail["actions"] if a["kind"] != "notify")
    assert kinds == ["checkpoint", "drain", "replace", "restart"], detail["actions"]
    assert _OUR_REASON.match(slurm.drain_reasons()[sick]), slurm.drain_reasons()
    # the node goes back to work for the next test (a drain trainguard made, undone by it)
    assert c.client.post(f"/v1/nodes/{sick}/undrain").status_code == 200
    assert sick not in slurm.drain_reasons()


def test_a_node_that_dies_under_slurm_moves_the_job_to_a_spare(world: World) -> None:
    c, slurm = world.cluster, world.slurm
    spare = _a_spare(world)
    job_id, out = world.submit("death")
    world.run_until_step(job_id, FAULT_STEP)
    nodes = slurm.job_nodes(job_id)
    assert len(nodes) == 3 and spare not in nodes, nodes
    dead = nodes[-1]  # not the batch host: the batch script survives the node
    since = now()
    slurm.kill_node(dead)
    c.kill_agent(dead, signal.SIGKILL)
    detail = _incident_steps(world, since)
    assert detail["incident"]["rule"] == "node_silent" or any(
        e["kind"] == "correlated" for e in detail["timeline"]
    )
    reason = slurm.drain_reasons().get(dead, "")
    assert _OUR_REASON.match(reason), reason
    finished = world.finished(job_id)
    assert finished["job_state"] == "COMPLETED", finished
    assert slurm.job_nodes(job_id) == sorted([*nodes[:-1], spare])
    _check_losses(world, out, restarts=finished["restart_cnt"])
