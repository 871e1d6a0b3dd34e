"""The controller's watchdog pings: WATCHDOG=1 at half of WatchdogSec while the tick loop is
alive, none while it is not, nothing at all without a systemd watchdog."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from trainguard.controller.watchdog import pet_watchdog, watchdog_running
from trainguard.systemd import SystemdNotifier


def _receiver(tmp_path: Path) -> tuple[socket.socket, str]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    return sock, path


def _received(sock: socket.socket) -> list[str]:
    got: list[str] = []
    try:
        while True:
            got.append(sock.recv(4096).decode())
    except BlockingIOError:
        return got


def test_pings_only_while_the_tick_loop_is_healthy(tmp_path: Path) -> None:
    sock, path = _receiver(tmp_path)
    notifier = SystemdNotifier({"NOTIFY_SOCKET": path})
    health = iter([True, True, False, False, True])
    seen: list[bool] = []

    def healthy() -> bool:
        value = next(health, False)
        seen.append(value)
        return value

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(
            pet_watchdog(notifier, healthy=healthy, interval_s=0.0)
        )
        while len(seen) < 6:  # every round asks once; a 0 s interval yields to the loop
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
        pings = _received(sock)
        # one ping per healthy round, none for the two unhealthy ones
        assert pings == ["WATCHDOG=1"] * seen.count(True)
        assert seen[:5] == [True, True, False, False, True]
    finally:
        notifier.close()
        sock.close()


def test_watchdog_runs_at_half_the_interval_systemd_set(tmp_path: Path) -> None:
    sock, path = _receiver(tmp_path)
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"}  # 20 ms: 10 ms between pings
    notifier = SystemdNotifier(env)
    got: list[str] = []

    async def main() -> None:
        async with watchdog_running(notifier, healthy=lambda: True) as task:
            assert task is not None
            deadline = asyncio.get_running_loop().time() + 10.0
            while got.count("WATCHDOG=1") < 2 and asyncio.get_running_loop().time() < deadline:
                got.extend(_received(sock))
                await asyncio.sleep(0.005)
        assert task.done()  # the block's end stops the pings

    try:
        asyncio.run(main())
        assert got.count("WATCHDOG=1") >= 2, got
    finally:
        notifier.close()
        sock.close()


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({}, id="no-notify-socket"),
        pytest.param({"NOTIFY_SOCKET": "/nonexistent/notify"}, id="no-watchdog-usec"),
        pytest.param(
            {"NOTIFY_SOCKET": "/nonexistent/notify", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"},
            id="watchdog-for-another-pid",
        ),
    ],
)
def test_no_watchdog_task_without_a_systemd_watchdog_for_this_process(env: dict[str, str]) -> None:
    notifier = SystemdNotifier(env)

    async def main() -> object:
        async with watchdog_running(notifier, healthy=lambda: True) as task:
            return task

    try:
        assert asyncio.run(main()) is None
    finally:
        notifier.close()
