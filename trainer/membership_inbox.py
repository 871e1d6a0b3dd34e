"""`MembershipInbox`: the `rejoin` Controls a rank received on its control socket, kept until
the rank waits for its place in a re-formed world (docs/trainer.md, "In-process rejoin").

The controller decides on a re-formed world as soon as it learns of a lost rank, so a
rank's `rejoin` may arrive before the rank saw a collective fail. Every poll of the control
socket is sorted here: the membership with the newest epoch is kept (of one epoch, the one
received last), one whose epoch is not newer than the rank's is logged and dropped, and every
other Control goes on to the step agreement. `wait()` blocks on the socket until a membership
is there; `RejoinFailed` after its timeout (the job then takes a full restart).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.membership import Membership
from trainguard.protocol import Control
from trainguard.trainer.channel import AgentChannel
from trainguard.trainer.rejoin import RejoinFailed

__all__ = ["MembershipInbox"]

log = logging.getLogger("trainguard.trainer")

# How long one blocking read of the socket lasts inside wait(): the deadline is the clock's.
_WAIT_SLICE_S = 0.5


class MembershipInbox:
    """One rank's pending membership. `epoch()` is the rank's current attempt epoch (None:
    unfenced, any membership is newer); it is read whenever a membership is judged, so a
    rank that rejoined meanwhile drops what its new epoch made stale."""

    def __init__(
        self, *, job: str, rank: Callable[[], int], epoch: Callable[[], int | None]
    ) -> None:
        self.job = job
        self._rank = rank
        self._epoch = epoch
        self._pending: Membership | None = None
        self._request_id = ""

    @property
    def pending(self) -> Membership | None:
        """The membership `take()` would return (None: none, or none newer than the rank's)."""
        if self._pending is not None and not self._newer(self._pending):
            self._drop(self._pending, self._request_id, reason="not_newer_than_rank")
            self._pending = None
        return self._pending

    def sort(self, controls: Iterable[Control]) -> list[Control]:
        """Keep the memberships of `rejoin` Controls; return every other Control, in order."""
        others: list[Control] = []
        for c in controls:
            if c.action != "rejoin":
                others.append(c)
            elif c.job and c.job != self.job:
                log.warning(
                    "event=control_rejected job=%s other_job=%s action=rejoin", self.job, c.job
                )
            elif c.membership is not None:  # the decoder checked it (and that it is set)
                self._offer(Membership.from_json(c.membership), c.request_id)
        return others

    def take(self) -> Membership | None:
        """The pending membership, removed (None: none newer than the rank's epoch)."""
        m = self.pending
        self._pending = None
        return m

    def wait(
        self,
        channel: AgentChannel,
        *,
        timeout_s: float,
        others: Callable[[list[Control]], None],
        clock: Clock = SYSTEM_CLOCK,
    ) -> Membership:
        """Block until a membership newer than the rank's epoch is here and take it; Controls
        of other actions read meanwhile go to `others` (the agreement keeps them for the new
        world). `RejoinFailed` after `timeout_s`, or at once without a control socket."""
        deadline = clock.monotonic() + timeout_s
        while True:
            others(self.sort(channel.poll()))
            m = self.take()
            if m is not None:
                return m
            if channel.control_socket is None:
                raise RejoinFailed("no control socket: a membership cannot reach this rank")
            left_s = deadline - clock.monotonic()
            if left_s <= 0:
                raise RejoinFailed(
                    f"no rejoin Control on {channel.control_socket} within {timeout_s:.0f} s"
                )
            channel.wait_readable(min(left_s, _WAIT_SLICE_S))

    def _offer(self, m: Membership, request_id: str) -> None:
        if not self._newer(m):
            self._drop(m, request_id, reason="not_newer_than_rank")
            return
        held = self._pending
        if held is not None and m.epoch < held.epoch:
            self._drop(m, request_id, reason="older_than_pending")
            return
        if held is not None:
            self._drop(held, self._request_id, reason="superseded")
        self._pending, self._request_id = m, request_id
        log.info(
            "event=rejoin_received job=%s rank=%d request_id=%s epoch=%d new_rank=%d "
            "world_size=%d host_store=%s",
            self.job,
            self._rank(),
            request_id,
            m.epoch,
            m.rank,
            m.world_size,
            m.host_store,
        )

    def _newer(self, m: Membership) -> bool:
        epoch = self._epoch()
        return epoch is None or m.epoch > epoch

    def _drop(self, m: Membership, request_id: str, *, reason: str) -> None:
        log.warning(
            "event=rejoin_ignored job=%s rank=%d request_id=%s epoch=%d rank_epoch=%s reason=%s",
            self.job,
            self._rank(),
            request_id,
            m.epoch,
            self._epoch(),
            reason,
        )
