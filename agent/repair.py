"""The `repair` command: reset the node's GPUs once no job holds them, or reboot the node when
the agent's config allows it; both answer a `command_result` (ok, message).

A reboot's command id is written down (fsynced) before the reboot starts: the controller
resends a command until its result arrives, and the result of a reboot may never leave the
node; the agent that comes back answers the resent command "done" instead of rebooting again.

What does the resetting is a `RepairBackend`: `nvidia-smi --gpu-reset -i N` and `systemctl
reboot` (argument lists, never a shell) on a real node, the sim's reset and reboot otherwise.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from trainguard.agent.commands import CommandResult, Handler
from trainguard.agent.sim import SimHardware, SimResetError
from trainguard.command_args import RepairArgs, decode_args
from trainguard.protocol import Command, CommandKind

log = logging.getLogger("trainguard.agent.repair")

OUTPUT_TAIL = 300


class RepairFailed(RuntimeError):
    """A reset or reboot that did not happen (message says why)."""


class RepairBackend(Protocol):
    def gpu_count(self) -> int: ...

    def reset_gpu(self, gpu: int) -> None:
        """Reset one GPU; raises RepairFailed."""

    def reboot(self) -> None:
        """Start the node's reboot; raises RepairFailed."""


def _run(argv: Sequence[str], *, timeout_s: float) -> None:
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError:
        raise RepairFailed(f"{argv[0]}: not found") from None
    except subprocess.TimeoutExpired:
        raise RepairFailed(f"{' '.join(argv)}: no answer within {timeout_s:g} s") from None
    if done.returncode != 0:
        out = (done.stderr or done.stdout).decode(errors="replace").strip()[-OUTPUT_TAIL:]
        raise RepairFailed(f"{' '.join(argv)}: exit {done.returncode}: {out}")


class SystemRepair:
    """A real node: nvidia-smi resets a GPU (it refuses while a process uses it), systemd
    reboots the node."""

    def __init__(self, *, gpu_count: Callable[[], int], reset_timeout_s: float) -> None:
        self._gpu_count = gpu_count
        self._timeout_s = reset_timeout_s

    def gpu_count(self) -> int:
        return self._gpu_count()

    def reset_gpu(self, gpu: int) -> None:
        _run(["nvidia-smi", "--gpu-reset", "-i", str(gpu)], timeout_s=self._timeout_s)

    def reboot(self) -> None:
        _run(["systemctl", "reboot"], timeout_s=self._timeout_s)


class SimRepair:
    """The sim backend: a reset clears the simulated GPU's faults (or fails under its
    `reset_fail` fault); a reboot resets the whole sim, and the agent stays up as if back."""

    def __init__(self, sim: SimHardware) -> None:
        self._sim = sim

    def gpu_count(self) -> int:
        return len(self._sim.bus_id_to_index())

    def reset_gpu(self, gpu: int) -> None:
        try:
            self._sim.reset_gpu(gpu)
        except (SimResetError, ValueError) as e:
            raise RepairFailed(str(e)) from None

    def reboot(self) -> None:
        self._sim.reboot()


class RebootRecord:
    """The id of the last reboot command this node carried out, in one small file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def done(self, command_id: str) -> bool:
        try:
            return self.path.read_text().strip() == command_id
        except OSError:
            return False

    def write(self, command_id: str) -> None:
        """Durably, before the reboot: raises OSError (then the reboot does not start)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, command_id.encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def clear(self) -> None:
        try:
            self.path.unlink()
        except OSError:
            pass


def repair_handler(
    backend: RepairBackend,
    *,
    busy_jobs: Callable[[], Sequence[str]],
    allow_reboot: bool,
    reboots: RebootRecord,
) -> dict[str, Handler]:
    """The `repair` handler. `busy_jobs`: the jobs with a process on this node now (launched
    here or heartbeating); any of them refuses a reset or reboot."""

    def handle(cmd: Command) -> CommandResult:
        args = decode_args(RepairArgs, cmd.args)
        if args.method == "reboot" and reboots.done(cmd.id):
            return CommandResult(
                ok=True,
                message="rebooted: this command's reboot is done",
                data={"method": "reboot"},
            )
        busy = sorted(set(busy_jobs()))
        if busy:
            return CommandResult(
                ok=False,
                message=f"{args.method} refused: job(s) {', '.join(busy)} still run on this node",
                data={"method": args.method, "jobs": busy},
            )
        if args.method == "reboot":
            return _reboot(backend, allow_reboot=allow_reboot, reboots=reboots, command_id=cmd.id)
        return _reset(backend, args.gpus)

    return {CommandKind.REPAIR: handle}


def _reboot(
    backend: RepairBackend, *, allow_reboot: bool, reboots: RebootRecord, command_id: str
) -> CommandResult:
    if not allow_reboot:
        return CommandResult(
            ok=False,
            message="reboot refused: this agent's config does not allow it (repair.allow_reboot)",
            data={"method": "reboot"},
        )
    try:
        reboots.write(command_id)
    except OSError as e:
        return CommandResult(
            ok=False,
            message=f"reboot refused: cannot record it in {reboots.path}: {e.strerror or e}",
            data={"method": "reboot"},
        )
    log.warning("event=node_reboot command_id=%s reason=repair_command", command_id)
    try:
        backend.reboot()
    except RepairFailed as e:
        reboots.clear()
        return CommandResult(ok=False, message=f"reboot failed: {e}", data={"method": "reboot"})
    return CommandResult(ok=True, message="reboot started", data={"method": "reboot"})


def _reset(backend: RepairBackend, gpus: Sequence[int]) -> CommandResult:
    count = backend.gpu_count()
    targets = list(gpus) or list(range(count))
    missing = [g for g in targets if g >= count]
    if missing:
        return CommandResult(
            ok=False,
            message=f"gpu_reset refused: no GPU {','.join(map(str, missing))} on this node "
            f"({count} GPUs)",
            data={"method": "gpu_reset"},
        )
    done: list[int] = []
    failed: list[str] = []
    for gpu in targets:
        try:
            backend.reset_gpu(gpu)
        except RepairFailed as e:
            failed.append(f"GPU {gpu}: {e}")
            log.error("event=gpu_reset_failed gpu=%d error=%r", gpu, str(e))
        else:
            done.append(gpu)
            log.warning("event=gpu_reset gpu=%d", gpu)
    data = {"method": "gpu_reset", "reset": done, "failed": len(failed)}
    if failed:
        return CommandResult(
            ok=False, message=("gpu_reset failed: " + "; ".join(failed))[:OUTPUT_TAIL], data=data
        )
    return CommandResult(ok=True, message=f"reset GPU {','.join(map(str, done))}", data=data)
