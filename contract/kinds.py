"""The kinds on the wire, one enum each: what an Event reports (`EventKind`), what a Command
asks (`CommandKind`) and the trainer's edge events (`TrainerEdge`). Members are the wire
strings themselves, so a kind compares, prints and encodes as the plain string did.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["CommandKind", "EventKind", "TrainerEdge", "WireEnum"]


class WireEnum(str, Enum):
    """A kind on the wire: each member is its string (`EventKind.NAN_LOSS == "nan_loss"`),
    and prints as it, so logs, labels and JSON read the same as the plain strings did."""

    def __str__(self) -> str:
        return str(self.value)


class TrainerEdge(WireEnum):
    """The edge events the trainer library puts in `Heartbeat.event`. Another trainer may send
    its own names: the agent spools those as `EventKind.TRAINER_EVENT`, the name in `message`
    (which is why `Heartbeat.event` stays a free name)."""

    NAN_LOSS = "nan_loss"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    EXIT = "exit"
    STOP = "stop"
    NAN_ROLLBACK = "nan_rollback"
    GRAD_NORM_SPIKE = "grad_norm_spike"
    # the second-region copy (trainer/replica.py) and where a resume found its checkpoint;
    # relayed as `trainer_event` with the name in the message
    CHECKPOINT_REPLICATED = "checkpoint_replicated"
    CHECKPOINT_REPLICATION_FAILED = "checkpoint_replication_failed"
    CHECKPOINT_RESTORED = "checkpoint_restored"
    # resume/rollback passed over newer checkpoints that did not verify (a delta with a
    # corrupt or missing base among them) and loaded an older one, or none
    CHECKPOINT_FALLBACK = "checkpoint_fallback"


class EventKind(WireEnum):
    """What an Event reports; the decoder refuses any other kind."""

    # hardware (agent collectors)
    XID = "xid"
    GPU_LOST = "gpu_lost"
    FALLEN_OFF_BUS = "fallen_off_bus"
    NVML_ERROR = "nvml_error"
    # trainer edge events (Heartbeat.event), relayed by the agent
    NAN_LOSS = "nan_loss"
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    CHECKPOINT_FAILED = "checkpoint_failed"
    TRAINER_EXIT = "trainer_exit"
    TRAINER_STOP = "trainer_stop"
    TRAINER_EVENT = "trainer_event"  # any other trainer event; its name is the message
    # spike and rollback arrive as trainer_event today; the controller takes either form
    GRAD_NORM_SPIKE = "grad_norm_spike"
    NAN_ROLLBACK = "nan_rollback"
    # the agent itself
    JOB_EXIT = "job_exit"
    COMMAND_RESULT = "command_result"
    FAULT_INJECTED = "fault_injected"
    PREEMPTION_NOTICE = "preemption_notice"
    SOURCE_STALE = "source_stale"
    SOURCE_RECOVERED = "source_recovered"
    PREFLIGHT_RESULT = "preflight_result"  # the checks a `preflight` command ran


class CommandKind(WireEnum):
    """What a Command asks of the agent; its `args` class per kind is
    `trainguard.command_args.COMMAND_ARGS`."""

    CHECKPOINT = "checkpoint"  # -> Control(checkpoint) to the job's ranks
    STOP_RANKS = "stop_ranks"  # -> Control(stop|checkpoint_stop) to the job's ranks
    START_JOB = "start_job"  # -> torchrun for this node's share of the job
    STOP_JOB = "stop_job"  # -> SIGTERM the job's launch, grace, SIGKILL
    INJECT_FAULT = "inject_fault"  # -> the sim backend's hardware (sim backend only)
    COLLECT_STACKS = "collect_stacks"  # -> SIGUSR1 to the job's local ranks, stacks back
    PREFLIGHT = "preflight"  # -> the node's health checks; a preflight_result event back
    REPAIR = "repair"  # -> reset the node's GPUs or reboot it; a command_result back
    # -> Control(set_interval) to the job's ranks: their periodic checkpoint interval
    SET_CHECKPOINT_INTERVAL = "set_checkpoint_interval"
    # -> Control(rejoin) to each named local rank: its place in the job's re-formed world
    REJOIN = "rejoin"
    # -> the warm standby becomes a rank of the job (its membership on stdin); tracked as the
    # job's process on this node from then on
    ASSIGN_STANDBY = "assign_standby"
