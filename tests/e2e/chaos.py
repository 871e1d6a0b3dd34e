"""Shared helpers for the whole-loop chaos tests: the job, the reference run, and the checks
every scenario ends with (trained to the end, losses equal the reference, one incident with
one restart, a complete timeline in order, one live attempt at a time on the agents)."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.devkit.devcluster import (
    REPO_ROOT,
    DevCluster,
    compare_losses,
    read_step_lines,
)

STEPS = 40


def train_args(*, step_time_s: float = 0.2) -> list[str]:
    """examples/train.py's arguments. The step time only pads each step (it stands in for
    device time), so runs with different step times log the same losses."""
    return [
        "--steps", str(STEPS), "--checkpoint-every", "5", "--step-time-s", str(step_time_s),
        "--seed", "0",
    ]  # fmt: skip


TRAIN_ARGS = train_args()


def job_spec(
    cluster: DevCluster,
    name: str,
    nodes: list[str],
    *,
    step_time_s: float = 0.2,
    command: list[str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A job of examples/train.py (or of `command`: a script under the repository and its
    arguments) on `nodes`, one rank per node."""
    return {
        "name": name,
        "command": command or ["examples/train.py", *train_args(step_time_s=step_time_s)],
        "nodes": nodes,
        "nproc_per_node": 1,
        "ckpt_dir": str(cluster.run_dir / "ckpt" / name),
        "cwd": str(REPO_ROOT),
        "max_restarts": 3,
        **extra,
    }


def start_reference(
    cluster: DevCluster,
    *,
    world: int = 3,
    step_time_s: float = 0.2,
    name: str = "reference",
    command: list[str] | None = None,
    ckpt_flag: str = "--ckpt-dir",
) -> Any:
    """The same job uninterrupted at the same world size (torchrun --standalone): the default
    job's, or `command`'s (a script under the repository and its arguments, whose checkpoint
    directory `ckpt_flag` names); its output goes to `<run_dir>/<name>.log`."""
    script, *args = command or ["examples/train.py", *train_args(step_time_s=step_time_s)]
    return cluster.spawn(
        name,
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(world), str(REPO_ROOT / script),
            *args, ckpt_flag, str(cluster.run_dir / f"{name}-ckpt"),
        ],
        cwd=REPO_ROOT,
    )  # fmt: skip


def reference_lines(
    cluster: DevCluster,
    proc: Any,
    *,
    name: str = "reference",
    last_step: int = STEPS,
    timeout_s: float = 120,
) -> list[dict[str, Any]]:
    cluster.wait(lambda: proc.poll() is not None, timeout_s=timeout_s, what=f"the {name} run")
    lines = read_step_lines(cluster.run_dir / f"{name}.log")
    assert [x["step"] for x in lines] == list(range(1, last_step + 1)), f"{name} run incomplete"
    return lines


def run_until_step(
    cluster: DevCluster, spec: dict[str, Any], step: int, *, timeout_s: float = 90
) -> dict[str, Any]:
    cluster.submit_job(spec)
    return cluster.wait_job(
        spec["name"],
        lambda j: j["state"] == "running" and (j.get("last_step") or 0) >= step,
        timeout_s=timeout_s,
        what=f"job {spec['name']} at step {step}",
    )


def new_incidents(cluster: DevCluster, since: float) -> list[dict[str, Any]]:
    return [i for i in cluster.incidents() if i["opened_at"] >= since]


def check_recovery(
    cluster: DevCluster,
    job: str,
    reference: list[dict[str, Any]],
    *,
    since: float,
    fault_step: int,
    rules: set[str],
    steps: list[str],
    poisoned_from: int | None = None,
    last_step: int = STEPS,
    finish_timeout_s: float = 150,
) -> dict[str, Any]:
    """Wait for the job to finish, then check: it trained past the fault to the last step,
    every logged loss equals the reference's (but those the first attempt logged after step
    `poisoned_from`: a NaN fault there poisons the model on purpose, so they must be NaN),
    exactly one incident (of one of `rules`) with one restart, and its timeline holds opened,
    each of `steps` succeeding, then mitigated, in order with non-decreasing timestamps.
    `last_step`: the job's (STEPS for examples/train.py's). Returns the incident detail."""
    view = cluster.wait_job(
        job,
        lambda j: j["state"] in ("completed", "failed"),
        timeout_s=finish_timeout_s,
        what=f"job {job} to finish",
    )
    assert view["state"] == "completed", view
    assert view["last_step"] == last_step > fault_step, view
    assert view["restarts"] == 1, view
    attempts: dict[int, list[dict[str, Any]]] = {}
    for attempt, line in cluster.step_lines(job):
        attempts.setdefault(attempt, []).append(line)
    assert len(attempts) == 2, sorted(attempts)
    if poisoned_from is not None:
        first = min(attempts)
        poisoned = [x for x in attempts[first] if x["step"] > poisoned_from]
        assert poisoned and all(x["loss"] == "NaN" for x in poisoned), poisoned
        attempts[first] = [x for x in attempts[first] if x["step"] <= poisoned_from]
    assert compare_losses(list(attempts.values()), reference) == []
    logged = {x["step"] for lines in attempts.values() for x in lines}
    assert logged == set(range(1, last_step + 1))
    # the incident: one for the fault, mitigated (poll: the tick may trail the job's end)
    incidents = cluster.wait(
        lambda: (
            (found := new_incidents(cluster, since))
            and all(i["state"] in ("mitigated", "resolved") for i in found)
            and found
        ),
        timeout_s=30,
        what="the incident to be mitigated",
    )
    assert len(incidents) == 1, [(i["rule"], i["target"]) for i in incidents]
    assert incidents[0]["rule"] in rules
    detail = cluster.incident(incidents[0]["id"])
    restarts = [a for a in detail["actions"] if a["kind"] in ("restart", "rollback")]
    assert [a["state"] for a in restarts] == ["succeeded"], restarts
    timeline = detail["timeline"]
    stamps = [e["ts"] for e in timeline]
    assert stamps == sorted(stamps)
    wanted = ["opened", *[f"succeeded:{s}" for s in steps], "mitigated"]
    seen = []
    for e in timeline:
        if e["kind"] == "action_succeeded":
            kind = next((s for s in steps if f"step {s} #" in e["message"]), None)
            if kind is not None:
                seen.append(f"succeeded:{kind}")
        elif e["kind"] in ("opened", "mitigated"):
            seen.append(e["kind"])
    assert seen == wanted, [(e["kind"], e["message"][:80]) for e in timeline]
    return detail


# the agent's log lines for a launch of a job's node share (agent/jobs.py), stamped by its
# log format `ts=%Y-%m-%d %H:%M:%S,mmm level=L node=N` (local time, milliseconds)
_LAUNCH_LINE = re.compile(
    r"^ts=(?P<date>\S+) (?P<time>\d\d:\d\d:\d\d),(?P<ms>\d{3}) level=\S+ node=(?P<node>\S+) "
    r".*?event=job_(?P<what>started|exited) job=(?P<job>\S+) "
    r"attempt=(?P<attempt>\d+) pid=(?P<pid>\d+)"
)


@dataclass(frozen=True)
class Launch:
    """One attempt of a job on one node, as that node's agent recorded it: when it logged the
    spawn (just after it) and the reaped exit (after the launch and its leftovers ended)."""

    node: str
    attempt: int
    pid: int
    started_at: float  # unix s
    exited_at: float | None  # unix s; None: no exit recorded (yet)


def _stamp(m: re.Match[str]) -> float:
    wall = time.strptime(f"{m['date']} {m['time']}", "%Y-%m-%d %H:%M:%S")
    return time.mktime(wall) + int(m["ms"]) / 1000


def launches(cluster: DevCluster, job: str) -> list[Launch]:
    """Every launch of `job` on every node, read from the agents' logs (a restarted agent
    appends to the same log, so a launch it re-adopted is found with its exit)."""
    out: list[Launch] = []
    for name, node in cluster.agents.items():
        started: dict[tuple[int, int], float] = {}
        exited: dict[tuple[int, int], float] = {}
        for line in node.proc.log().splitlines():
            m = _LAUNCH_LINE.match(line)
            if m is None or m["job"] != job or m["node"] != name:
                continue
            key = (int(m["attempt"]), int(m["pid"]))
            if m["what"] == "started":
                assert key not in started, f"{name}: attempt/pid {key} of {job} started twice"
                started[key] = _stamp(m)
            else:
                exited.setdefault(key, _stamp(m))
        for (attempt, pid), at in started.items():
            out.append(Launch(name, attempt, pid, at, exited.get((attempt, pid))))
    return sorted(out, key=lambda x: (x.attempt, x.started_at))


def check_one_live_attempt(
    cluster: DevCluster,
    job: str,
    *,
    ended: Mapping[str, float] | None = None,
    timeout_s: float = 30,
) -> list[Launch]:
    """The agents' own records prove the job never had two attempts alive at once: no launch
    of attempt N (on any node) exited after the first launch of a later attempt started, and
    no node launched one attempt twice. `ended` names nodes whose processes the test killed
    together with their agent (node -> unix time of the kill): their launches end then.
    Waits (bounded) until every launch's exit is recorded; returns the launches."""
    ended = dict(ended or {})

    def complete() -> list[Launch] | None:
        found = launches(cluster, job)
        done = all(x.exited_at is not None or x.node in ended for x in found)
        return found if found and done else None

    found = cluster.wait(complete, timeout_s=timeout_s, what=f"every launch of {job} to exit")
    per_node = [(x.node, x.attempt) for x in found]
    assert len(per_node) == len(set(per_node)), f"an attempt launched twice on a node: {found}"
    attempts = sorted({x.attempt for x in found})
    for earlier in attempts:
        ends = [x.exited_at if x.exited_at is not None else ended[x.node] for x in found
                if x.attempt == earlier]  # fmt: skip
        for later in (a for a in attempts if a > earlier):
            first = min(x.started_at for x in found if x.attempt == later)
            assert max(ends) <= first, (
                f"{job}: attempt {earlier} still ran at {max(ends):.3f} after attempt {later} "
                f"started at {first:.3f}: {found}"
            )
    return found


def now() -> float:
    return time.time()
