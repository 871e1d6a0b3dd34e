"""SystemdNotifier: messages on a real unix datagram socket; no-op without NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from trainguard.systemd import SystemdNotifier


def test_sends_ready_watchdog_stopping_to_notify_socket(short_tmp: Path) -> None:
    recv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    recv.bind(str(short_tmp / "notify"))
    recv.settimeout(5)
    try:
        n = SystemdNotifier({"NOTIFY_SOCKET": str(short_tmp / "notify")})
        assert n.enabled
        assert n.ready(status="serving") and n.watchdog() and n.stopping()
        got = [recv.recv(4096).decode() for _ in range(3)]
        assert got == ["READY=1\nSTATUS=serving", "WATCHDOG=1", "STOPPING=1"]
        n.close()
    finally:
        recv.close()


def test_abstract_socket_address_is_supported() -> None:
    name = f"tg-test-{os.getpid()}"
    recv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    recv.bind("\0" + name)
    recv.settimeout(5)
    try:
        assert SystemdNotifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert recv.recv(100) == b"READY=1"
    finally:
        recv.close()


def test_without_notify_socket_everything_is_a_noop() -> None:
    n = SystemdNotifier({})
    assert not n.enabled and not n.ready() and not n.watchdog()


def test_dead_notify_socket_is_not_fatal() -> None:
    assert SystemdNotifier({"NOTIFY_SOCKET": "/nonexistent/notify"}).watchdog() is False


def test_watchdog_interval_comes_from_watchdog_usec_for_our_pid() -> None:
    env = {"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}
    assert SystemdNotifier(env).watchdog_interval_s == 30.0
    assert SystemdNotifier({**env, "WATCHDOG_PID": "1"}).watchdog_interval_s is None
