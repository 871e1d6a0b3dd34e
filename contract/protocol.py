"""The wire: what travels between trainer ranks, the agent and the controller.

trainer rank --(unix datagram, JSON Heartbeat)--> agent --(POST /v1/reports, JSON Report)-->
controller; the controller answers with a ReportResponse carrying Commands for the node, and
the agent relays checkpoint/stop requests to ranks as JSON Control datagrams.

Every message is a frozen dataclass with `to_wire()` (plain JSON-ready dict) and a strict
`from_wire()` / `decode_json()` (the one decoder, `trainguard.decode`, compiled per class)
that raise ProtocolError naming the field. JSON has no NaN: non-finite floats travel as the
strings "NaN", "Infinity", "-Infinity" (a NaN loss is data we must not lose). Fields are
held to the bounds of `trainguard.bounds` (names, times, counts, entries per message) by the
decoder; every integer fits int64.
The controller imports this module; the agent never imports the controller.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, Any, Literal, TypeVar

from trainguard.bounds import (
    MAX_EVENTS_PER_REPORT,
    MAX_GPUS_PER_REPORT,
    MAX_IB_PORTS_PER_REPORT,
    MAX_JOBS_PER_REPORT,
    MAX_MAP_ENTRIES,
    MAX_RANKS_PER_REPORT,
    Count,
    Duration,
    FiniteFloat,
    Ident,
    LabelValue,
    Name,
    NameOrEmpty,
    Text,
    UnixTime,
)
from trainguard.decode import Bound, Decoder, Invalid, type_name
from trainguard.kinds import CommandKind, EventKind, TrainerEdge, WireEnum
from trainguard.membership import MEMBERSHIP_MAX_CHARS, Membership
from trainguard.model import GpuSample, HardwareEvent, IbPortSample, NvLinkSample

__all__ = [
    "CONTROL_MAX_BYTES",
    "HEARTBEAT_MAX_BYTES",
    "PROTOCOL_VERSION",
    "REPORT_MAX_BYTES",
    "Command",
    "CommandKind",
    "Control",
    "ControlAction",
    "EVENT_PAYLOADS",
    "Event",
    "EventKind",
    "FaultSpec",
    "GpuSample",
    "HardwareEvent",
    "Heartbeat",
    "IbPortSample",
    "JobProcess",
    "NvLinkSample",
    "Payload",
    "ProtocolError",
    "RankState",
    "Report",
    "ReportResponse",
    "StandbyState",
    "TrainerEdge",
    "WireEnum",
    "WireDecoder",
    "decode_json",
    "decoder",
    "encode_json",
    "from_wire",
    "to_wire",
    "wire_float",
]

PROTOCOL_VERSION = 1
HEARTBEAT_MAX_BYTES = 4096  # one datagram; larger ones are counted and dropped
CONTROL_MAX_BYTES = 4096
REPORT_MAX_BYTES = 4 * 1024 * 1024  # the controller rejects larger report bodies with 413

T = TypeVar("T")

_Data = Annotated[dict[str, Any], Bound(max_items=MAX_MAP_ENTRIES)]
_Path = Annotated[str, Bound(max_length=1024)]


class ProtocolError(ValueError):
    """A message that does not match the wire schema; `field` is the dotted path;
    `out_of_bounds`: the value had the right type but lay outside a bound."""

    out_of_bounds = False

    def __init__(self, field_path: str, reason: str) -> None:
        self.field = field_path
        self.reason = reason
        super().__init__(f"{field_path}: {reason}" if field_path else reason)


# --- trainer <-> agent ---------------------------------------------------------------------


HeartbeatPhase = Literal["init", "train", "checkpoint", "eval", "stopping", "exit"]


@dataclass(frozen=True)
class Heartbeat:
    """One datagram per training step from each rank (level state + an optional edge event).

    Level fields (`ckpt_step`, `ckpt_request_id`) repeat in every heartbeat so a lost datagram
    never loses the fact that a checkpoint committed.
    """

    job: Name
    rank: Count
    step: int
    t: UnixTime  # sender's unix time
    local_rank: Count = 0
    world_size: Count = 1
    pid: Count = 0
    loss: float | None = None
    grad_norm: float | None = None
    samples_per_s: FiniteFloat | None = None
    tokens_per_s: FiniteFloat | None = None
    step_time_s: Duration | None = None
    # this rank's own work in the step (forward/backward; not waits in collectives), seconds
    compute_time_s: Duration | None = None
    phase: HeartbeatPhase = "train"
    ckpt_step: int | None = None  # newest committed checkpoint step
    ckpt_request_id: Ident | None = None  # newest proactive request that committed
    # Checkpoint health: saves failed in a row since the newest commit; seconds since the
    # newest commit (while none committed in this run, since its first step: after a start or
    # a resume); the
    # periodic interval in seconds (checkpoint_every x the mean step time; None without
    # periodic checkpoints or before a step was timed).
    ckpt_failures: Count = 0
    ckpt_age_s: Duration | None = None
    ckpt_interval_s: Duration | None = None
    # The second-region copy (rank 0, with a replica configured): the newest replicated and
    # verified step, and seconds since the oldest commit not yet replicated (0: caught up).
    ckpt_replica_step: Count | None = None
    ckpt_replica_lag_s: Duration | None = None
    control_socket: _Path | None = None  # where this rank listens for Control datagrams
    # The attempt epoch this rank trains in (None: unfenced). It changes in the process when
    # a healthy rank rejoins a re-formed world: the first heartbeat naming the new epoch at a
    # train step is the first step of the healed job.
    epoch: Count | None = None
    # edge event: a TrainerEdge, or a name of the trainer's own
    event: Ident | None = None
    event_data: _Data = field(default_factory=dict)
    v: int = PROTOCOL_VERSION


ControlAction = Literal["checkpoint", "stop", "checkpoint_stop", "set_interval", "rejoin"]
# The longest periodic checkpoint interval a `set_interval` may ask for, in steps.
MAX_CHECKPOINT_EVERY_STEPS = 10_000_000


@dataclass(frozen=True)
class Control:
    """Agent -> rank request. All ranks act at the same step (the trainer library agrees).
    `set_interval` carries the new periodic checkpoint interval in `every_steps`; `rejoin` the
    rank's place in the re-formed world in `membership` (a `trainguard.membership.Membership`
    as JSON), which that rank acts on alone, not at an agreed step."""

    action: ControlAction
    request_id: Ident
    job: NameOrEmpty = ""
    every_steps: Annotated[int, Bound(ge=1, le=MAX_CHECKPOINT_EVERY_STEPS)] | None = None
    membership: Annotated[str, Bound(max_length=MEMBERSHIP_MAX_CHARS)] | None = None
    v: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        if (self.action == "set_interval") != (self.every_steps is not None):
            raise Invalid("every_steps", "set with action set_interval, and only with it")
        if (self.action == "rejoin") != (self.membership is not None):
            raise Invalid("membership", "set with action rejoin, and only with it")
        if self.membership is not None:
            try:
                Membership.from_json(self.membership)
            except ValueError as e:
                raise Invalid("membership", str(e)) from None


# --- agent -> controller -------------------------------------------------------------------


@dataclass(frozen=True)
class RankState:
    """The agent's view of one local rank, from its latest heartbeat."""

    job: Name
    rank: Count
    step: int
    local_rank: Count = 0
    world_size: Count = 1
    pid: Count = 0
    loss: float | None = None
    grad_norm: float | None = None
    samples_per_s: FiniteFloat | None = None
    tokens_per_s: FiniteFloat | None = None
    step_time_s: Duration | None = None
    compute_time_s: Duration | None = None
    phase: Ident = "train"
    heartbeat_age_s: Duration = 0.0  # agent clock: now - last heartbeat received
    step_age_s: Duration = 0.0  # agent clock: now - when `step` last changed
    ckpt_step: int | None = None
    ckpt_request_id: Ident | None = None
    ckpt_failures: Count = 0
    ckpt_age_s: Duration | None = None  # as of the rank's latest heartbeat
    ckpt_interval_s: Duration | None = None
    ckpt_replica_step: Count | None = None
    ckpt_replica_lag_s: Duration | None = None  # as of the rank's latest heartbeat
    epoch: Count | None = None  # the attempt epoch the rank trains in (changes on a rejoin)


@dataclass(frozen=True)
class StandbyState:
    """The warm standby of a spare node (agent.standby): the entry module it has imported and
    whether it is ready to become a rank now (an `assign_standby` needs it ready)."""

    module: LabelValue
    ready: bool = False


@dataclass(frozen=True)
class JobProcess:
    """A job's processes (torchrun) launched by this agent."""

    job: Name
    attempt: Count
    state: Literal["starting", "running", "stopping", "exited"]
    pid: Count | None = None
    exit_code: int | None = None
    output_tail: Text = ""  # last lines of output, bounded


_STR: tuple[type, ...] = (str,)
_INT: tuple[type, ...] = (int,)
_BOOL: tuple[type, ...] = (bool,)
_NUMBER: tuple[type, ...] = (int, float)
_LIST: tuple[type, ...] = (list, tuple)


@dataclass(frozen=True)
class Payload:
    """What an event kind's `data` holds: `required` and `optional` keys with their JSON types.
    Other keys pass, as they always have (a newer agent may add one)."""

    required: Mapping[str, tuple[type, ...]] = field(default_factory=dict)
    optional: Mapping[str, tuple[type, ...]] = field(default_factory=dict)

    def problem(self, data: Mapping[str, Any]) -> tuple[str, str] | None:
        """(key, reason) of the first key that breaks the schema, or None."""
        for key, types in self.required.items():
            if key not in data:
                return key, "required key is missing"
            if not _is(data[key], types):
                return key, f"expected {_words(types)}, got {type_name(data[key])}"
        for key, types in self.optional.items():
            if key in data and data[key] is not None and not _is(data[key], types):
                return key, f"expected {_words(types)}, got {type_name(data[key])}"
        return None


def _is(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _words(types: tuple[type, ...]) -> str:
    return {
        _STR: "a string",
        _INT: "an integer",
        _BOOL: "true or false",
        _NUMBER: "a number",
        _LIST: "a list",
    }.get(types, " or ".join(t.__name__ for t in types))


_HARDWARE = Payload(optional={"pci_bus_id": _STR})
_FREE = Payload()  # the trainer's own scalar entries (the agent bounds them)

# Every kind's payload: the keys the controller acts on are required where every producer has
# always written them, the others typed where present. Constructing an Event checks it too, so
# an agent cannot spool what a controller would refuse.
EVENT_PAYLOADS: Mapping[EventKind, Payload] = {
    EventKind.XID: _HARDWARE,
    EventKind.GPU_LOST: _HARDWARE,
    EventKind.FALLEN_OFF_BUS: _HARDWARE,
    EventKind.NVML_ERROR: _HARDWARE,
    EventKind.NAN_LOSS: _FREE,
    EventKind.CHECKPOINT_COMMITTED: _FREE,
    EventKind.CHECKPOINT_FAILED: _FREE,
    EventKind.TRAINER_EXIT: _FREE,
    EventKind.TRAINER_STOP: _FREE,
    EventKind.TRAINER_EVENT: _FREE,
    EventKind.GRAD_NORM_SPIKE: _FREE,
    EventKind.NAN_ROLLBACK: _FREE,
    EventKind.JOB_EXIT: Payload(
        required={"attempt": _INT}, optional={"stopped": _BOOL, "output_tail": _STR}
    ),
    EventKind.COMMAND_RESULT: Payload(
        required={"command_id": _STR}, optional={"kind": _STR, "ok": _BOOL, "message": _STR}
    ),
    EventKind.FAULT_INJECTED: Payload(required={"fault": _STR}),
    EventKind.PREEMPTION_NOTICE: Payload(
        optional={
            "provider": _STR,
            "action": _STR,
            "time": _STR,
            "jobs": _LIST,
            "ranks_sent": _INT,
            "ranks_failed": _INT,
            "request_id": _STR,
        },
    ),
    EventKind.SOURCE_STALE: Payload(
        required={"source": _STR, "deadline_s": _NUMBER, "running_s": _NUMBER}
    ),
    EventKind.SOURCE_RECOVERED: Payload(required={"source": _STR, "stale_for_s": _NUMBER}),
    # checks: one {"name", "passed", "detail", optional "value" and "reference"} per check
    EventKind.PREFLIGHT_RESULT: Payload(
        required={"command_id": _STR, "passed": _BOOL, "checks": _LIST},
        optional={"duration_s": _NUMBER},
    ),
}


@dataclass(frozen=True)
class Event:
    """An edge event, spooled by the agent until the controller acknowledges its id.

    `id` increases strictly within one agent `instance`; (node, instance, id) is unique.
    `data` holds what `EVENT_PAYLOADS[kind]` says.
    """

    id: Count
    kind: EventKind
    ts: UnixTime
    gpu: Count | None = None
    job: Name | None = None
    rank: Count | None = None
    code: int | None = None
    message: Text = ""
    data: _Data = field(default_factory=dict)

    def __post_init__(self) -> None:
        payload = EVENT_PAYLOADS.get(self.kind)
        problem = None if payload is None else payload.problem(self.data)
        if problem is not None:
            raise Invalid(f"data.{problem[0]}", problem[1])


@dataclass(frozen=True)
class Report:
    node: Name
    instance: Ident  # random id chosen at agent start
    seq: Count  # report sequence within the instance
    sent_at: UnixTime
    agent_version: LabelValue = ""
    role_hint: Literal["active", "spare"] | None = None
    labels: Annotated[dict[Ident, LabelValue], Bound(max_items=MAX_MAP_ENTRIES)] = field(
        default_factory=dict
    )
    gpus: Annotated[tuple[GpuSample, ...], Bound(max_items=MAX_GPUS_PER_REPORT)] = ()
    ib_ports: Annotated[tuple[IbPortSample, ...], Bound(max_items=MAX_IB_PORTS_PER_REPORT)] = ()
    ranks: Annotated[tuple[RankState, ...], Bound(max_items=MAX_RANKS_PER_REPORT)] = ()
    jobs: Annotated[tuple[JobProcess, ...], Bound(max_items=MAX_JOBS_PER_REPORT)] = ()
    events: Annotated[tuple[Event, ...], Bound(max_items=MAX_EVENTS_PER_REPORT)] = ()
    # the node's warm standby, where its agent keeps one (standby.enabled on a spare)
    standby: StandbyState | None = None
    # agent self-health figures
    health: Annotated[dict[Ident, FiniteFloat], Bound(max_items=MAX_MAP_ENTRIES)] = field(
        default_factory=dict
    )
    # Delta reports (optional; an agent that never sets `full` sends full reports only).
    # full=True: gpus/ib_ports are the whole hardware snapshot. full=False: a delta against
    # the report `base_seq` (same instance) that the controller acknowledged: only the GPUs,
    # NVLinks (within a listed GPU) and IB ports whose values changed are listed, each entry
    # whole; an absent entry means "unchanged", never "gone" (a removal forces a full report).
    # ranks, jobs, events, health and labels are always complete.
    full: bool | None = None
    base_seq: Count | None = None
    v: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class Command:
    """Controller -> agent, riding on the report response. Results come back as
    `command_result` events with data {"command_id", "kind", "ok", "message", ...}. `args`
    holds what `trainguard.command_args.COMMAND_ARGS[kind]` says; it stays a mapping here and
    each handler decodes it (a bad one fails that command, not the whole response)."""

    id: Ident
    kind: CommandKind
    args: _Data = field(default_factory=dict)


@dataclass(frozen=True)
class ReportResponse:
    ack_event_id: int  # every event with id <= this (for the report's instance) is stored
    commands: tuple[Command, ...] = ()
    server_time: FiniteFloat = 0.0
    # True: the controller cannot apply deltas for this agent (a new controller process, an
    # unknown instance, a base_seq that is not the last report it applied): send a full
    # report next. Only sent (when true) to agents that send `full`.
    want_full: bool | None = None
    # Fencing: job -> the job's current attempt (epoch), sent for each job of which the node
    # reports an older attempt. The agent stops every local process of an older attempt of
    # that job as soon as it reads this (issue of a crash: a node that missed its stop).
    job_attempts: dict[str, int] | None = None
    # The node's role as the controller holds it (True: a spare). An agent keeps its warm
    # standby while its node is a spare (agent.standby); None (an older controller): the
    # agent's own node.role_hint decides.
    spare: bool | None = None
    # Send the next report within this many seconds, not at the agent's own interval: the
    # controller is acting on this node (a remediation's commands and results), so each
    # round trip costs this instead of a report interval. Bounded by the agent (never
    # below 0.05 s, never later than its own interval); None: the agent's interval.
    report_in_s: FiniteFloat | None = None
    v: int = PROTOCOL_VERSION


FaultKind = Literal[
    "ecc_storm",  # correctable ECC errors at `rate_per_s`
    "dbe",  # uncorrectable (double-bit) ECC error, + XID 48
    "remap_pending",  # row remapping pending
    "remap_failure",
    "xid",  # any XID `code`
    "gpu_lost",  # NVML GpuIsLost + XID 79 "fallen off the bus"
    "nvlink_down",  # `link` of `gpu` goes down (+ error counters climb)
    "ib_flap",  # `device`/`port` bounces DOWN/ACTIVE
    "ib_down",
    "thermal",  # HW thermal slowdown, hot
    "slowdown",  # HW slowdown clocks
    "nvml_hang",  # every NVML call blocks (a GPU off the bus) until cleared or `duration_s`
    "sdc",  # silent data corruption: `gpu`'s compute products come out wrong (a burn catches it)
    "reset_fail",  # resetting `gpu` fails (nvidia-smi --gpu-reset exits non-zero)
    "clear",  # remove every injected fault (counters keep their values)
]


@dataclass(frozen=True)
class FaultSpec:
    """A fault to inject into the simulated hardware (sim backend only)."""

    kind: FaultKind
    gpu: Count = 0
    link: Count = 0
    device: Name = "mlx5_0"
    port: Count = 1
    code: Count = 79
    rate_per_s: Annotated[float, Bound(ge=0.0, le=1e6, finite=True)] = 50.0
    duration_s: Duration | None = None  # None = until cleared


# --- encoding ------------------------------------------------------------------------------


def wire_float(value: float) -> float | str:
    """A float as the wire writes it: finite as it is, non-finite as "NaN", "Infinity" or
    "-Infinity" (JSON has no NaN; the one decoder reads these strings back)."""
    if math.isfinite(value):
        return value
    if math.isnan(value):
        return "NaN"
    return "Infinity" if value > 0 else "-Infinity"


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _encode(value: Any) -> Any:
    # field names cached per class: a report is encoded every second, forever
    t = type(value)
    if t is float:
        return wire_float(value)
    if t is int or t is str or t is bool or value is None:
        return value
    names = _FIELD_NAMES.get(t)
    if names is None and dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _FIELD_NAMES[t] = tuple(f.name for f in dataclasses.fields(value))
    if names is not None:
        out = {}
        for name in names:
            v = getattr(value, name)
            if v is not None:  # absent, not zero
                out[name] = _encode(v)
        return out
    if isinstance(value, float):
        return wire_float(float(value))
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    return value


def to_wire(msg: Any) -> dict[str, Any]:
    """A dataclass message as a JSON-ready dict (None fields dropped, non-finite as strings)."""
    out = _encode(msg)
    if not isinstance(out, dict):
        raise TypeError(f"not a message: {type(msg).__name__}")
    return out


class WireDecoder(Decoder[T]):
    """The one decoder for message class `cls`: a `v` other than PROTOCOL_VERSION is refused
    before anything else, and failures raise ProtocolError naming the field."""

    def __init__(self, cls: type[T]) -> None:
        super().__init__(cls, version=PROTOCOL_VERSION)

    def error(self, path: str, reason: str) -> Exception:
        return ProtocolError(path, reason)


_DECODERS: dict[type, WireDecoder[Any]] = {}


def decoder(cls: type[T]) -> WireDecoder[T]:
    """The (cached) wire decoder for message class `cls`."""
    found = _DECODERS.get(cls)
    if found is None:
        found = _DECODERS[cls] = WireDecoder(cls)
    return typing.cast("WireDecoder[T]", found)  # a string: no generic alias built per call


def from_wire(cls: type[T], data: Any) -> T:
    """Strictly decode already-parsed JSON `data` into message class `cls`; raises
    ProtocolError."""
    return decoder(cls).decode(data)


def encode_json(msg: Any) -> bytes:
    """The one JSON wire encoder: `to_wire(msg)` as compact JSON bytes."""
    return json.dumps(to_wire(msg), separators=(",", ":"), allow_nan=False).encode()


def decode_json(cls: type[T], raw: bytes | str) -> T:
    """Strictly decode JSON `raw` into message class `cls`; raises ProtocolError."""
    return decoder(cls).decode_json(raw)
