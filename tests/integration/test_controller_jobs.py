"""The closed loop through the real controller process: fake agents (driven by the test) post
HTTP reports and carry out the commands on the responses. A sick node is checkpointed,
drained, replaced by the spare and the job restarted, with the right commands at each step; a
spare whose preflight fails is skipped for the next one, and a lemon (retired at its second
DBE) is never used; with no spare the job shrinks;
`kill -9` of the controller while the restart waits for the first step resumes it without
another start_job; agentctl's `--wait` follows submit, drain and restart to the first step."""

from __future__ import annotations

import io
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
    OP_TOKEN,
    dbe_rules,
    start_controller,
    write_config,
)
from trainguard.clock import SystemClock
from trainguard.controller.cli import main as agentctl_main
from trainguard.protocol import ReportResponse, decode_json, encode_json


def config(tmp_path: Path) -> Path:
    return write_config(
        tmp_path,
        rules=dbe_rules(["notify", "checkpoint", "drain", "replace", "restart"]),
        tick_interval_s=0.2,
        stale_after_s=10,
        extra_yaml="jobs: {checkpoint_timeout_s: 5, stop_grace_s: 1, stop_timeout_s: 3,"
        " progress_timeout_s: 60, spare_wait_s: 30}\n",
    )


class Fleet:
    def __init__(self, names: dict[str, str]) -> None:
        self.ckpts = SharedCheckpoints(every_steps=5)
        self.agents = {
            n: FakeJobAgent(n, ckpts=self.ckpts, role=role, labels={"address": "127.0.0.1"})
            for n, role in names.items()
        }
        self.roles = names
        self.url = ""

    def register(self) -> None:
        """First reports, then the spares an operator names (a report's role hint never
        makes a spare)."""
        self.round()
        for name, role in self.roles.items():
            if role == "spare":
                r = httpx.put(
                    f"{self.url}/v1/nodes/{name}/role",
                    json={"role": "spare"},
                    headers=OP,
                    timeout=5,
                )
                assert r.status_code == 200, r.text

    def round(self) -> None:
        for agent in self.agents.values():
            agent.train()
            if agent.silent:
                continue
            try:
                r = httpx.post(
                    f"{self.url}/v1/reports",
                    content=encode_json(agent.report(now=0.0)),
                    headers=AGENT,
                    timeout=5,
                )
            except httpx.HTTPError:
                continue  # the controller is down: keep the events, resend next round
            if r.status_code == 200:
                agent.acked(decode_json(ReportResponse, r.content))

    def until(self, cond: Callable[[], bool], *, timeout_s: float, what: str) -> None:
        def step() -> bool:
            self.round()
            return cond()

        wait_for(step, timeout_s=timeout_s, what=what)

    def job(self) -> dict:
        return httpx.get(f"{self.url}/v1/jobs/job", headers=OP, timeout=5).json()

    def incident(self) -> dict:
        r = httpx.get(f"{self.url}/v1/incidents?limit=5", headers=OP, timeout=5).json()
        if not r:  # the tick that opens it may not have run yet
            return {"incident": {"state": None}, "actions": []}
        return httpx.get(f"{self.url}/v1/incidents/{r[0]['id']}", headers=OP, timeout=5).json()

    def starts(self) -> list[tuple[str, int]]:
        return sorted(
            (n, c.args["attempt"])
            for n, a in self.agents.items()
            for c in a.commands
            if c.kind == "start_job"
        )

    def kinds(self, node: str) -> list[str]:
        return [c.kind for c in self.agents[node].commands]


def submit(fleet: Fleet, **spec: object) -> None:
    body = {"name": "job", "command": ["examples/train.py"], "nodes": ["n1", "n2"], **spec}
    r = httpx.post(f"{fleet.url}/v1/jobs", json=body, headers=OP, timeout=5)
    assert r.status_code == 201, r.text


def running(fleet: Fleet, attempt: int) -> Callable[[], bool]:
    return lambda: (fleet.job()["state"], fleet.job()["attempt"]) == ("running", attempt)


@pytest.mark.slow
def test_sick_node_is_replaced_through_the_real_controller(tmp_path, controllers):
    controllers.append(start_controller(config(tmp_path), log_path=tmp_path / "c.log"))
    fleet = Fleet({"n1": "active", "n2": "active", "n3": "spare"})
    fleet.url = controllers[0].url
    fleet.register()
    submit(fleet)
    fleet.until(running(fleet, 1), timeout_s=20, what="attempt 1 running")
    fleet.agents["n1"].gpus = (gpu(0, dbe=1),)
    fleet.until(
        lambda: fleet.incident()["incident"]["state"] == "mitigated",
        timeout_s=40,
        what="mitigated",
    )
    assert fleet.kinds("n1") == ["start_job", "checkpoint", "stop_job"]
    assert fleet.kinds("n2") == ["start_job", "checkpoint", "stop_job", "start_job"]
    assert fleet.kinds("n3") == ["preflight", "start_job"]  # a spare joins after a pass
    assert fleet.starts() == [("n1", 1), ("n2", 1), ("n2", 2), ("n3", 2)]
    job = fleet.job()
    assert job["nodes"] == ["n3", "n2"] and job["restarts"] == 1
    steps = [(a["kind"], a["state"]) for a in fleet.incident()["actions"] if a["kind"] != "notify"]
    assert steps == [(k, "succeeded") for k in ("checkpoint", "drain", "replace", "restart")]
    metrics = httpx.get(f"{fleet.url}/metrics", timeout=5).text
    assert 'trainguard_controller_remediation_phase_seconds_count{phase="mttr"} 1.0' in metrics


@pytest.mark.slow
def test_a_spare_whose_preflight_fails_is_skipped_for_the_next_one(tmp_path, controllers):
    controllers.append(start_controller(config(tmp_path), log_path=tmp_path / "c.log"))
    fleet = Fleet({"n1": "active", "n2": "active", "n3": "spare", "n4": "spare"})
    fleet.agents["n3"].preflight_fails = {"row_remaps": "1 pending row remap on gpu 2"}
    fleet.url = controllers[0].url
    fleet.register()
    submit(fleet)
    fleet.until(running(fleet, 1), timeout_s=20, what="attempt 1 running")
    fleet.agents["n1"].gpus = (gpu(0, dbe=1),)
    fleet.until(running(fleet, 2), timeout_s=40, what="attempt 2 running on the next spare")
    assert sorted(fleet.job()["nodes"]) == ["n2", "n4"]
    assert "start_job" not in fleet.kinds("n3") and "preflight" in fleet.kinds("n3")
    n3 = httpx.get(f"{fleet.url}/v1/nodes/n3", headers=OP, timeout=5).json()
    assert (n3["state"], n3["drain_reason"]) == (
        "drained",
        "preflight failed: row_remaps: 1 pending row remap on gpu 2",
    )


@pytest.mark.slow
def test_a_lemon_node_stops_being_used(tmp_path, controllers):
    # lifecycle.lemon_incidents 2: n3's second DBE (after it was returned from its first)
    # retires it, and the job's swap takes n4; room in the drain budget for the three drains
    cfg = config(tmp_path)
    extra = "lifecycle: {lemon_incidents: 2}\nsafety: {drain_budget: 10}\n"
    cfg.write_text(cfg.read_text() + extra)
    controllers.append(start_controller(cfg, log_path=tmp_path / "c.log"))
    fleet = Fleet({"n1": "active", "n2": "active", "n3": "spare", "n4": "spare"})
    fleet.url = controllers[0].url
    fleet.register()
    n3 = fleet.agents["n3"]

    def node(name: str) -> dict:
        return httpx.get(f"{fleet.url}/v1/nodes/{name}", headers=OP, timeout=5).json()

    n3.gpus = (gpu(0, dbe=1),)  # the first: drained
    fleet.until(lambda: node("n3")["state"] == "drained", timeout_s=20, what="n3 drained")
    n3.gpus = (gpu(0),)  # repaired by hand, then returned through its validation
    r = httpx.post(f"{fleet.url}/v1/nodes/n3/return", headers=OP, timeout=5)
    assert r.status_code == 200, r.text
    fleet.until(lambda: node("n3")["state"] == "active", timeout_s=20, what="n3 returned")
    n3.gpus = (gpu(0, dbe=1),)  # the second: a lemon, retired
    fleet.until(lambda: node("n3")["state"] == "retired", timeout_s=20, what="n3 retired")
    assert node("n3")["drain_reason"] == "lemon: 2 hardware incidents in 30 days"
    submit(fleet)
    fleet.until(running(fleet, 1), timeout_s=20, what="attempt 1 running")
    fleet.agents["n1"].gpus = (gpu(0, dbe=1),)
    fleet.until(running(fleet, 2), timeout_s=40, what="attempt 2 running on n4")
    assert sorted(fleet.job()["nodes"]) == ["n2", "n4"]
    assert "start_job" not in fleet.kinds("n3")


@pytest.mark.slow
def test_no_spare_shrinks_through_the_real_controller(tmp_path, controllers):
    controllers.append(start_controller(config(tmp_path), log_path=tmp_path / "c.log"))
    fleet = Fleet({"n1": "active", "n2": "active"})
    fleet.url = controllers[0].url
    fleet.register()
    submit(fleet, min_nodes=1, max_nproc_per_node=2)
    fleet.until(running(fleet, 1), timeout_s=20, what="attempt 1 running")
    fleet.agents["n1"].gpus = (gpu(0, dbe=1),)
    fleet.until(running(fleet, 2), timeout_s=40, what="attempt 2 running on one node")
    job = fleet.job()
    assert (job["nodes"], job["nproc_per_node"], job["world_size"]) == (["n2"], 2, 2)
    last = [c.args for c in fleet.agents["n2"].commands if c.kind == "start_job"][-1]
    assert (last["nnodes"], last["nproc_per_node"]) == (1, 2)
    timeline = " | ".join(t["message"] for t in fleet.incident()["timeline"])
    assert "world size 2 kept" in timeline


@pytest.mark.slow
def test_kill9_mid_restart_resumes_without_another_start_job(tmp_path, controllers):
    cfg = config(tmp_path)
    controllers.append(start_controller(cfg, log_path=tmp_path / "c1.log"))
    fleet = Fleet({"n1": "active", "n2": "active", "n3": "spare"})
    fleet.url = controllers[0].url
    fleet.register()
    submit(fleet)
    fleet.until(running(fleet, 1), timeout_s=20, what="attempt 1 running")
    fleet.agents["n3"].hold = True  # attempt 2 starts but shows no progress yet
    fleet.agents["n2"].hold = True
    fleet.agents["n1"].gpus = (gpu(0, dbe=1),)
    fleet.until(lambda: ("n3", 2) in fleet.starts(), timeout_s=40, what="start_job attempt 2")
    controllers[0].kill()
    controllers.append(start_controller(cfg, log_path=tmp_path / "c2.log"))
    fleet.url = controllers[1].url
    for _ in range(5):
        fleet.round()
    fleet.agents["n3"].hold = False
    fleet.agents["n2"].hold = False
    fleet.until(
        lambda: fleet.incident()["incident"]["state"] == "mitigated",
        timeout_s=40,
        what="mitigated after the restart",
    )
    assert fleet.starts() == [("n1", 1), ("n2", 1), ("n2", 2), ("n3", 2)]
    assert fleet.job()["attempt"] == 2


class FleetClock(SystemClock):
    """agentctl's clock for --wait against the real controller: each of its sleeps is a
    round of the fake agents' reports (and a short real sleep, for the controller's tick)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def sleep(self, seconds: float) -> None:
        self.fleet.round()
        time.sleep(min(seconds, 0.1))


@pytest.mark.slow
def test_agentctl_waits_for_submit_drain_and_restart_through_the_real_controller(
    tmp_path: Path, controllers: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`job submit --wait` (to the first step), `drain --wait` (to drained) and `restart
    --wait` (the drained node swapped for the spare, to the first step) print their steps and
    end 0, read from the controller's own job and node views."""
    controllers.append(start_controller(config(tmp_path), log_path=tmp_path / "c.log"))
    fleet = Fleet({"n1": "active", "n2": "active", "n3": "spare"})
    fleet.url = controllers[0].url
    fleet.register()
    monkeypatch.setenv("TRAINGUARD_URL", fleet.url)
    monkeypatch.setenv("TRAINGUARD_TOKEN", OP_TOKEN)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    spec = tmp_path / "job.yaml"
    spec.write_text("name: job\ncommand: [examples/train.py]\nnodes: [n1, n2]\n")

    def agentctl(*argv: str) -> tuple[int, list[str], str]:
        out, err = io.StringIO(), io.StringIO()
        code = agentctl_main(
            [*argv, "--wait", "--timeout", "60s", "-o", "name"],
            stdout=out,
            stderr=err,
            clock=FleetClock(fleet),
        )
        return code, err.getvalue().splitlines(), out.getvalue()

    code, steps, out = agentctl("job", "submit", str(spec))
    assert (code, out) == (0, "job/job\n"), steps
    assert steps[0] == "job/job started: attempt 1 on n1,n2"
    assert steps[-1].startswith("job/job first step: attempt 1 at step ")

    code, steps, _ = agentctl("drain", "n1")
    assert code == 0, steps
    assert steps[-2:] == [
        "node/n1 drained",
        "job/job ran on node/n1: `agentctl restart job --wait` moves it to a spare",
    ]

    code, steps, _ = agentctl("restart", "job")
    assert code == 0, steps
    assert "job/job spare in: n3 for n1" in steps
    assert "job/job restarted: attempt 2 on n3,n2" in steps
    assert steps[-1].startswith("job/job first step: attempt 2 at step ")
