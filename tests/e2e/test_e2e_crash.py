"""Crash consistency and daemon lifecycle on a real local cluster (controller, nine sim agents,
torchrun jobs): kill -9 of the controller at every step boundary of a DBE remediation, and
right after it acknowledged the report carrying the DBE; an agent restarted (SIGTERM, kill -9)
under a running job; NVML hung on a node of a running job. Each ends with the job trained to
its last step with every loss equal to an uninterrupted run's, and the agents' own records
showing one live attempt at a time (tests/e2e/chaos.py)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e.chaos import (
    STEPS,
    check_one_live_attempt,
    check_recovery,
    job_spec,
    new_incidents,
    now,
    run_until_step,
)
from tests.e2e.reference import Reference
from trainguard.devkit.devcluster import REPO_ROOT, ClusterConfig, DevCluster, compare_losses

pytestmark = pytest.mark.slow

# 40 steps of 0.4 s: a fault at step 8 leaves the job 13 s of training, room for a controller
# restart before the remediation stops it (the losses do not depend on the step time)
STEP_TIME_S = 0.4
FAULT_STEP = 8
DBE_RULES = {"gpu_uncorrectable_ecc", "gpu_fatal_xid"}
DBE_STEPS = ["checkpoint", "drain", "replace", "restart"]
BOUNDARIES = ["notify", *DBE_STEPS]
LIVE_JOB_STATES = ("pending", "running", "restarting")


class Hook:
    """A webhook receiver for the controller's notifications. `hold(node)` makes it keep the
    next trigger about an incident on that node unanswered until `release()`: the notify step
    is then running, its delivery in flight."""

    def __init__(self) -> None:
        self.deliveries: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._hold_node: str | None = None
        self.held = threading.Event()
        self._release = threading.Event()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with hook._lock:
                    hook.deliveries.append(body)
                    hold = (
                        body["event"] == "trigger"
                        and hook._hold_node is not None
                        and body["incident"]["node"] == hook._hold_node
                    )
                    if hold:
                        hook._hold_node = None
                if hold:
                    hook.held.set()
                    hook._release.wait(60)
                with contextlib.suppress(OSError):
                    self.send_response(200)
                    self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def hold(self, node: str) -> None:
        with self._lock:
            self._hold_node = node
        self.held.clear()
        self._release.clear()

    def release(self) -> None:
        self._release.set()

    def triggers(self, incident_id: int) -> list[str]:
        """The idempotency keys of every trigger delivered about the incident, in order."""
        with self._lock:
            return [
                d["idempotency_key"]
                for d in self.deliveries
                if d["event"] == "trigger" and d["incident"]["id"] == incident_id
            ]

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()


class Crash:
    def __init__(self, cluster: DevCluster, hook: Hook) -> None:
        self.cluster = cluster
        self.hook = hook
        self.reference: list[dict[str, Any]] = []
        self.job: str | None = None  # the scenario's job, stopped after it if still live

    def config(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads((self.cluster.run_dir / "controller.yaml").read_text())
        return out

    def write_config(self, cfg: dict[str, Any]) -> None:
        (self.cluster.run_dir / "controller.yaml").write_text(json.dumps(cfg, indent=2) + "\n")

    def restart_controller(self, cfg: dict[str, Any]) -> None:
        """A clean restart (SIGTERM) of the controller with `cfg` as its config."""
        self.cluster.kill_controller(signal.SIGTERM)
        self.write_config(cfg)
        self.cluster.start_controller()

    def free_nodes(self, count: int = 3) -> list[str]:
        """`count` active, reporting, non-spare nodes in no live job (names in order)."""
        jobs = self.cluster.api("GET", "/v1/jobs")
        live = {j["name"] for j in jobs if j["state"] in LIVE_JOB_STATES}
        free = sorted(
            n["name"]
            for n in self.cluster.nodes()
            if n["role"] == "active"
            and n["state"] == "active"
            and n["reporting"]
            and n.get("job") not in live
        )
        assert len(free) >= count, f"only {free} free"
        return free[:count]

    def drained(self) -> set[str]:
        return {n["name"] for n in self.cluster.nodes() if n["state"] != "active"}


def write_rules(path: Path) -> None:
    # the shipped rules; a stale source opens its (notify-only) incident after 1 s, not 30 s,
    # so the hung-NVML scenario sees it open while its job still trains
    doc = yaml.safe_load((REPO_ROOT / "rules" / "default.yaml").read_text())
    for rule in doc["rules"]:
        if rule["name"] == "agent_source_stale":
            rule["for"] = "1s"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


@pytest.fixture(scope="module")
def crash(tmp_path_factory: pytest.TempPathFactory, reference: Reference) -> Iterator[Crash]:
    reference.start()  # trains while the cluster comes up
    base = Path(tmp_path_factory.mktemp("crash"))
    rules_file = base / "rules.yaml"
    write_rules(rules_file)
    config = ClusterConfig(
        active=("node-1", "node-2", "node-3"),
        # one spare per remediation the module runs (five boundaries, one acknowledged DBE)
        spares=tuple(f"spare-{i}" for i in range(1, 7)),
        rules=(str(rules_file),),
        safety={"drain_budget": 100, "breaker_threshold": 100},
        # the sick node stays drained, as these checks expect: the node lifecycle after a
        # drain (lifecycle.auto_repair) is test_e2e_chaos.py's and the unit tests'
        lifecycle={"auto_repair": False},
        jobs={
            "checkpoint_timeout_s": 5,
            "stop_grace_s": 5,
            "stop_timeout_s": 10,
            "progress_timeout_s": 90,
        },
    )
    hook = Hook()
    try:
        with DevCluster(base / "cluster", config) as cluster:
            cluster.start()
            world = Crash(cluster, hook)
            cfg = world.config()
            cfg["notify"] = {"webhooks": [{"name": "hook", "url": hook.url}]}
            world.restart_controller(cfg)
            world.reference = reference.lines()
            yield world
        assert cluster.leftover_pids() == set()
    finally:
        hook.close()


@pytest.fixture(autouse=True)
def scenario(crash: Crash) -> Iterator[Crash]:
    """What a scenario leaves behind (a failed one) is undone before the next starts: the
    controller runs with the module's config, the scenario's job is stopped."""
    crash.job = None
    cfg = crash.config()
    yield crash
    c = crash.cluster
    if crash.config() != cfg or c.controller is None or not c.controller.alive():
        if c.controller is not None and c.controller.alive():
            c.kill_controller(signal.SIGTERM)
        crash.write_config(cfg)
        c.start_controller()
    job = crash.job
    if job is None:
        return
    if c.job(job)["state"] in LIVE_JOB_STATES:
        with contextlib.suppress(Exception):
            c.api("POST", f"/v1/jobs/{job}/stop")
        c.wait_job(job, lambda j: j["state"] not in LIVE_JOB_STATES, timeout_s=60, what="stop")
    c.wait(lambda: not c.rank_procs(job), timeout_s=30, what=f"{job}'s ranks to end")


_SAMPLE = re.compile(r"^(\w+)(?:\{(.*)\})? (\S+)$")


def sample_value(body: str, name: str, **labels: str) -> float | None:
    """The value of the first sample `name` with `labels` in a Prometheus text exposition."""
    for line in body.splitlines():
        m = _SAMPLE.match(line)
        if m is None or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return None


def agent_metric(c: DevCluster, node: str, name: str, **labels: str) -> float | None:
    port = c.agents[node].metrics_port
    try:
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return sample_value(body, name, node=node, **labels)


def incident_actions(c: DevCluster, since: float) -> dict[str, str]:
    """kind -> state of every action of the incidents opened since `since`."""
    out: dict[str, str] = {}
    for inc in new_incidents(c, since):
        for a in c.incident(inc["id"])["actions"]:
            out[a["kind"]] = a["state"]
    return out


def dbe_to_boundary(
    c: DevCluster, *, hook: Hook, job: str, sick: str, since: float, boundary: str
) -> None:
    """Inject a DBE on `sick` (GPU 1) and return once its remediation reached `boundary`."""
    if boundary == "notify":
        hook.hold(sick)
    c.inject(sick, "dbe", gpu=1)
    if boundary == "notify":
        # the trigger reached the receiver, unanswered: the notify step is mid-delivery
        c.wait(hook.held.is_set, timeout_s=60, what="the trigger notification")
    elif boundary == "restart":
        # further into the step than the replace boundary (where it has just begun): attempt 2
        # launched, the step waiting for it to train past the checkpoint
        c.wait(
            lambda: (
                incident_actions(c, since).get("restart") == "running"
                and c.job(job)["attempt"] == 2
            ),
            timeout_s=60,
            what="the restart step to launch attempt 2",
        )
    else:
        c.wait(
            lambda: incident_actions(c, since).get(boundary) in ("running", "succeeded"),
            timeout_s=60,
            what=f"the {boundary} step to run",
        )


def check_one_remediation(
    crash: Crash,
    job: str,
    detail: dict[str, Any],
    *,
    sick: str,
    nodes: list[str],
    drained_before: set[str],
) -> None:
    """After check_recovery: one checkpoint, drain, replace and restart, each run once; the
    job's attempt went from 1 to 2, its sick node out and drained (the only new drain), and
    the agents' records show attempt 1 on the old nodes ended before attempt 2 began on the
    new ones, each node launching each attempt once."""
    c = crash.cluster
    kinds = Counter(a["kind"] for a in detail["actions"] if a["kind"] != "notify")
    assert kinds == Counter(DBE_STEPS), detail["actions"]
    assert all(a["state"] == "succeeded" for a in detail["actions"]), detail["actions"]
    view = c.job(job)
    assert (view["attempt"], view["restarts"]) == (2, 1), view
    assert sick not in view["nodes"] and len(view["nodes"]) == 3, view
    assert crash.drained() - drained_before == {sick}
    found = check_one_live_attempt(c, job)
    assert sorted(x.node for x in found if x.attempt == 1) == sorted(nodes), found
    assert sorted(x.node for x in found if x.attempt == 2) == sorted(view["nodes"]), found
    # a trigger re-sent after the crash carries the same idempotency key (receiver dedupes)
    keys = crash.hook.triggers(detail["incident"]["id"])
    assert keys and len(set(keys)) == 1, keys


@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_kill9_of_the_controller_at_a_remediation_step_boundary_remediates_once(
    scenario: Crash, boundary: str
) -> None:
    crash = scenario
    c = crash.cluster
    job = crash.job = f"ctl-{boundary}"
    nodes = crash.free_nodes()
    sick = nodes[0]
    drained_before = crash.drained()
    # killed at notify, the controller restarts before the checkpoint step even began: on a
    # loaded machine 13 s of training could run the job to its end first (then the restart
    # resumes a finished job), so that case trains slower
    step_time_s = STEP_TIME_S * (2 if boundary == "notify" else 1)
    run_until_step(c, job_spec(c, job, nodes, step_time_s=step_time_s), FAULT_STEP)
    since = now()
    dbe_to_boundary(c, hook=crash.hook, job=job, sick=sick, since=since, boundary=boundary)
    seen = incident_actions(c, since)
    c.kill_controller(signal.SIGKILL)
    print(f"kill -9 at the {boundary} boundary; the steps just before: {seen}")
    crash.hook.release()
    c.start_controller()
    detail = check_recovery(
        c,
        job,
        crash.reference,
        since=since,
        fault_step=FAULT_STEP,
        rules=DBE_RULES,
        steps=DBE_STEPS,
    )
    check_one_remediation(crash, job, detail, sick=sick, nodes=nodes, drained_before=drained_before)


def test_a_dbe_acknowledged_right_before_a_kill9_is_remediated_once_after_the_restart(
    scenario: Crash,
) -> None:
    crash = scenario
    c = crash.cluster
    job = crash.job = "ack-crash"
    nodes = crash.free_nodes()
    sick = nodes[0]
    drained_before = crash.drained()
    # slower steps: two controller restarts pass before the remediation can stop the job, and
    # on a loaded machine the job must still be training when the restarted controller acts
    run_until_step(c, job_spec(c, job, nodes, step_time_s=4 * STEP_TIME_S), 3)
    # A controller that evaluates its rules once at start, then not for a minute: the report
    # carrying the DBE is stored and acknowledged, and no tick evaluates it before the kill.
    cfg = crash.config()
    crash.restart_controller({**cfg, "tick_interval_s": 60, "stale_after_s": 120})
    slow = c.controller
    assert slow is not None

    def evaluations() -> float:
        body = c.client.get("/metrics").text
        return sample_value(body, "trainguard_controller_rule_eval_seconds_count") or 0.0

    evaluated = c.wait(evaluations, timeout_s=30, what="the first rule evaluation")
    restarted = now()
    c.wait(
        lambda: all((c.node(n)["last_report_at"] or 0) > restarted for n in nodes),
        timeout_s=30,
        what="the job's nodes to report to the restarted controller",
    )
    xids = agent_metric(c, sick, "trainguard_agent_events_total", kind="xid") or 0.0
    since = now()
    fault_step = c.job(job)["last_step"]
    c.inject(sick, "dbe", gpu=1)
    # the XID event is counted with it spooled; the spool empty after that = acknowledged
    c.wait(
        lambda: (agent_metric(c, sick, "trainguard_agent_events_total", kind="xid") or 0) > xids,
        timeout_s=30,
        what="the agent to collect the DBE's XID",
    )
    c.wait(
        lambda: agent_metric(c, sick, "trainguard_agent_spool_events") == 0,
        timeout_s=30,
        what="the controller to acknowledge the DBE",
    )
    assert evaluations() == evaluated
    c.kill_controller(signal.SIGKILL)
    assert "event=incident_opened" not in slow.log()
    crash.write_config(cfg)
    c.start_controller()
    # the replayed DBE opens its incident while the job still trains (a timeout here shows
    # the controller's log: the replay, the first reports, the rules' verdicts)
    c.wait(
        lambda: new_incidents(c, since),
        timeout_s=60,
        what="the acknowledged DBE's incident after the restart",
    )
    assert c.job(job)["state"] in LIVE_JOB_STATES, c.job(job)
    detail = check_recovery(
        c,
        job,
        crash.reference,
        since=since,
        fault_step=fault_step,
        rules=DBE_RULES,
        steps=DBE_STEPS,
    )
    assert detail["incident"]["node"] == sick
    check_one_remediation(crash, job, detail, sick=sick, nodes=nodes, drained_before=drained_before)


def check_untouched(crash: Crash, job: str, *, nodes: list[str]) -> None:
    """The job finished as it started: attempt 1 on the same nodes, no restart, every loss
    equal to the reference's, each node's one launch ended after the job did."""
    c = crash.cluster
    view = c.wait_job(
        job,
        lambda j: j["state"] not in LIVE_JOB_STATES,
        timeout_s=120,
        what=f"job {job} to finish",
    )
    assert view["state"] == "completed", view
    assert (view["attempt"], view["restarts"], view["last_step"]) == (1, 0, STEPS), view
    assert sorted(view["nodes"]) == sorted(nodes), view
    lines = c.step_lines(job)
    assert {a for a, _ in lines} == {1}
    assert [x["step"] for _, x in lines] == list(range(1, STEPS + 1))
    assert compare_losses([[x for _, x in lines]], crash.reference) == []
    found = check_one_live_attempt(c, job)
    assert sorted((x.node, x.attempt) for x in found) == sorted((n, 1) for n in nodes), found
    assert all(c.node(n)["state"] == "active" for n in nodes)


def test_agent_restarts_by_sigterm_and_kill9_under_a_running_job_keep_it_training(
    scenario: Crash,
) -> None:
    crash = scenario
    c = crash.cluster
    job = crash.job = "agent-restarts"
    nodes = crash.free_nodes()
    run_until_step(c, job_spec(c, job, nodes, step_time_s=STEP_TIME_S), 5)
    ranks = {r.rank: r for r in c.rank_procs(job)}
    pids = {r.pid for r in ranks.values()}
    assert sorted(ranks) == [0, 1, 2]
    since = now()
    # rank 0's node (the rendezvous host, whose log holds the step lines) by SIGTERM, then
    # rank 1's by kill -9
    for node, sig in ((ranks[0].node, signal.SIGTERM), (ranks[1].node, signal.SIGKILL)):
        c.kill_agent(node, sig)
        c.start_agent(node)
        # the same workers, and the new agent hears their heartbeats
        assert {r.pid for r in c.rank_procs(job)} == pids, f"after {sig.name} of {node}'s agent"
        c.wait(
            lambda n=node: (
                (agent_metric(c, n, "trainguard_agent_heartbeats_received_total") or 0) > 0
            ),
            timeout_s=30,
            what=f"heartbeats at the new agent of {node}",
        )
        step = c.job(job)["last_step"]
        c.wait_job(
            job,
            lambda j, s=step: (j["last_step"] or 0) > s or j["state"] not in LIVE_JOB_STATES,
            timeout_s=30,
            what=f"{job} to train on after {sig.name} of {node}'s agent",
        )
    check_untouched(crash, job, nodes=nodes)
    assert new_incidents(c, since) == []


def test_a_hung_nvml_on_a_job_node_neither_stops_the_job_nor_drains_the_node(
    scenario: Crash,
) -> None:
    crash = scenario
    c = crash.cluster
    job = crash.job = "nvml-hang"
    nodes = crash.free_nodes()
    run_until_step(c, job_spec(c, job, nodes, step_time_s=STEP_TIME_S), 3)
    node = nodes[1]
    since = now()
    c.inject(node, "nvml_hang")
    try:
        stale = c.wait(
            lambda: [i for i in new_incidents(c, since) if i["rule"] == "agent_source_stale"],
            timeout_s=60,
            what="the agent_source_stale incident",
        )
        assert [i["node"] for i in stale] == [node]
        # the job is still at it, and the node's reports (its ranks' heartbeats in them) too
        at = now()
        assert c.job(job)["state"] == "running"
        assert agent_metric(c, node, "trainguard_agent_source_stale", source="gpu") == 1
        step = c.job(job)["last_step"]
        beats = agent_metric(c, node, "trainguard_agent_heartbeats_received_total") or 0
        c.wait(
            lambda: (
                (c.node(node)["last_report_at"] or 0) > at
                and (agent_metric(c, node, "trainguard_agent_heartbeats_received_total") or 0)
                > beats
            ),
            timeout_s=30,
            what=f"{node} to keep reporting and hearing heartbeats",
        )
        check_untouched(crash, job, nodes=nodes)
        assert step < STEPS
        # nothing but the warning opened, and it only notified
        found = new_incidents(c, since)
        assert {i["rule"] for i in found} == {"agent_source_stale"}, found
        for inc in found:
            kinds = {a["kind"] for a in c.incident(inc["id"])["actions"]}
            assert kinds <= {"notify"}, kinds
    finally:
        c.inject(node, "clear")
    c.wait(
        lambda: agent_metric(c, node, "trainguard_agent_source_stale", source="gpu") == 0,
        timeout_s=30,
        what="the GPU source to recover",
    )
