"""`Telemetry`: the heartbeat a rank sends to its node's agent once per step, with the edge
events that ride on it.

It owns the queue of events (each part hands its events to `event()`; the next `send()` puts
each in a datagram of its own, the level fields repeated) and the newest committed checkpoint
it reports (`ckpt_step`, `ckpt_request_id`, updated by `report()` from the writer's results).
Sending never blocks: the channel drops a datagram the agent cannot take.
"""

from __future__ import annotations

from typing import Any

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.kinds import TrainerEdge
from trainguard.protocol import Heartbeat, HeartbeatPhase
from trainguard.trainer.channel import AgentChannel
from trainguard.trainer.checkpoint import SaveResult

__all__ = ["Telemetry"]


class Telemetry:
    """One rank's heartbeats. Construct it with the rank's channel; call `event()` whenever
    something happens and `send()` once per step."""

    def __init__(
        self,
        *,
        channel: AgentChannel,
        job: str,
        rank: int,
        local_rank: int,
        world_size: int,
        pid: int,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.channel = channel
        self.job = job
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.pid = pid
        self.clock = clock
        self.ckpt_step: int | None = None
        self.ckpt_request_id: str | None = None
        self._events: list[tuple[str, dict[str, Any]]] = []

    def event(self, name: str, data: dict[str, Any]) -> None:
        """Queue an edge event for the next heartbeat."""
        self._events.append((name, data))

    def checkpoint_loaded(self, *, step: int, request_id: str | None) -> None:
        """The run continues from the checkpoint of `step` (resume): it is the newest one."""
        self.ckpt_step = step
        if request_id:
            self.ckpt_request_id = request_id

    def report(self, result: SaveResult) -> None:
        """A save's outcome: `checkpoint_committed` (and the newest step) or `checkpoint_failed`."""
        if result.ok:
            self.ckpt_step = result.step
            if result.request_id:
                self.ckpt_request_id = result.request_id
            self.event(
                TrainerEdge.CHECKPOINT_COMMITTED,
                {
                    "step": result.step,
                    "request_id": result.request_id,
                    "duration_s": result.duration_s,
                    "path": result.path,
                },
            )
        else:
            self.event(
                TrainerEdge.CHECKPOINT_FAILED,
                {"step": result.step, "request_id": result.request_id, "reason": result.reason},
            )

    def send(
        self,
        *,
        step: int,
        phase: HeartbeatPhase,
        loss: float | None = None,
        grad_norm: float | None = None,
        step_time_s: float | None = None,
        compute_time_s: float | None = None,
        samples: int | None = None,
        tokens: int | None = None,
    ) -> None:
        """Send this step's heartbeat, one datagram per queued event (or one without)."""
        rate_ok = step_time_s is not None and step_time_s > 0
        base: dict[str, Any] = {
            "job": self.job,
            "rank": self.rank,
            "step": step,
            "t": self.clock.now(),
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "pid": self.pid,
            "loss": loss,
            "grad_norm": grad_norm,
            "samples_per_s": samples / step_time_s if rate_ok and samples else None,  # type: ignore[operator]
            "tokens_per_s": tokens / step_time_s if rate_ok and tokens else None,  # type: ignore[operator]
            "step_time_s": step_time_s,
            "compute_time_s": compute_time_s,
            "phase": phase,
            "ckpt_step": self.ckpt_step,
            "ckpt_request_id": self.ckpt_request_id,
            "control_socket": self.channel.control_socket,
        }
        events, self._events = self._events, []
        if not events:
            self.channel.send_plain(base)
            return
        # One edge event per datagram; the level fields repeat in each.
        for name, data in events:
            self.channel.send(Heartbeat(**base, event=name, event_data=data))
