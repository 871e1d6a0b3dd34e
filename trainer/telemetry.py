"""`Telemetry`: the heartbeat a rank sends to its node's agent once per step, with the edge
events that ride on it.

It owns the queue of events (each part hands its events to `event()`; the next `send()` puts
each in a datagram of its own, the level fields repeated) and the newest committed checkpoint
it reports (`ckpt_step`, `ckpt_request_id`, updated by `report()` from the writer's results),
with its health (`CheckpointHealth`: saves failed in a row, the age of the newest commit, the
periodic interval in seconds; with a replica, the newest replicated step and the lag) so the
agent and the controller see a job that trains on without a checkpoint. Sending never blocks:
the channel drops a datagram the agent cannot take.
"""

from __future__ import annotations

import logging
from typing import Any

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.kinds import TrainerEdge
from trainguard.protocol import Heartbeat, HeartbeatPhase
from trainguard.trainer.channel import AgentChannel
from trainguard.trainer.checkpoint import SaveResult
from trainguard.trainer.replica import Replicator

__all__ = ["CheckpointHealth", "Telemetry"]

log = logging.getLogger("trainguard.trainer")

# Weight of the newest step in the mean step time that sizes the checkpoint interval
_STEP_TIME_WEIGHT = 0.1


class CheckpointHealth:
    """Whether this rank's checkpoints keep committing: saves failed in a row since the newest
    commit, when that commit was (monotonic; while none committed in this run, the end of its
    first step, so a slow first step (compilation, a resume's load) does not count as time
    without a checkpoint), and the periodic interval in seconds (`checkpoint_every` x the mean
    step time). Logs a WARNING at the first failure of a run of failures and an INFO when a
    commit ends it."""

    def __init__(self, *, job: str, rank: int, checkpoint_every: int, clock: Clock) -> None:
        self.job = job
        self.rank = rank
        self.checkpoint_every = checkpoint_every
        self.clock = clock
        self.failures = 0
        self.committed_mono = clock.monotonic()
        self.committed_in_run = False
        self.mean_step_time_s: float | None = None

    def committed(self, result: SaveResult) -> None:
        if self.failures:
            log.info(
                "event=checkpoint_recovered job=%s rank=%d step=%d failures=%d",
                self.job,
                self.rank,
                result.step,
                self.failures,
            )
        self.failures = 0
        self.committed_mono = self.clock.monotonic()
        self.committed_in_run = True

    def failed(self, result: SaveResult) -> None:
        self.failures += 1
        if self.failures == 1:
            log.warning(
                "event=checkpoint_failing job=%s rank=%d step=%d reason=%s: the run trains on "
                "without a new checkpoint until a save commits",
                self.job,
                self.rank,
                result.step,
                (result.reason or "-").replace(" ", "_"),
            )

    def loaded(self) -> None:
        """The run resumed from a checkpoint: its age counts from now."""
        self.committed_mono = self.clock.monotonic()

    def step_timed(self, step_time_s: float | None) -> None:
        if step_time_s is None or step_time_s <= 0:
            return
        mean = self.mean_step_time_s
        if mean is None and not self.committed_in_run:
            self.committed_mono = self.clock.monotonic()  # the run's first step ended
        self.mean_step_time_s = (
            step_time_s if mean is None else mean + _STEP_TIME_WEIGHT * (step_time_s - mean)
        )

    def age_s(self) -> float:
        return max(0.0, self.clock.monotonic() - self.committed_mono)

    def interval_s(self) -> float | None:
        if self.checkpoint_every <= 0 or self.mean_step_time_s is None:
            return None
        return self.checkpoint_every * self.mean_step_time_s


_EXIT_WAIT_S = 1.0  # at most this long, once per rank, at close


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
        checkpoint_every: int = 0,
        replicator: Replicator | None = None,
        epoch: int | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.channel = channel
        self.replicator = replicator
        self.epoch = epoch  # the attempt epoch of this rank's world (a rejoin raises it)
        self.job = job
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.pid = pid
        self.clock = clock
        self.ckpt_step: int | None = None
        self.ckpt_request_id: str | None = None
        self._events: list[tuple[str, dict[str, Any]]] = []
        self.ckpt_health = CheckpointHealth(
            job=job, rank=rank, checkpoint_every=checkpoint_every, clock=clock
        )

    def event(self, name: str, data: dict[str, Any]) -> None:
        """Queue an edge event for the next heartbeat."""
        self._events.append((name, data))

    def stopping(self, *, step: int, reason: str, request_id: str | None) -> None:
        """The run stops at `step` (a stop request, a checkpoint-and-stop, SIGTERM): the
        `stop` edge for the next heartbeat, and its log line."""
        self.event(TrainerEdge.STOP, {"step": step, "reason": reason, "request_id": request_id})
        log.info(
            "event=stop job=%s rank=%d step=%d reason=%s request_id=%s",
            self.job,
            self.rank,
            step,
            reason,
            request_id or "-",
        )

    def checkpoint_skipped(self, *, step: int, request_id: str | None) -> None:
        """A checkpoint asked for at `step` is not written: the state is not finite."""
        self.event(
            TrainerEdge.CHECKPOINT_FAILED,
            {"step": step, "reason": "nonfinite_state", "request_id": request_id},
        )

    def checkpoint_loaded(self, *, step: int, request_id: str | None) -> None:
        """The run continues from the checkpoint of `step` (resume): it is the newest one."""
        self.ckpt_step = step
        if request_id:
            self.ckpt_request_id = request_id
        self.ckpt_health.loaded()

    def checkpoint_restored(self, *, step: int, source: str) -> None:
        """The resume loaded checkpoint `step` from `source` ("s3" or "replica"): an edge event
        naming where it came from (a local checkpoint needs none)."""
        self.event(TrainerEdge.CHECKPOINT_RESTORED, {"step": step, "source": source})

    def _replica_events(self) -> None:
        """The replica's outcomes since the last heartbeat, as edge events."""
        if self.replicator is None:
            return
        for e in self.replicator.take_events():
            if e.kind == TrainerEdge.CHECKPOINT_REPLICATED:
                self.event(
                    TrainerEdge.CHECKPOINT_REPLICATED,
                    {"step": e.step, "lag_s": e.lag_s, "replica": self.replicator.where},
                )
            else:
                self.event(
                    TrainerEdge.CHECKPOINT_REPLICATION_FAILED,
                    {
                        "step": e.step,
                        "attempt": e.attempt,
                        "reason": e.reason,
                        "retry_in_s": e.retry_in_s,
                        "replica": self.replicator.where,
                    },
                )

    def report(self, result: SaveResult) -> None:
        """A save's outcome: `checkpoint_committed` (and the newest step) or `checkpoint_failed`."""
        if result.ok:
            self.ckpt_health.committed(result)
            self.ckpt_step = result.step
            if result.request_id:
                self.ckpt_request_id = result.request_id
            self.event(
                TrainerEdge.CHECKPOINT_COMMITTED,
                {
                    "step": result.step,
                    "request_id": result.request_id,
                    "duration_s": result.duration_s,
                    "block_s": result.block_s,
                    "path": result.path,
                },
            )
        else:
            self.ckpt_health.failed(result)
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
        health = self.ckpt_health
        health.step_timed(step_time_s)
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
            "ckpt_failures": health.failures,
            "ckpt_age_s": health.age_s(),
            "ckpt_interval_s": health.interval_s(),
            "control_socket": self.channel.control_socket,
            "epoch": self.epoch,
        }
        if self.replicator is not None:
            replica = self.replicator.status()
            base["ckpt_replica_step"] = replica.step
            base["ckpt_replica_lag_s"] = replica.lag_s
            self._replica_events()
        events, self._events = self._events, []
        if not events:
            self.channel.send_plain(base)
            return
        # One edge event per datagram; the level fields repeat in each. A rank's last words
        # (`exit`) wait a moment for a busy agent's full queue rather than being dropped.
        wait_s = _EXIT_WAIT_S if phase == "exit" else 0.0
        for name, data in events:
            self.channel.send(Heartbeat(**base, event=name, event_data=data), wait_s=wait_s)
