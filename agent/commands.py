"""Executing controller Commands on this node: one handler per command kind.

A handler takes the Command, decodes its `args` with its kind's class (trainguard.command_args:
a bad field fails that one command, naming it) and returns a CommandResult; the executor turns
every outcome, exceptions included, into a result (which the agent spools as a
`command_result` event). Supporting a new kind (the torchrun job backend's
`start_job`/`stop_job`) is registering a handler, nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from trainguard.command_args import (
    CheckpointArgs,
    SetCheckpointIntervalArgs,
    StopRanksArgs,
    decode_args,
)
from trainguard.protocol import (
    Command,
    CommandKind,
    Control,
    EventKind,
    FaultSpec,
    ProtocolError,
)

log = logging.getLogger("trainguard.agent.commands")


@dataclass(frozen=True)
class CommandResult:
    ok: bool
    message: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    # events the command answers with besides its `command_result` (a preflight's
    # `preflight_result`), spooled just before it: (kind, data)
    events: tuple[tuple[EventKind, dict[str, Any]], ...] = ()


Handler = Callable[[Command], CommandResult]


class ControlSender(Protocol):
    def send_control(self, job: str, control: Control) -> tuple[int, int]: ...


class FaultTarget(Protocol):
    def inject(self, spec: FaultSpec) -> None: ...


class CommandError(ValueError):
    """A command whose arguments are wrong; becomes ok=false with this message."""


class CommandExecutor:
    """Dispatches Commands to handlers by kind."""

    def __init__(self, handlers: Mapping[str, Handler] | None = None) -> None:
        self._handlers: dict[str, Handler] = dict(handlers or {})

    def register(self, kind: str, handler: Handler) -> None:
        self._handlers[kind] = handler

    def kinds(self) -> tuple[str, ...]:
        return tuple(sorted(self._handlers))

    def execute(self, cmd: Command) -> CommandResult:
        handler = self._handlers.get(cmd.kind)
        if handler is None:
            result = CommandResult(ok=False, message=f"unknown command kind {cmd.kind!r}")
        else:
            try:
                result = handler(cmd)
            except (CommandError, ProtocolError, ValueError) as e:
                result = CommandResult(ok=False, message=str(e))
            except Exception as e:  # a handler bug answers the controller, never kills us
                log.exception("event=command_handler_error command_id=%s kind=%s", cmd.id, cmd.kind)
                result = CommandResult(ok=False, message=f"internal error: {type(e).__name__}")
        log.info(
            "event=command_executed command_id=%s kind=%s ok=%s message=%r",
            cmd.id,
            cmd.kind,
            result.ok,
            result.message,
        )
        return result


def control_handlers(sender: ControlSender) -> dict[str, Handler]:
    """`checkpoint`, `stop_ranks` and `set_checkpoint_interval`: relay a Control datagram to
    the job's local ranks."""

    def relay(cmd: Command, control: Control) -> CommandResult:
        sent, failed = sender.send_control(control.job, control)
        data = {"job": control.job, "ranks_sent": sent, "ranks_failed": failed}
        if sent == 0:
            return CommandResult(
                ok=False,
                message=f"no reachable rank of job {control.job!r} on this node",
                data=data,
            )
        return CommandResult(ok=failed == 0, message=f"sent to {sent} rank(s)", data=data)

    def checkpoint(cmd: Command) -> CommandResult:
        args = decode_args(CheckpointArgs, cmd.args)
        request_id = args.request_id or cmd.id
        return relay(cmd, Control(action="checkpoint", request_id=request_id, job=args.job))

    def stop_ranks(cmd: Command) -> CommandResult:
        args = decode_args(StopRanksArgs, cmd.args)
        control = Control(
            action="checkpoint_stop" if args.checkpoint else "stop",
            request_id=args.request_id or cmd.id,
            job=args.job,
        )
        return relay(cmd, control)

    def set_checkpoint_interval(cmd: Command) -> CommandResult:
        args = decode_args(SetCheckpointIntervalArgs, cmd.args)
        control = Control(
            action="set_interval",
            request_id=args.request_id or cmd.id,
            job=args.job,
            every_steps=args.every_steps,
        )
        return relay(cmd, control)

    return {
        CommandKind.CHECKPOINT: checkpoint,
        CommandKind.STOP_RANKS: stop_ranks,
        CommandKind.SET_CHECKPOINT_INTERVAL: set_checkpoint_interval,
    }


def fault_handlers(target: FaultTarget | None) -> dict[str, Handler]:
    """`inject_fault`: apply a FaultSpec to the simulated hardware (sim backend only)."""

    def inject_fault(cmd: Command) -> CommandResult:
        if target is None:
            return CommandResult(ok=False, message="inject_fault needs the sim GPU backend")
        spec = decode_args(FaultSpec, cmd.args)
        target.inject(spec)
        return CommandResult(ok=True, message=f"injected {spec.kind}", data={"fault": spec.kind})

    return {CommandKind.INJECT_FAULT: inject_fault}


def unsupported_job_handlers() -> dict[str, Handler]:
    """Placeholders until a job backend registers real `start_job`/`stop_job` handlers."""

    def not_supported(cmd: Command) -> CommandResult:
        return CommandResult(ok=False, message=f"{cmd.kind}: not supported yet on this agent")

    return {CommandKind.START_JOB: not_supported, CommandKind.STOP_JOB: not_supported}


def default_executor(*, sender: ControlSender, fault_target: FaultTarget | None) -> CommandExecutor:
    handlers: dict[str, Handler] = {}
    handlers.update(unsupported_job_handlers())
    handlers.update(control_handlers(sender))
    handlers.update(fault_handlers(fault_target))
    return CommandExecutor(handlers)
