"""After SIGTERM the process exits within `sigterm_grace_s`, whatever its shutdown is doing.

Each case is a real process: it takes SIGTERM, leaves its loop through the emergency
checkpoint, calls close(), and then gets stuck in interpreter shutdown, in a way that would
hold it forever without the watchdog.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.trainer.manifest import find_latest_good

_SCRIPT = """
import atexit, logging, os, signal, sys, threading, time
import torch
from trainguard.trainer import Trainguard

logging.basicConfig(level=logging.INFO, stream=sys.stderr)
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
grace_s = float(sys.argv[2])
tg = Trainguard(model=model, optimizer=opt, ckpt_dir=sys.argv[1], sigterm_grace_s=grace_s)
step = tg.resume(first_step=1)
while True:
    loss = model(torch.ones(1, 4)).sum()
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 3:
        os.kill(os.getpid(), signal.SIGTERM)
    action = tg.step(step, loss=loss)
    if action.stop:
        print(f"stopped step={step} reason={action.reason}", flush=True)
        break
    step += 1
tg.close()
STUCK
"""

_STUCK = {
    # an exit hook that never returns (multiprocessing joining a child that will not die)
    "atexit-hook": "atexit.register(threading.Event().wait)",
    # a non-daemon thread that never ends: threading's shutdown joins it
    "thread-join": "threading.Thread(target=threading.Event().wait).start()",
}


def _run(tmp_path: Path, stuck: str, *, grace_s: float = 4.0) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(_SCRIPT).replace("STUCK", stuck))
    try:
        return subprocess.run(
            [sys.executable, str(script), str(tmp_path / "ck"), str(grace_s)],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,  # stuck forever without the watchdog
            env={"TRAINGUARD_AGENT_SOCKET": str(tmp_path / "absent.sock"), "PATH": ""},
        )
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"still running long after the grace: {e.stderr!r}") from None


@pytest.mark.parametrize("stuck", sorted(_STUCK))
def test_process_stuck_in_shutdown_after_close_exits_with_the_documented_code(
    tmp_path: Path, stuck: str
) -> None:
    done = _run(tmp_path, _STUCK[stuck])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stopped step=3 reason=sigterm" in done.stdout
    assert "event=sigterm_grace_expired" in done.stderr
    assert "exit_code=0" in done.stderr
    found = find_latest_good(tmp_path / "ck")
    assert found is not None and found[0] == 3, "the emergency checkpoint committed first"


def test_process_stuck_while_the_interpreter_finalizes_is_ended_by_the_backstop(
    tmp_path: Path,
) -> None:
    # A destructor that blocks during module teardown: no Python thread can run any more, so
    # only faulthandler's C watchdog can end the process (exit code 1, stacks on stderr).
    stuck = textwrap.dedent(
        """
        class Stuck:
            def __del__(self):
                time.sleep(3600)
        keep = Stuck()
        """
    )
    done = _run(tmp_path, stuck)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Timeout" in done.stderr and "__del__" in done.stderr
    found = find_latest_good(tmp_path / "ck")
    assert found is not None and found[0] == 3


def test_a_clean_exit_after_sigterm_keeps_its_own_exit_code(tmp_path: Path) -> None:
    # A grace far longer than an interpreter's normal shutdown: nothing fires.
    done = _run(tmp_path, "sys.exit(0)", grace_s=60.0)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "event=sigterm_grace_expired" not in done.stderr
