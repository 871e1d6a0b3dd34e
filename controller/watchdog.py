"""The controller's systemd watchdog: WATCHDOG=1 from the API's event loop while the rule tick
loop is alive too, so a wedged event loop or a wedged tick thread gets the process restarted.

sd_notify itself is `trainguard.systemd.SystemdNotifier` (READY, WATCHDOG, STOPPING; a no-op
without NOTIFY_SOCKET). The pings run as a task on the event loop that serves the API: if that
loop blocks, no ping is sent. Each ping is also gated on `healthy()` (the tick thread finished
a round recently): a tick thread stuck on a lock or a hung store stops the pings as well.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from trainguard.systemd import SystemdNotifier

log = logging.getLogger("trainguard.controller.watchdog")


async def pet_watchdog(
    notifier: SystemdNotifier,
    *,
    healthy: Callable[[], bool],
    interval_s: float,
) -> None:
    """Send WATCHDOG=1 every `interval_s` while `healthy()`; runs until cancelled."""
    missed = False
    while True:
        if healthy():
            notifier.watchdog()
            if missed:
                log.info("event=watchdog_resumed")
            missed = False
        elif not missed:
            # one line per outage, not per skipped ping
            log.warning("event=watchdog_withheld reason=tick_loop_not_progressing")
            missed = True
        await asyncio.sleep(interval_s)


@contextlib.asynccontextmanager
async def watchdog_running(
    notifier: SystemdNotifier, *, healthy: Callable[[], bool]
) -> AsyncIterator[asyncio.Task[None] | None]:
    """Pet the watchdog from the running event loop for the duration of the block, at half
    of WatchdogSec (systemd's advice); nothing when systemd set no watchdog for this process."""
    interval_s = notifier.watchdog_interval_s
    if not notifier.enabled or interval_s is None:
        yield None
        return
    task = asyncio.get_running_loop().create_task(
        pet_watchdog(notifier, healthy=healthy, interval_s=interval_s / 2)
    )
    log.info("event=watchdog_started interval_s=%g", interval_s)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


__all__ = ["pet_watchdog", "watchdog_running"]
