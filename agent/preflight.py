"""The `preflight` command: runs the checks it names (agent.preflight_checks) in the
contract's order, one preflight at a time, and answers with a `preflight_result` event.

The NVML checks (nvml_health, row_remaps, ecc) judge one fresh, bounded read of the GPU backend
(real NVML or the sim); the compute burn and the all-reduce run in child processes (a `Burner`
and a `Collective`, agent.preflight_backends) with a deadline each; ckpt_storage writes,
fsyncs, reads back and removes a file. docs/hardware.md says what each proves and how long it
takes.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainguard.agent.commands import CommandResult, Handler
from trainguard.agent.preflight_checks import (
    DETAIL_MAX,
    Burner,
    CheckResult,
    Collective,
    check_ckpt_storage,
    check_collective,
    check_compute_burn,
    check_ecc,
    check_nvml_health,
    check_row_remaps,
    gpu_list,
)
from trainguard.clock import Clock
from trainguard.command_args import PREFLIGHT_CHECKS, PreflightArgs, decode_args
from trainguard.model import GpuCollection, GpuCollector
from trainguard.protocol import Command, CommandKind, EventKind

log = logging.getLogger("trainguard.agent.preflight")

# The reference figures a preflight's `reference` may hold.
REF_BURN_TFLOPS = "compute_burn_tflops"
REF_COLLECTIVE_GBPS = "collective_gbps"
# The all-reduce runs this long at most (it also stops after a fixed number of iterations).
COLLECTIVE_MAX_S = 5.0


@dataclass(frozen=True)
class PreflightOutcome:
    passed: bool
    checks: tuple[CheckResult, ...]
    duration_s: float

    def to_wire(self, *, command_id: str) -> dict[str, Any]:
        """The `preflight_result` event's data."""
        return {
            "command_id": command_id,
            "passed": self.passed,
            "checks": [c.to_wire() for c in self.checks],
            "duration_s": round(self.duration_s, 3),
        }

    def summary(self) -> str:
        failed = [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]
        if not failed:
            return f"preflight passed ({len(self.checks)} checks)"
        return ("preflight failed: " + "; ".join(failed))[:DETAIL_MAX]


class PreflightRunner:
    """Runs a preflight's checks in PREFLIGHT_CHECKS order, one preflight at a time."""

    def __init__(
        self,
        *,
        gpu: GpuCollector,
        burner: Burner,
        collective: Collective,
        clock: Clock,
        expected_gpus: Callable[[], int] = lambda: 0,
        read_timeout_s: float = 5.0,
    ) -> None:
        """`expected_gpus`: the most GPUs the node has shown (fewer now fails nvml_health);
        `read_timeout_s`: how long the GPU read may take (a hung NVML fails the preflight,
        it never holds the command worker)."""
        self._gpu = gpu
        self._read_timeout_s = read_timeout_s
        self._burner = burner
        self._collective = collective
        self._clock = clock
        self._expected_gpus = expected_gpus
        self._busy = threading.Lock()

    def run(self, args: PreflightArgs) -> PreflightOutcome:
        """Run the checks `args` names; raises PreflightBusy while another one runs."""
        if not self._busy.acquire(blocking=False):
            raise PreflightBusy("a preflight is already running on this node")
        try:
            return self._run(args)
        finally:
            self._busy.release()

    def _run(self, args: PreflightArgs) -> PreflightOutcome:
        start = self._clock.monotonic()
        wanted = set(args.checks)
        # one fresh read, not the loop's last snapshot
        coll, unread = read_gpus(self._gpu, timeout_s=self._read_timeout_s)
        runs = self._gpu_checks(coll, args) if coll is not None else _unread_checks(unread)
        runs["ckpt_storage"] = lambda: check_ckpt_storage(args.ckpt_dir)
        results = []
        for name in PREFLIGHT_CHECKS:
            if name in wanted:
                result = runs[name]()
                log.info(
                    "event=preflight_check check=%s passed=%s detail=%r",
                    name,
                    result.passed,
                    result.detail,
                )
                results.append(result)
        duration_s = self._clock.monotonic() - start
        return PreflightOutcome(
            passed=all(r.passed for r in results), checks=tuple(results), duration_s=duration_s
        )

    def _gpu_checks(
        self, coll: GpuCollection, args: PreflightArgs
    ) -> dict[str, Callable[[], CheckResult]]:
        healthy = [g.index for g in coll.gpus if not g.lost]
        return {
            "nvml_health": lambda: check_nvml_health(coll, expected_gpus=self._expected_gpus()),
            "row_remaps": lambda: check_row_remaps(coll),
            "ecc": lambda: check_ecc(coll),
            "compute_burn": lambda: check_compute_burn(
                self._burner,
                gpus=healthy,
                burn_s=args.burn_s,
                reference=args.reference.get(REF_BURN_TFLOPS),
                tolerance=args.tolerance,
            ),
            "collective_bandwidth": lambda: self._collective_check(coll, args),
        }

    def _collective_check(self, coll: GpuCollection, args: PreflightArgs) -> CheckResult:
        lost = [g.index for g in coll.gpus if g.lost]
        if lost:  # the collective cannot form without them
            return CheckResult(
                "collective_bandwidth",
                False,
                f"GPU {gpu_list(lost)} lost: no all-reduce across the node",
            )
        return check_collective(
            self._collective,
            gpus=[g.index for g in coll.gpus],
            seconds=min(args.burn_s, COLLECTIVE_MAX_S),
            reference=args.reference.get(REF_COLLECTIVE_GBPS),
            tolerance=args.tolerance,
        )


def read_gpus(gpu: GpuCollector, *, timeout_s: float) -> tuple[GpuCollection | None, str]:
    """One GPU read in a thread of its own, waited for `timeout_s` at most: (collection, "")
    or (None, why). A read that hangs (NVML with a GPU off the bus) is left behind, as the
    GPU source leaves its own."""
    box: list[GpuCollection] = []
    failed: list[str] = []

    def read() -> None:
        try:
            box.append(gpu.collect())
        except Exception as e:  # the backend's failure is the checks' verdict
            failed.append(f"{type(e).__name__}: {e}")

    worker = threading.Thread(target=read, name="preflight-gpu-read", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if box:
        return box[0], ""
    if failed:
        return None, f"the GPU read failed: {failed[0]}"[:DETAIL_MAX]
    return None, f"NVML did not answer within {timeout_s:g} s"


def _unread_checks(why: str) -> dict[str, Callable[[], CheckResult]]:
    """Without a GPU read every GPU check fails, saying why."""
    return {
        name: functools.partial(CheckResult, name, False, why)
        for name in ("nvml_health", "row_remaps", "ecc", "compute_burn", "collective_bandwidth")
    }


class PreflightBusy(RuntimeError):
    """A preflight was asked for while one runs."""


def preflight_handler(runner: PreflightRunner) -> dict[str, Handler]:
    """The `preflight` handler: its checks go out as a `preflight_result` event, and the
    command's own `command_result` (ok = passed) completes the command."""

    def handle(cmd: Command) -> CommandResult:
        args = decode_args(PreflightArgs, cmd.args)
        try:
            outcome = runner.run(args)
        except PreflightBusy as e:
            return CommandResult(ok=False, message=str(e))
        log.info(
            "event=preflight_done command_id=%s passed=%s duration_s=%.1f failed=%s",
            cmd.id,
            outcome.passed,
            outcome.duration_s,
            ",".join(c.name for c in outcome.checks if not c.passed) or "-",
        )
        return CommandResult(
            ok=outcome.passed,
            message=outcome.summary(),
            data={"passed": outcome.passed},
            events=((EventKind.PREFLIGHT_RESULT, outcome.to_wire(command_id=cmd.id)),),
        )

    return {CommandKind.PREFLIGHT: handle}
