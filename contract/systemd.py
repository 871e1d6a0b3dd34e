"""sd_notify over $NOTIFY_SOCKET with the standard library only: READY, WATCHDOG, STOPPING.

Without NOTIFY_SOCKET (not started by systemd with Type=notify) every call is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger("trainguard.agent.systemd")


class SystemdNotifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET", "")
        # "@name" is an abstract-namespace socket: the leading NUL byte replaces the "@"
        self._address = "\0" + raw[1:] if raw.startswith("@") else raw
        self._sock: socket.socket | None = None
        if self._address:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.setblocking(False)
        self.watchdog_interval_s = _watchdog_interval_s(env)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, message: str) -> bool:
        """Send one notification; False (and a debug line) if it could not be sent."""
        if self._sock is None:
            return False
        try:
            self._sock.sendto(message.encode(), self._address)
        except OSError as e:
            log.debug(
                "event=sd_notify_failed message=%s error=%s", message.split("=", maxsplit=1)[0], e
            )
            return False
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_interval_s(env: Mapping[str, str]) -> float | None:
    """WatchdogSec as systemd passes it (WATCHDOG_USEC, for our pid), in seconds."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1e6
