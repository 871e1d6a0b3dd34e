"""What each command kind's `args` hold: one frozen dataclass per `CommandKind`, in one table.

The controller builds a command from its args class (`queue_command(node, StopJobArgs(...))`,
the kind read from the table) and the agent decodes `Command.args` with the same class, by
the one decoder: a bad field fails that one command with `args.<field>: <reason>`, never the
report response that carried it (on the wire `Command.args` stays a plain mapping, and an
unknown kind stays a command the agent answers "unknown command kind").
"""

from __future__ import annotations

import ipaddress
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, Union

from trainguard.bounds import bad_name_reason
from trainguard.decode import Decoder, Invalid
from trainguard.kinds import CommandKind
from trainguard.membership import MAX_EPOCH, Membership
from trainguard.protocol import (
    MAX_CHECKPOINT_EVERY_STEPS,
    Command,
    FaultSpec,
    ProtocolError,
    to_wire,
)

__all__ = [
    "COMMAND_ARGS",
    "LAUNCH_ID_ENV",
    "RESERVED_ENV",
    "AssignStandbyArgs",
    "CheckpointArgs",
    "CollectStacksArgs",
    "CommandArgs",
    "PREFLIGHT_CHECKS",
    "PreflightArgs",
    "REPAIR_METHODS",
    "RejoinArgs",
    "RejoinRank",
    "RepairArgs",
    "SetCheckpointIntervalArgs",
    "StartJobArgs",
    "StopJobArgs",
    "StopRanksArgs",
    "check_job_command",
    "command",
    "command_kind",
    "decode_args",
]

A = TypeVar("A")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RDZV_CONF_KEY = re.compile(r"[a-z][a-z0-9_]*")
LAUNCH_ID_ENV = "TRAINGUARD_LAUNCH_ID"
# The agent sets these; a job must not point its ranks at another agent or job name.
# (Other TRAINGUARD_* variables, such as TRAINGUARD_CHAOS, pass through from `env`.)
RESERVED_ENV = frozenset(
    {
        "TRAINGUARD_JOB",
        "TRAINGUARD_ATTEMPT",
        "TRAINGUARD_NODE",
        "TRAINGUARD_AGENT_SOCKET",
        "TRAINGUARD_CONTROL_DIR",
        "TRAINGUARD_CKPT_DIR",
        LAUNCH_ID_ENV,
    }
)


def check_job_command(command: list[str]) -> None:
    """A job's `command` (the controller's job spec and `start_job` alike): the training
    program's path and its arguments, or `-m` and a dotted module name (torchrun's
    `--module`, as `python -m`) and its arguments. Raises Invalid naming the item."""
    if not command:
        raise Invalid("command", "must be a non-empty list of strings (the training program)")
    for i, arg in enumerate(command):
        if "\0" in arg:
            raise Invalid(f"command[{i}]", "contains a NUL byte")
    if command[0] == "-m":
        if len(command) < 2:
            raise Invalid("command[1]", "missing: '-m' must be followed by a module name")
        module = command[1]
        if not all(part.isidentifier() for part in module.split(".")):
            raise Invalid(
                "command[1]",
                f"must be a dotted Python module name after '-m' (e.g. pkg.train), got {module!r}",
            )
        return
    if not command[0] or command[0].startswith("-"):
        # torchrun would read a leading option as its own (e.g. "--standalone")
        raise Invalid(
            "command[0]",
            "must be the training program's path or '-m' and a module name, not an option: "
            f"{command[0]!r}",
        )


def _require_job(job: str) -> None:
    # `job` defaults to "" only so that a missing one and an empty one read the same
    if not job:
        raise Invalid("job", "required non-empty string")


@dataclass(frozen=True)
class CheckpointArgs:
    """`checkpoint`: a Control(checkpoint) to the job's local ranks; `request_id` defaults to
    the command id."""

    job: str = ""
    request_id: str | None = None

    def __post_init__(self) -> None:
        _require_job(self.job)


@dataclass(frozen=True)
class StopRanksArgs:
    """`stop_ranks`: a Control(stop), or Control(checkpoint_stop) with `checkpoint`, to the
    job's local ranks; `request_id` defaults to the command id."""

    job: str = ""
    request_id: str | None = None
    checkpoint: bool = False

    def __post_init__(self) -> None:
        _require_job(self.job)


@dataclass(frozen=True)
class SetCheckpointIntervalArgs:
    """`set_checkpoint_interval`: a Control(set_interval) to the job's local ranks, which
    agree on a step and checkpoint every `every_steps` from there; `request_id` (the same on
    every node for one decision, so a rank that hears it twice acts once) defaults to the
    command id."""

    job: str = ""
    every_steps: int = 0
    request_id: str | None = None

    def __post_init__(self) -> None:
        _require_job(self.job)
        if not 1 <= self.every_steps <= MAX_CHECKPOINT_EVERY_STEPS:
            raise Invalid(
                "every_steps",
                f"must be in [1, {MAX_CHECKPOINT_EVERY_STEPS}], got {self.every_steps}",
            )


@dataclass(frozen=True)
class StartJobArgs:
    """`start_job`: this node's share of a job, run by torchrun (c10d or static rendezvous).

    `command` is the training program and its arguments, run as
    `python -m torch.distributed.run <launcher options> *command`, or `["-m", "pkg.module",
    *args]`, run as `... <launcher options> --module pkg.module *args` (`check_job_command`).
    """

    job: str
    attempt: int
    command: list[str]
    nproc_per_node: int
    nnodes: int
    rdzv_endpoint: str  # "host:port" of the c10d store, e.g. "10.0.0.1:29500"
    rdzv_id: str
    env: dict[str, str] = field(default_factory=dict)
    ckpt_dir: str | None = None
    cwd: str | None = None
    max_restarts: int = 0
    python: str | None = None  # interpreter that runs torchrun; None = the agent's own
    node_rank: int | None = None  # this node's place in the job's node list (0 = first)
    # Whether this node's torchrun hosts the c10d store. None: the node with node_rank 0 hosts,
    # or the only node; otherwise torch guesses from the endpoint's address (see docs/jobs.md).
    rdzv_host: bool | None = None
    # Address the node advertises to the job (worker store, gloo). None: the endpoint's own
    # address when it is loopback (every node is on this host), else torch's default (FQDN).
    local_addr: str | None = None
    # Extra `--rdzv-conf` keys, e.g. {"join_timeout": "120"}; `is_host` is set by rdzv_host.
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    # torchrun's rendezvous: "c10d" (every torchrun keeps polling the store the first node's
    # torchrun serves, so losing that torchrun ends every node's ranks), or "static" (ranks
    # fixed by node_rank, which is required; a torchrun reads the store only at the start
    # and the end: the ranks of a job recovered in process outlive the first node's).
    rdzv_backend: str = "c10d"

    def __post_init__(self) -> None:
        if self.rdzv_backend not in ("c10d", "static"):
            raise Invalid("rdzv_backend", f"must be 'c10d' or 'static', got {self.rdzv_backend!r}")
        if self.rdzv_backend == "static" and self.node_rank is None:
            raise Invalid("node_rank", "is required with rdzv_backend 'static'")
        # names end up in file names (`<job>-<attempt>.log`) and metric labels: the one
        # name pattern of trainguard.bounds
        bad = bad_name_reason(self.job)
        if bad is not None:
            raise Invalid("job", bad)
        if self.attempt < 0:
            raise Invalid("attempt", f"must be >= 0, got {self.attempt}")
        check_job_command(self.command)
        if self.nproc_per_node < 1:
            raise Invalid("nproc_per_node", f"must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise Invalid("nnodes", f"must be >= 1, got {self.nnodes}")
        if self.max_restarts < 0:
            raise Invalid("max_restarts", f"must be >= 0, got {self.max_restarts}")
        _parse_endpoint(self.rdzv_endpoint)
        if not self.rdzv_id or any(c.isspace() for c in self.rdzv_id):
            raise Invalid("rdzv_id", f"must be a non-empty string without spaces: {self.rdzv_id!r}")
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise Invalid(
                "node_rank", f"must be in [0, nnodes={self.nnodes}), got {self.node_rank}"
            )
        for name, value in self.env.items():
            if not _ENV_NAME.fullmatch(name):
                raise Invalid(f"env.{name}", "not a valid environment variable name")
            if name in RESERVED_ENV:
                hint = " (use ckpt_dir)" if name == "TRAINGUARD_CKPT_DIR" else ""
                raise Invalid(f"env.{name}", f"is set by the agent{hint}")
            if "\0" in value:
                raise Invalid(f"env.{name}", "contains a NUL byte")
        for key, value in self.rdzv_conf.items():
            if key == "is_host":
                raise Invalid("rdzv_conf.is_host", "set rdzv_host instead")
            if not _RDZV_CONF_KEY.fullmatch(key):
                raise Invalid(f"rdzv_conf.{key}", f"must match {_RDZV_CONF_KEY.pattern}")
            if not value or any(c in value for c in ",= \0"):
                raise Invalid(f"rdzv_conf.{key}", "value must be non-empty, no ',', '=' or spaces")
        for name, optional in (
            ("ckpt_dir", self.ckpt_dir),
            ("cwd", self.cwd),
            ("python", self.python),
            ("local_addr", self.local_addr),
        ):
            if optional is not None and (not optional or "\0" in optional):
                raise Invalid(name, "must be a non-empty string without NUL bytes")

    def is_host(self) -> bool | None:
        """Whether this node hosts the c10d store (None: leave it to torch's guess)."""
        if self.rdzv_host is not None:
            return self.rdzv_host
        if self.node_rank is not None:
            return self.node_rank == 0
        if self.nnodes == 1:
            return True
        return None

    def advertised_addr(self) -> str | None:
        """The `--local-addr` to pass, if any."""
        if self.local_addr is not None:
            return self.local_addr
        host, _ = _parse_endpoint(self.rdzv_endpoint)
        return host if _is_loopback(host) else None


@dataclass(frozen=True)
class StopJobArgs:
    """`stop_job`: SIGTERM the job's launch, SIGKILL after `grace_s`."""

    job: str
    grace_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.job:
            raise Invalid("job", "must be a non-empty string")
        if not 0 <= self.grace_s <= 3600:
            raise Invalid("grace_s", f"must be in [0, 3600], got {self.grace_s}")


@dataclass(frozen=True)
class CollectStacksArgs:
    """`collect_stacks`: SIGUSR1 to the job's local ranks, their stacks in the result."""

    job: str = ""

    def __post_init__(self) -> None:
        _require_job(self.job)


# The checks a preflight can run, in the order it runs them (docs/hardware.md, "Preflight and
# repair", says what each measures and its pass mark).
PREFLIGHT_CHECKS = (
    "nvml_health",  # every GPU answers NVML, none lost or fallen off the bus
    "row_remaps",  # no pending or failed row remapping
    "ecc",  # no uncorrectable ECC errors since the last reset
    "compute_burn",  # a matmul burn per GPU within tolerance of the reference
    "collective_bandwidth",  # an all-reduce across the node's GPUs within tolerance
    "ckpt_storage",  # the checkpoint directory is writable (write, fsync, read back, remove)
)
REPAIR_METHODS = ("gpu_reset", "reboot")


@dataclass(frozen=True)
class PreflightArgs:
    """`preflight`: run `checks` (all by default) and answer with a `preflight_result` event.
    `reference` holds the expected figures (`compute_burn_tflops`, `collective_gbps`),
    `tolerance` the fraction below them that still passes."""

    checks: list[str] = field(default_factory=lambda: list(PREFLIGHT_CHECKS))
    ckpt_dir: str | None = None
    reference: dict[str, float] = field(default_factory=dict)
    tolerance: float = 0.1
    burn_s: float = 2.0

    def __post_init__(self) -> None:
        if not self.checks:
            raise Invalid("checks", "must name at least one check")
        for i, check in enumerate(self.checks):
            if check not in PREFLIGHT_CHECKS:
                raise Invalid(f"checks[{i}]", f"unknown check {check!r}; one of {PREFLIGHT_CHECKS}")
        if self.ckpt_dir is not None and (not self.ckpt_dir or "\0" in self.ckpt_dir):
            raise Invalid("ckpt_dir", "must be a non-empty path without NUL bytes")
        for name, value in self.reference.items():
            if not 0 < value < 1e9:
                raise Invalid(f"reference.{name}", f"must be in (0, 1e9), got {value}")
        if not 0 <= self.tolerance < 1:
            raise Invalid("tolerance", f"must be in [0, 1), got {self.tolerance}")
        if not 0 < self.burn_s <= 600:
            raise Invalid("burn_s", f"must be in (0, 600], got {self.burn_s}")


@dataclass(frozen=True)
class RepairArgs:
    """`repair`: `gpu_reset` resets `gpus` (all of the node's by default) once no job runs on
    them; `reboot` reboots the node. The result is a `command_result` (ok, message)."""

    method: str = "gpu_reset"
    gpus: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.method not in REPAIR_METHODS:
            raise Invalid("method", f"must be one of {REPAIR_METHODS}, got {self.method!r}")
        for i, gpu in enumerate(self.gpus):
            if not 0 <= gpu < 1024:
                raise Invalid(f"gpus[{i}]", f"must be in [0, 1024), got {gpu}")


# The most local ranks one `rejoin` names (one per GPU of a node, with room).
MAX_REJOIN_RANKS = 64


def _membership(path: str, raw: str, *, epoch: int) -> Membership:
    try:
        m = Membership.from_json(raw)
    except ValueError as e:
        raise Invalid(path, str(e)) from None
    if m.epoch != epoch:
        raise Invalid(path, f"epoch {m.epoch} is not the command's epoch {epoch}")
    return m


def _check_epoch(epoch: int) -> None:
    if not 0 <= epoch <= MAX_EPOCH:
        raise Invalid("epoch", f"must be in [0, {MAX_EPOCH}], got {epoch}")


@dataclass(frozen=True)
class RejoinRank:
    """One local rank of a `rejoin`: the rank it is now (as its heartbeats name it) and its
    place in the re-formed world (a `trainguard.membership.Membership` as JSON)."""

    rank: int
    membership: str

    def __post_init__(self) -> None:
        if not 0 <= self.rank < 1_000_000:
            raise Invalid("rank", f"must be in [0, 1000000), got {self.rank}")


@dataclass(frozen=True)
class RejoinArgs:
    """`rejoin`: a Control(rejoin) to each named local rank of the job, with its membership
    of the world of attempt `epoch`; the node's launch of the job is that attempt's from then
    on (fencing reads it so). Every membership names `epoch`."""

    job: str = ""
    epoch: int = 0
    ranks: tuple[RejoinRank, ...] = ()

    def __post_init__(self) -> None:
        _require_job(self.job)
        _check_epoch(self.epoch)
        if not 1 <= len(self.ranks) <= MAX_REJOIN_RANKS:
            raise Invalid(
                "ranks", f"must name 1 to {MAX_REJOIN_RANKS} ranks, got {len(self.ranks)}"
            )
        seen: set[int] = set()
        for i, r in enumerate(self.ranks):
            if r.rank in seen:
                raise Invalid(f"ranks[{i}].rank", f"rank {r.rank} is named twice")
            seen.add(r.rank)
            _membership(f"ranks[{i}].membership", r.membership, epoch=self.epoch)

    def memberships(self) -> dict[int, Membership]:
        """Current rank -> its membership (each checked at construction)."""
        return {r.rank: Membership.from_json(r.membership) for r in self.ranks}


@dataclass(frozen=True)
class AssignStandbyArgs:
    """`assign_standby`: the node's ready warm standby becomes a rank of attempt `epoch` of
    the job: it gets `membership` on stdin and runs its entry module (which must be `module`,
    the job's) with `env` added to its environment (the agent adds the job, attempt, agent
    socket and checkpoint dir as for a launch). From then the agent reports and stops it as
    the job's process on this node."""

    job: str
    epoch: int
    membership: str
    module: str
    env: dict[str, str] = field(default_factory=dict)
    ckpt_dir: str | None = None

    def __post_init__(self) -> None:
        bad = bad_name_reason(self.job)
        if bad is not None:
            raise Invalid("job", bad)
        _check_epoch(self.epoch)
        _membership("membership", self.membership, epoch=self.epoch)
        if not self.module or not all(p.isidentifier() for p in self.module.split(".")):
            raise Invalid("module", f"must be a dotted Python module name, got {self.module!r}")
        for name, value in self.env.items():
            if not _ENV_NAME.fullmatch(name):
                raise Invalid(f"env.{name}", "not a valid environment variable name")
            if name in RESERVED_ENV:
                raise Invalid(f"env.{name}", "is set by the agent")
            if "\0" in value:
                raise Invalid(f"env.{name}", "contains a NUL byte")
        if self.ckpt_dir is not None and (not self.ckpt_dir or "\0" in self.ckpt_dir):
            raise Invalid("ckpt_dir", "must be a non-empty path without NUL bytes")


CommandArgs = Union[
    CheckpointArgs,
    StopRanksArgs,
    StartJobArgs,
    StopJobArgs,
    FaultSpec,
    CollectStacksArgs,
    PreflightArgs,
    RepairArgs,
    SetCheckpointIntervalArgs,
    RejoinArgs,
    AssignStandbyArgs,
]

# Every kind's args class (`inject_fault` takes a FaultSpec, the sim backend's fault).
COMMAND_ARGS: Mapping[CommandKind, type] = {
    CommandKind.CHECKPOINT: CheckpointArgs,
    CommandKind.STOP_RANKS: StopRanksArgs,
    CommandKind.START_JOB: StartJobArgs,
    CommandKind.STOP_JOB: StopJobArgs,
    CommandKind.INJECT_FAULT: FaultSpec,
    CommandKind.COLLECT_STACKS: CollectStacksArgs,
    CommandKind.PREFLIGHT: PreflightArgs,
    CommandKind.REPAIR: RepairArgs,
    CommandKind.SET_CHECKPOINT_INTERVAL: SetCheckpointIntervalArgs,
    CommandKind.REJOIN: RejoinArgs,
    CommandKind.ASSIGN_STANDBY: AssignStandbyArgs,
}
_KIND_OF: Mapping[type, CommandKind] = {cls: kind for kind, cls in COMMAND_ARGS.items()}


def command_kind(args: CommandArgs) -> CommandKind:
    """The kind whose args `args` are."""
    kind = _KIND_OF.get(type(args))
    if kind is None:
        raise TypeError(f"{type(args).__name__} is not a command's args")
    return kind


def command(command_id: str, args: CommandArgs) -> Command:
    """The Command carrying `args` (its kind read from the table)."""
    return Command(id=command_id, kind=command_kind(args), args=to_wire(args))


class _ArgsDecoder(Decoder[A]):
    """Decodes a command's args; failures are ProtocolErrors at `args.<field>`."""

    def error(self, path: str, reason: str) -> Exception:
        return ProtocolError(f"args.{path}" if path else "args", reason)


_DECODERS: dict[type, _ArgsDecoder[Any]] = {}


def decode_args(cls: type[A], args: Mapping[str, Any]) -> A:
    """Strictly decode a command's `args` into its kind's class `cls`; raises ProtocolError
    naming the field (`args.nproc_per_node: must be >= 1, got 0`)."""
    found = _DECODERS.get(cls)
    if found is None:
        found = _DECODERS[cls] = _ArgsDecoder(cls)
    return typing.cast(A, found.decode(args))


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port_text = endpoint.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]  # "[::1]:29500"
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise Invalid("rdzv_endpoint", f"must be HOST:PORT with a port in 1..65535: {endpoint!r}")
    return host, int(port_text)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
