"""The heartbeat socket belongs to one agent: a second agent on the same path refuses to start
and never unlinks the live socket; the socket is not world-writable by default."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import wait_for
from trainguard.agent.heartbeat import HeartbeatServer
from trainguard.clock import FakeClock
from trainguard.protocol import Heartbeat, encode_json


@pytest.fixture
def sockdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="tgown", dir="/tmp"))  # unix socket paths are short
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _send(path: Path, rank: int) -> None:
    hb = Heartbeat(job="j", rank=rank, local_rank=rank, step=1, t=1.0)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(encode_json(hb), str(path))


def test_a_second_server_on_the_same_path_is_refused_and_the_first_keeps_working(
    sockdir: Path,
) -> None:
    path = sockdir / "hb.sock"
    first = HeartbeatServer(path=path, clock=FakeClock())
    try:
        with pytest.raises(OSError) as e:
            HeartbeatServer(path=path, clock=FakeClock())
        assert e.value.errno == errno.EADDRINUSE
        assert f"pid {os.getpid()}" in str(e.value)
        assert stat.S_ISSOCK(path.lstat().st_mode)  # not unlinked by the refused one
        _send(path, 0)
        assert first.drain() == 1
        assert [r.rank for r in first.ranks()] == [0]
    finally:
        first.close()
    assert not path.exists()
    second = HeartbeatServer(path=path, clock=FakeClock())  # the owner is gone: free again
    second.close()


LOCK_HOLDER = """
import sys, time
from trainguard.agent.heartbeat import HeartbeatServer
from trainguard.clock import FakeClock
srv = HeartbeatServer(path=sys.argv[1], clock=FakeClock())
print("bound", flush=True)
time.sleep(300)
"""


def test_the_lock_of_a_killed_agent_does_not_block_its_successor(sockdir: Path) -> None:
    path = sockdir / "hb.sock"
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "bound"
        with pytest.raises(OSError, match=f"pid {proc.pid}"):
            HeartbeatServer(path=path, clock=FakeClock())
    finally:
        proc.kill()
        proc.wait()
    assert stat.S_ISSOCK(path.lstat().st_mode)  # kill -9 left its socket behind
    srv = wait_for(
        lambda: _try_bind(path), timeout_s=10, what="the dead agent's lock to be released"
    )
    srv.close()


def _try_bind(path: Path) -> HeartbeatServer | None:
    try:
        return HeartbeatServer(path=path, clock=FakeClock())
    except OSError:
        return None


def test_default_mode_lets_every_user_send_and_group_is_configurable(sockdir: Path) -> None:
    # every local user's ranks may send: the kernel names each sender and a process speaks
    # only for its own job (agent.senders), so an open socket gives no one another's job
    path = sockdir / "hb.sock"
    gid = os.getgid()
    srv = HeartbeatServer(path=path, clock=FakeClock(), group=str(gid))
    try:
        st = path.lstat()
        assert stat.S_IMODE(st.st_mode) == 0o666
        assert st.st_gid == gid
    finally:
        srv.close()


def test_an_unknown_group_is_an_error_naming_it(sockdir: Path) -> None:
    with pytest.raises(OSError, match="unknown group 'no-such-group-x'"):
        HeartbeatServer(path=sockdir / "hb.sock", clock=FakeClock(), group="no-such-group-x")
    # the failed start released its lock: a correct one starts
    HeartbeatServer(path=sockdir / "hb.sock", clock=FakeClock()).close()
