"""Same-node forgery, tried for real: a root agent launches `victim` as an unprivileged user, and
another process of that same user, not started by the launch, sends heartbeats for the job (a
phantom rank 7, a NaN loss 12,800 steps ahead, a fake `nan_rollback`). The agent's reports
carry only the job's own rank and none of the forged events; the refusals are counted on the
agent's /metrics."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.fakes.controller_service import FakeController
from tests.helpers import wait_for
from tests.integration.agent_proc import AgentProcess, sample_value
from tests.integration.test_agent_jobs_as_user import (
    JOB_USER,
    LAUNCHER,
    interpreter_for,
    job_user,
    send,
    start_job,
)

pytestmark = pytest.mark.slow

# The job: rank 0 of `victim`, one heartbeat every 0.1 s until told to stop.
VICTIM = """\
import json, os, socket, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
step = 0
stop = os.path.join(os.environ["OUT_DIR"], "stop")
while not os.path.exists(stop) and step < 3000:
    step += 1
    hb = {"job": "victim", "rank": 0, "step": step, "t": time.time(), "loss": 2.0}
    try:
        sock.sendto(json.dumps(hb).encode(), os.environ["TRAINGUARD_AGENT_SOCKET"])
    except OSError:
        pass
    time.sleep(0.1)
"""

# The forger: the same user, a process of its own (not under the launch).
FORGER = """\
import json, socket, sys, time
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
forged = [
    {"job": "victim", "rank": 7, "step": 5, "t": time.time()},
    {"job": "victim", "rank": 0, "step": 12800, "t": time.time(), "loss": "NaN",
     "event": "nan_loss"},
    {"job": "victim", "rank": 0, "step": 1, "t": time.time(), "event": "nan_rollback"},
]
for _ in range(5):
    for hb in forged:
        sock.sendto(json.dumps(hb).encode(), sys.argv[1])
    time.sleep(0.1)
"""


def test_a_process_outside_the_launch_cannot_speak_for_the_job(
    short_tmp: Path, fake_controller: FakeController
) -> None:
    user = job_user()
    short_tmp.chmod(0o755)
    code = short_tmp / "code"
    code.mkdir(mode=0o755)
    python = interpreter_for(user)
    launcher = code / "launcher"
    launcher.write_text(LAUNCHER.format(python=python))
    launcher.chmod(0o755)
    (code / "victim.py").write_text(VICTIM)
    (code / "forger.py").write_text(FORGER)
    for f in ("victim.py", "forger.py"):
        (code / f).chmod(0o644)
    out = short_tmp / "out"
    out.mkdir(mode=0o700)
    os.chown(out, user.pw_uid, user.pw_gid)
    token = short_tmp / "token"
    token.write_text(fake_controller.agent_token)
    token.chmod(0o600)
    config = short_tmp / "agent.yaml"
    config.write_text(f"jobs:\n  run_as_user: {JOB_USER}\n  allowed_paths: [{code}]\n")
    agent = AgentProcess(
        short_tmp, "--config", str(config), "--controller", fake_controller.url,
        "--token-file", str(token), "--report-interval-s", "0.2", "--collect-interval-s", "0.2",
    )  # fmt: skip
    try:
        started = send(
            fake_controller,
            start_job("start-v", job="victim", program="victim.py", launcher=launcher, out=out),
        )
        assert started.data["ok"] is True, started.data["message"]

        def victim_ranks() -> list[tuple[int, int]]:
            reports = fake_controller.reports
            ranks = reports[-1].ranks if reports else ()
            return [(r.rank, r.step) for r in ranks if r.job == "victim"]

        wait_for(victim_ranks, timeout_s=60, what="victim's rank 0 in a report")
        forger = subprocess.run(
            [python, str(code / "forger.py"), str(agent.socket_path)],
            user=user.pw_uid, group=user.pw_gid, capture_output=True, text=True, timeout=60,
            check=False, cwd="/",
        )  # fmt: skip
        assert forger.returncode == 0, forger.stderr

        def refused() -> float:
            return sample_value(agent.metrics(), "trainguard_agent_heartbeats_dropped_total",
                                reason="sender_not_allowed") or 0.0  # fmt: skip

        wait_for(lambda: refused() >= 15, timeout_s=30, what="the forged heartbeats refused")
        n_reports = len(fake_controller.reports)
        wait_for(lambda: len(fake_controller.reports) > n_reports + 3, timeout_s=30,
                 what="more reports after the forgery")  # fmt: skip
        assert {rank for rank, _ in victim_ranks()} == {0}
        assert all(step < 12_800 for _, step in victim_ranks())
        assert [e for e in fake_controller.events_of("nan_loss") if e.job == "victim"] == []
        assert not [e for e in fake_controller.events_of("trainer_event") if e.job == "victim"], (
            "the forged nan_rollback event reached the controller"
        )
        assert "event=heartbeat_sender_refused reason=not_the_jobs_process" in agent.log()
        (out / "stop").write_text(json.dumps({"stop": True}))
    finally:
        assert agent.terminate() == 0, agent.log()
