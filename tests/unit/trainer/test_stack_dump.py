"""The trainer registers a SIGUSR1 stack dump, and leaves a program's own handler alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # imports torch in a fresh interpreter

PROBE = """
import signal, sys
from trainguard.trainer import signals
{setup}
signals.register_stack_dump()
with open("/proc/self/status") as f:
    cgt = next(int(l.split()[1], 16) for l in f if l.startswith("SigCgt:"))
print("handled" if cgt >> (signal.SIGUSR1 - 1) & 1 else "default", signals.stack_dump_registered())
{after}
"""


def run(setup: str = "", after: str = "") -> str:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(setup=setup, after=after)],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return out.stdout + "|" + out.stderr


def test_sigusr1_dumps_every_thread_and_the_process_lives_on() -> None:
    got = run(after="import os; os.kill(os.getpid(), signal.SIGUSR1); print('alive', flush=True)")
    assert got.startswith("handled True\nalive\n")
    assert "Current thread 0x" in got or "Thread 0x" in got
    assert '"<string>", line' in got


def test_a_program_handler_for_sigusr1_is_left_alone() -> None:
    got = run(setup="signal.signal(signal.SIGUSR1, lambda *a: None)")
    assert got.startswith("handled False")
