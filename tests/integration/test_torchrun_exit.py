"""`python -m trainguard.trainer.torchrun`: torchrun with a bounded exit barrier. Two torchruns
of a static rendezvous on loopback (2 nodes, a rank each); node 1's torchrun and rank are
killed with SIGKILL (a lost node whose rank a warm standby took); node 0's rank finishes, and
its torchrun exits 0 after the short barrier instead of waiting torch's 300 s for node 1."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_for
from trainguard.trainer.torchrun import EXIT_BARRIER_ENV, EXIT_BARRIER_S, exit_barrier_s

pytestmark = pytest.mark.slow

WORKER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    d = Path(sys.argv[1])
    (d / os.environ["RANK"]).write_text(str(os.getpid()))
    if os.environ["RANK"] == "1":
        time.sleep(600)
    deadline = time.monotonic() + 120
    while not (d / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    """
)


def test_a_finished_node_does_not_wait_300_s_for_a_lost_one(tmp_path: Path) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    port = free_port()
    env = {**os.environ, EXIT_BARRIER_ENV: "2", "OMP_NUM_THREADS": "1"}
    procs = []
    for node_rank in (0, 1):
        cmd = [
            sys.executable, "-m", "trainguard.trainer.torchrun", "--nnodes", "2",
            "--nproc-per-node", "1", "--rdzv-backend", "static", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "exit-test", "--node-rank", str(node_rank),
            "--max-restarts", "0", str(worker), str(tmp_path),
        ]  # fmt: skip
        log = open(tmp_path / f"node{node_rank}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True))
    try:
        wait_for(
            lambda: ((tmp_path / "0").exists() and (tmp_path / "1").exists()) or None,
            timeout_s=120,
            what="both ranks started",
        )
        os.killpg(procs[1].pid, signal.SIGKILL)  # node 1 is lost: its torchrun and rank
        procs[1].wait(30)
        (tmp_path / "go").write_text("")
        # torch's own barrier would hold it 300 s; the limit is 2 s
        assert procs[0].wait(120) == 0, (tmp_path / "node0.log").read_text()[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(30)
    # torch says how long it waited: the 2 s asked for, not its own 300
    log = (tmp_path / "node0.log").read_text()
    waited = re.search(r"Error waiting on exit barrier\. Elapsed: ([0-9.]+) seconds", log)
    assert waited is not None and 2.0 <= float(waited.group(1)) < 300.0, log[-2000:]


def test_the_barrier_length_comes_from_the_environment_or_is_refused_naming_it() -> None:
    assert exit_barrier_s({}) == EXIT_BARRIER_S
    assert exit_barrier_s({EXIT_BARRIER_ENV: "5"}) == 5.0
    for bad in ("0", "-1", "nan", "inf", "1e9", "soon"):
        with pytest.raises(SystemExit, match=EXIT_BARRIER_ENV):
            exit_barrier_s({EXIT_BARRIER_ENV: bad})
