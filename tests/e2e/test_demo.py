"""`make demo` end to end (the closed-loop acceptance test), and its clean-up on Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.devkit.devcluster import REPO_ROOT, marked_pids, wait_until

pytestmark = pytest.mark.slow
DEMO = REPO_ROOT / "examples" / "demo.py"


def test_demo_recovers_from_a_dbe_and_matches_the_reference_run(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, str(DEMO)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "demo-report.json").read_text())
    assert report["fault"]["kind"] == "dbe" and report["fault"]["node"] == "node-2"
    assert report["drained_node"] == "node-2" and report["spare_node"] == "node-4"
    assert report["loss_matches_reference"] is True and report["loss_mismatches"] == []
    assert report["first_step_after_restart"] > report["checkpoint_step"] >= 1
    assert report["checkpoint_proactive"] is True
    for key in ("detected_after_s", "checkpoint_s", "restarted_after_s", "mttr_s"):
        assert isinstance(report[key], float) and report[key] >= 0, key
    assert isinstance(report["lost_steps"], int)
    png = tmp_path / "demo-loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for line in ("detected", "drained", "node-2 -> node-4", "mitigated", "match"):
        assert line in r.stdout, line
    run_id = (tmp_path / "demo-run" / ".devcluster").read_text().strip()
    assert marked_pids(run_id) == set()


def workers(run_id: str) -> bool:
    for pid in marked_pids(run_id):
        try:
            if b"\0RANK=" in Path(f"/proc/{pid}/environ").read_bytes():
                return True
        except OSError:
            continue
    return False


def test_ctrl_c_mid_demo_leaves_no_process_behind(tmp_path: Path) -> None:
    # A test run started in the background by a non-interactive shell (`make test &`) inherits
    # SIGINT ignored, and an ignored signal stays ignored across exec: the demo would never see
    # the Ctrl-C. A handled one is reset to the default by exec, so handle it while spawning.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        demo = subprocess.Popen(
            [sys.executable, str(DEMO)],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        marker = tmp_path / "demo-run" / ".devcluster"
        wait_until(marker.exists, timeout_s=60, what="the demo's cluster to start")
        run_id = marker.read_text().strip()
        # mid-run: the job's workers (grandchildren of the agents) are up
        wait_until(lambda: workers(run_id), timeout_s=90, what="training workers")
        demo.send_signal(signal.SIGINT)
        out, _ = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
    assert demo.returncode == 130, out
    assert "interrupted" in out
    assert marked_pids(run_id) == set()
