"""trainguard-controller with ingest worker processes (`--ingest-workers`): real controller,
real workers, a real agent, real HTTP on loopback."""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.helpers import alive, wait_for
from tests.integration.agent_proc import AgentProcess, cleanup, short_tmpdir
from tests.integration.controller_proc import (
    AGENT,
    OP,
    ControllerProcess,
    dbe_rules,
    write_config,
)
from trainguard.protocol import Report, encode_json

MAX_BODY_BYTES = 64 * 1024


class Proc(ControllerProcess):
    """The controller with its ingest workers."""

    def ready_workers(self) -> dict[int, int]:
        """worker index -> pid of the latest worker that said it was ready."""
        found = re.findall(r"event=ingest_worker_ready worker=(\d+) pid=(\d+)", self.log())
        return {int(w): int(pid) for w, pid in found}


def start(tmp_path: Path, *, workers: int = 2) -> Proc:
    cfg = write_config(tmp_path, rules=dbe_rules(), max_body_bytes=MAX_BODY_BYTES)
    proc = Proc(cfg, log_path=tmp_path / "controller.log", args=["--ingest-workers", str(workers)])
    try:
        proc.wait_listening(timeout_s=60, what="the controller and its workers to listen")
        assert len(proc.ready_workers()) == workers, proc.log()
    except BaseException:
        stop(proc)
        raise
    return proc


def stop(proc: Proc) -> None:
    proc.kill()
    for pid in proc.ready_workers().values():
        _kill_quietly(pid)


def _kill_quietly(pid: int) -> None:
    if alive(pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    proc = start(tmp_path_factory.mktemp("ingest"))
    try:
        yield proc
    finally:
        stop(proc)


def report(node: str, seq: int = 1) -> bytes:
    return encode_json(Report(node=node, instance="i1", seq=seq, sent_at=time.time()))


@pytest.mark.slow
def test_a_real_agent_reports_through_the_workers_and_runs_the_command_on_the_response(
    controller: Proc,
) -> None:
    workdir = short_tmpdir()
    (workdir / "token").write_text("agent-token\n")
    agent = AgentProcess(
        workdir,
        "--controller",
        controller.url,
        "--token-file",
        str(workdir / "token"),
        "--report-interval-s",
        "0.2",
    )
    try:
        with httpx.Client(base_url=controller.url, headers=OP, timeout=10) as c:

            def node_reporting() -> bool:
                nodes = {n["name"]: n for n in c.get("/v1/nodes").json()}
                return "node-1" in nodes and nodes["node-1"]["gpus"] == 8

            wait_for(node_reporting, timeout_s=30, what="node-1 to report through a worker")
            # the fault is a command for the agent: it rides on the response to a report
            r = c.post("/v1/nodes/node-1/faults", json={"kind": "dbe", "gpu": 2})
            assert r.status_code == 202, r.text

            def dbe_incident() -> bool:
                incidents = c.get("/v1/incidents", params={"node": "node-1"}).json()
                return any(i["rule"] == "gpu_dbe" for i in incidents)

            wait_for(dbe_incident, timeout_s=30, what="the injected DBE to open an incident")
    finally:
        agent.terminate()
        cleanup(workdir)
    assert "agent-token" not in controller.log()


@pytest.mark.parametrize(
    ("headers", "body", "status", "error"),
    [
        pytest.param({}, report("n-a"), 401, "missing bearer token", id="no-token"),
        pytest.param(
            {"Authorization": "Bearer nope"}, report("n-a"), 401, "unknown token", id="bad-token"
        ),
        pytest.param(OP, report("n-a"), 403, "role operator may not report", id="operator-token"),
        pytest.param(AGENT, b"x" * (MAX_BODY_BYTES + 1), 413, "body too large", id="too-large"),
        pytest.param(AGENT, b'{"v": 1}', 422, "invalid body", id="invalid-report"),
        pytest.param(AGENT, b"{", 400, "invalid JSON", id="invalid-json"),
        pytest.param(AGENT, report("n-ok"), 200, None, id="good-report"),
    ],
)
def test_reports_through_a_worker_get_the_cores_answers(
    controller: Proc, headers: dict[str, str], body: bytes, status: int, error: str | None
) -> None:
    r = httpx.post(f"{controller.url}/v1/reports", content=body, headers=headers, timeout=10)
    assert r.status_code == status, r.text
    if error is None:
        assert r.json()["commands"] == []
    else:
        assert r.json()["error"] == error
    if status == 401:
        assert r.headers["www-authenticate"] == "Bearer"


def test_the_api_is_forwarded_to_the_core_with_its_checks(controller: Proc) -> None:
    with httpx.Client(base_url=controller.url, timeout=10) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        assert c.get("/v1/nodes", headers=AGENT).status_code == 403
        assert c.get("/v1/nodes").status_code == 401
        r = c.get("/v1/incidents", params={"limit": 0}, headers=OP)
        assert r.status_code == 422, r.text
        # an oversized body with a bad token is refused for the token first, as without workers
        big = b"{" + b" " * MAX_BODY_BYTES + b"}"
        assert c.post("/v1/silences", content=big).status_code == 401
        assert c.post("/v1/silences", content=big, headers=OP).status_code == 413
        assert "trainguard_controller_reports_total" in c.get("/metrics").text
        assert c.get("/v1/openapi.json").json()["paths"]["/v1/reports"]


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_reports_keep_flowing(controller: Proc) -> None:
    before = controller.ready_workers()
    os.kill(before[0], signal.SIGKILL)
    wait_for(
        lambda: controller.ready_workers().get(0, before[0]) != before[0],
        timeout_s=30,
        what="worker 0 to be restarted",
    )
    assert "event=ingest_worker_exited worker=0" in controller.log()
    assert not alive(before[0])
    assert controller.ready_workers()[1] == before[1]
    # new connections land on either worker; all of them are answered by the core
    for i in range(8):
        r = httpx.post(f"{controller.url}/v1/reports", content=report(f"n-{i}"), headers=AGENT)
        assert r.status_code == 200, r.text


@pytest.mark.slow
def test_sigterm_stops_the_workers_then_the_controller(tmp_path: Path) -> None:
    proc = start(tmp_path)
    try:
        pids = list(proc.ready_workers().values())
        assert all(alive(pid) for pid in pids)
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(timeout=30) == 0, proc.log()
        assert not [pid for pid in pids if alive(pid)], proc.log()
        assert "event=controller_stopped" in proc.log()
    finally:
        stop(proc)


@pytest.mark.slow
def test_a_killed_controller_takes_its_workers_with_it(tmp_path: Path) -> None:
    proc = start(tmp_path)
    try:
        pids = list(proc.ready_workers().values())
        proc.popen.kill()
        proc.popen.wait(timeout=10)
        wait_for(
            lambda: not any(alive(pid) for pid in pids),
            timeout_s=15,
            what=f"workers {pids} to exit after the controller was killed",
        )
    finally:
        stop(proc)
