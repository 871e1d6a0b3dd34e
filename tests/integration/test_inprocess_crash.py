"""kill -9 of the real controller at every step of in-process recovery (the restart step's
fast path, controller/actions/inprocess.py): fake agents (driven by the test) run a job with
`recovery.in_process` on n1 and n2, n3 is the spare with a warm standby; a DBE on n1 runs
checkpoint -> drain -> replace -> restart. The controller runs with one kill point armed
(tests/integration/killpoint_controller.py): when its restart step reaches it, the test
kills it with SIGKILL and starts a plain controller on the same SQLite store.

Whatever the point, the incident ends with one remediation: one restart outcome (recovered in
process, or, after a fallback, one full restart), one decision (one `inprocess_decided`, the
same command ids at every agent, one epoch), the job's attempt raised once by the path (to
the planned epoch), and at no moment two attempts' ranks running (no start_job while another
attempt runs; two attempts at once only while a survivor is being rejoined to the new one)."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.builders import gpu
from tests.fakes.job_agent import FakeJobAgent, SharedCheckpoints
from tests.helpers import wait_for
from tests.integration.controller_proc import (
    AGENT,
    OP,
    ControllerProcess,
    dbe_rules,
    start_controller,
    write_config,
)
from tests.integration.killpoint_controller import POINTS
from trainguard.protocol import ReportResponse, StandbyState, decode_json, encode_json

MODULE = "train"  # examples/train.py runs as module `train` in a standby
EPOCH = 2  # the planned epoch: attempt 1 + 1
REFUSED = "the warm standby is not ready"  # n3's answer to assign_standby in the fallback case
# (point, how): "now", the kill follows the point at once; "delivered", the agents first get
# what the parked controller queued (and carry it out); "late", the controller stays down
# past the in-process deadline (the world trains meanwhile) before it starts again
CASES = [
    *((point, "now") for point in POINTS),
    ("mid-send", "delivered"),
    ("queued", "delivered"),
    ("before-done", "late"),
]
DEADLINE_S = 8.0  # in_process_deadline_s of the "late" case (the others: 60 s)


def config(tmp_path: Path, *, deadline_s: float) -> Path:
    return write_config(
        tmp_path,
        rules=dbe_rules(["checkpoint", "drain", "replace", "restart"]),
        tick_interval_s=0.2,
        stale_after_s=10,
        extra_yaml="jobs: {checkpoint_timeout_s: 5, stop_grace_s: 1, stop_timeout_s: 3,"
        f" progress_timeout_s: 60, spare_wait_s: 30, in_process_deadline_s: {deadline_s:g}}}\n",
    )


class Fleet:
    """n1 and n2 run the job, n3 is the spare with a ready warm standby. Each round every
    agent trains a step, reports and carries out the commands on the response; `overlaps`
    collects each moment two attempts' ranks ran at once."""

    def __init__(self, url: str) -> None:
        self.url = url
        ckpts = SharedCheckpoints(every_steps=5)
        roles = {"n1": "active", "n2": "active", "n3": "spare"}
        self.agents = {
            n: FakeJobAgent(n, ckpts=ckpts, role=role, labels={"address": "127.0.0.1"})
            for n, role in roles.items()
        }
        self.agents["n3"].standby = StandbyState(module=MODULE, ready=True)
        self.overlaps: list[str] = []
        # (node, attempt) of every launch seen running beside a launch of another attempt
        self.beside: set[tuple[str, int]] = set()

    def register(self) -> None:
        self.round()
        r = httpx.put(f"{self.url}/v1/nodes/n3/role", json={"role": "spare"}, headers=OP, timeout=5)
        assert r.status_code == 200, r.text

    def running(self, *, but: str | None = None) -> dict[str, int]:
        """node -> the attempt its launch of the job runs (`but`: that node left out)."""
        return {
            n: a.launches["job"].attempt
            for n, a in self.agents.items()
            if n != but and "job" in a.launches and a.launches["job"].state == "running"
        }

    def round(self) -> None:
        for name, agent in self.agents.items():
            agent.train()
            try:
                r = httpx.post(
                    f"{self.url}/v1/reports",
                    content=encode_json(agent.report(now=0.0)),
                    headers=AGENT,
                    timeout=5,
                )
            except httpx.HTTPError:
                continue  # the controller is down: the agent keeps its events for the next
            if r.status_code != 200:
                continue
            seen = len(agent.commands)
            agent.acked(decode_json(ReportResponse, r.content))
            for cmd in agent.commands[seen:]:
                if cmd.kind != "start_job":
                    continue
                others = {
                    n: a for n, a in self.running(but=name).items() if a != cmd.args["attempt"]
                }
                if others:
                    self.overlaps.append(
                        f"start_job attempt {cmd.args['attempt']} on {name} while {others} ran"
                    )
            self._check_running()

    def _check_running(self) -> None:
        now = self.running()
        if len(set(now.values())) > 1:
            self.beside.update(now.items())
        ranks: dict[tuple[int, int], str] = {}
        for n, a in self.agents.items():
            launch = a.launches.get("job")
            if n not in now or launch is None:
                continue
            for i in range(launch.nproc):
                held = ranks.setdefault((launch.attempt, launch.rank(i)), n)
                if held != n:
                    self.overlaps.append(
                        f"rank {launch.rank(i)} of attempt {launch.attempt} on {held} and {n}"
                    )

    def until(self, cond: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        def step() -> bool:
            self.round()
            return cond()

        wait_for(step, timeout_s=timeout_s, what=what)

    def job(self) -> dict:
        return httpx.get(f"{self.url}/v1/jobs/job", headers=OP, timeout=5).json()

    def incident(self) -> dict:
        r = httpx.get(f"{self.url}/v1/incidents?limit=5", headers=OP, timeout=5).json()
        if not r:
            return {"incident": {"state": None}, "actions": [], "timeline": []}
        assert len(r) == 1, r
        return httpx.get(f"{self.url}/v1/incidents/{r[0]['id']}", headers=OP, timeout=5).json()

    def cmds(self, node: str, kind: str) -> list:
        return [c for c in self.agents[node].commands if c.kind == kind]


def killpoint(point: str, marker: Path) -> tuple[str, ...]:
    return (sys.executable, "-m", "tests.integration.killpoint_controller", point, str(marker))


def logs(procs: list[ControllerProcess]) -> str:
    return "".join(p.log() for p in procs)


@pytest.mark.slow
@pytest.mark.parametrize(("point", "how"), CASES, ids=[f"{point}-{how}" for point, how in CASES])
def test_kill9_at_a_step_of_in_process_recovery_remediates_once(
    tmp_path: Path, controllers: list[ControllerProcess], point: str, how: str
) -> None:
    cfg = config(tmp_path, deadline_s=DEADLINE_S if how == "late" else 60.0)
    marker = tmp_path / "parked"
    controllers.append(
        start_controller(cfg, log_path=tmp_path / "c1.log", program=killpoint(point, marker))
    )
    fleet = Fleet(controllers[0].url)
    fleet.register()
    body = {
        "name": "job",
        "command": ["examples/train.py"],
        "nodes": ["n1", "n2"],
        "recovery": {"in_process": True},
    }
    r = httpx.post(f"{fleet.url}/v1/jobs", json=body, headers=OP, timeout=5)
    assert r.status_code == 201, r.text
    fleet.until(
        lambda: (fleet.job()["state"], fleet.job()["attempt"]) == ("running", 1),
        timeout_s=30,
        what="attempt 1 running",
    )
    fallback = point == "fallback-begun"
    if fallback:
        fleet.agents["n3"].assign_fails = REFUSED
    fleet.agents["n1"].gpus = (gpu(0, dbe=1),)
    fleet.until(marker.exists, timeout_s=60, what=f"the restart step at {point}")
    if how == "delivered":
        fleet.round()
    controllers[0].kill()
    if how == "late":
        # the new world trains on while no controller runs, past the deadline from `sent`
        past = time.monotonic() + DEADLINE_S
        fleet.until(lambda: time.monotonic() > past, timeout_s=2 * DEADLINE_S, what="the deadline")

    controllers.append(start_controller(cfg, log_path=tmp_path / "c2.log"))
    fleet.url = controllers[1].url
    fleet.until(
        lambda: fleet.incident()["incident"]["state"] in ("mitigated", "resolved"),
        timeout_s=90,
        what="the incident mitigated after the restart",
    )
    for _ in range(5):
        fleet.round()

    detail = fleet.incident()
    (restart,) = [a for a in detail["actions"] if a["kind"] == "restart"]
    assert restart["state"] == "succeeded", detail
    timeline = " | ".join(t["message"] for t in detail["timeline"])
    text = logs(controllers)
    # one decision: decided once, under the planned epoch; one command id per agent and kind
    assert text.count("event=inprocess_decided") == 1, text
    assert f"event=inprocess_decided job=job epoch={EPOCH} " in text
    key = restart["idempotency_key"]
    lost_stops = [c.id for c in fleet.cmds("n1", "stop_job") if c.id.startswith("inproc-")]
    assert lost_stops == [f"inproc-stop-{key}-n1"], lost_stops
    assert [c.id for c in fleet.cmds("n2", "rejoin")] == [f"inproc-rejoin-{key}-n2"]
    assert [c.id for c in fleet.cmds("n3", "assign_standby")] == [f"inproc-assign-{key}-n3"]
    assert {
        c.args["epoch"]
        for n in ("n2", "n3")
        for c in fleet.agents[n].commands
        if c.kind in ("rejoin", "assign_standby")
    } == {EPOCH}
    # the path raised the job's attempt once, to the planned epoch
    begun = re.findall(r"event=job_attempt job=job attempt=(\d+) \S+ key=(\S+)", text)
    assert [int(a) for a, k in begun if k.endswith("/in-process")] == [EPOCH], begun
    job = fleet.job()
    starts = {n: [c.args["attempt"] for c in fleet.cmds(n, "start_job")] for n in fleet.agents}
    if fallback:
        # one full restart, of an attempt newer than the epoch the rejoin went out under
        reasons = re.findall(r"fell back to a full restart \(([^)]*)\)", timeline)
        assert set(reasons) == {"assign_standby on n3 failed: " + REFUSED}, timeline
        assert f"attempt {EPOCH + 1} trains past" in restart["result"], restart
        assert (job["state"], job["attempt"]) == ("running", EPOCH + 1), job
        assert starts == {"n1": [1], "n2": [1, EPOCH + 1], "n3": [EPOCH + 1]}, starts
    else:
        assert "recovered in process: epoch 2" in restart["result"], restart
        assert timeline.count("recovered in process") == 1, timeline
        assert "fell back" not in timeline, timeline
        assert (job["state"], job["attempt"]) == ("running", EPOCH), job
        assert starts == {"n1": [1], "n2": [1], "n3": []}, starts
    # never two attempts' ranks at once: only a survivor being rejoined ran beside the new one
    assert fleet.overlaps == [], fleet.overlaps
    rejoined = {(n, EPOCH - 1) for n in fleet.agents if fleet.cmds(n, "rejoin")}
    assert {(n, a) for n, a in fleet.beside if a < EPOCH} <= rejoined, fleet.beside
    assert len(set(fleet.running().values())) == 1, fleet.running()
