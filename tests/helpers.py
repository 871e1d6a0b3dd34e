"""Small helpers every test may use: waiting on a condition with a deadline, a free loopback
port, a short temporary directory for unix sockets, whether a process still runs. Fixtures
live in conftest.py files."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
) -> T:
    """Call `condition` until it returns a truthy value and return that value; after
    `timeout_s` (wall clock) raise AssertionError naming `what` was awaited. The condition
    is called at least once, and once more at the deadline; what it raises propagates."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            raise AssertionError(
                f"timed out after {timeout_s:g} s waiting for {what} (last value: {value!r})"
            )
        time.sleep(min(interval_s, left_s))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server started elsewhere)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def short_tmpdir(prefix: str = "tg") -> Path:
    """A new directory under /tmp: unix socket paths are limited to 107 bytes, and pytest's
    tmp_path can be longer. The caller removes it (or uses the `short_tmp` fixture)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def alive(pid: int) -> bool:
    """Whether `pid` still runs: a zombie has ended (an orphaned one is its new parent's to
    reap), and so has a pid with no /proc entry."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # gone, or ended between the open and the read
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "examples" / "train.py")


def run_trainer(
    args: list[str], *, agent_socket: str, timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    """Run `python ARGS` (examples/train.py or a wrapper of it) from the repo, one thread, its
    heartbeats to `agent_socket`, no chaos; output captured, the exit code left to the test."""
    env = {"TRAINGUARD_AGENT_SOCKET": agent_socket, "TRAINGUARD_CHAOS": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *args],
        check=False,
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
