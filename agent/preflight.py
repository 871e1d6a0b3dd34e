"""The preflight: the node's health checks, each a small function with its pass mark, and the
`preflight` command that runs them and answers with a `preflight_result` event.

The NVML checks (nvml_health, row_remaps, ecc) judge one fresh read of the GPU backend (real
NVML or the sim); the compute burn and the all-reduce run in child processes (a `Burner` and a
`Collective`, agent.preflight_backends) with a deadline each; ckpt_storage writes, fsyncs,
reads back and removes a file. docs/hardware.md says what each proves and how long it takes.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainguard.agent.burn import DeviceBurn
from trainguard.agent.commands import CommandResult, Handler
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
CKPT_PROBE_BYTES = 1024 * 1024
DETAIL_MAX = 300


@dataclass(frozen=True)
class CheckResult:
    """One check's verdict; `value`/`reference` where the check measured a figure."""

    name: str
    passed: bool
    detail: str
    value: float | None = None
    reference: float | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "passed": self.passed,
            "detail": self.detail[:DETAIL_MAX],
        }
        if self.value is not None:
            out["value"] = round(self.value, 3)
        if self.reference is not None:
            out["reference"] = self.reference
        return out


@dataclass(frozen=True)
class CollectiveResult:
    """An all-reduce's figures (`busbw_gbps`), or why there were none (`error`)."""

    busbw_gbps: float = 0.0
    world: int = 0
    wrong: int = 0
    backend: str = ""
    error: str = ""


class Burner(Protocol):
    def burn(self, *, gpus: Sequence[int], seconds: float) -> list[DeviceBurn]:
        """Burn each GPU for `seconds`; raises WorkerError when the burn itself fails."""


class Collective(Protocol):
    def all_reduce(self, *, gpus: Sequence[int], seconds: float) -> CollectiveResult:
        """An all-reduce among `gpus` for at most `seconds`; raises WorkerError on failure."""


class WorkerError(RuntimeError):
    """A check's child process failed, timed out or answered nonsense (message says which)."""


# -- the checks -------------------------------------------------------------------------------


def _gpu_list(indexes: Sequence[int]) -> str:
    return ",".join(str(i) for i in indexes)


def check_nvml_health(coll: GpuCollection, *, expected_gpus: int) -> CheckResult:
    """Every GPU answers NVML: none lost (GpuIsLost, fallen off the bus), and as many GPUs as
    the node has shown since the agent started (a GPU gone from the bus leaves the count)."""
    name = "nvml_health"
    lost = [g.index for g in coll.gpus if g.lost]
    if lost:
        return CheckResult(name, False, f"GPU {_gpu_list(lost)} lost (NVML: GPU is lost)")
    if not coll.gpus:
        return CheckResult(name, False, "NVML reports no GPU")
    if len(coll.gpus) < expected_gpus:
        return CheckResult(
            name,
            False,
            f"{len(coll.gpus)} GPU(s) answer NVML, the node had {expected_gpus}",
            value=float(len(coll.gpus)),
        )
    return CheckResult(
        name, True, f"{len(coll.gpus)} GPU(s) answer NVML", value=float(len(coll.gpus))
    )


def check_row_remaps(coll: GpuCollection) -> CheckResult:
    """No GPU has a row remap pending (needs a reset to apply) or failed (needs an RMA)."""
    name = "row_remaps"
    pending = [g.index for g in coll.gpus if g.remapped_rows_pending]
    failed = [g.index for g in coll.gpus if g.remapped_rows_failure]
    unread = [g.index for g in coll.gpus if g.lost]
    problems = []
    if failed:
        problems.append(f"GPU {_gpu_list(failed)}: row remapping failed")
    if pending:
        problems.append(f"GPU {_gpu_list(pending)}: row remap pending")
    if unread:
        problems.append(f"GPU {_gpu_list(unread)}: lost, not read")
    if problems:
        return CheckResult(name, False, "; ".join(problems))
    unsupported = [g.index for g in coll.gpus if g.remapped_rows_pending is None]
    detail = "no remap pending or failed"
    if unsupported:  # before Ampere: page retirement instead, nothing to judge here
        detail += f" (GPU {_gpu_list(unsupported)}: row remapping not supported)"
    return CheckResult(name, True, detail)


def check_ecc(coll: GpuCollection) -> CheckResult:
    """No uncorrectable ECC error since the last reset (volatile count 0) on any GPU."""
    name = "ecc"
    bad = [
        (g.index, g.ecc_uncorrected_volatile_total)
        for g in coll.gpus
        if g.ecc_uncorrected_volatile_total
    ]
    unread = [g.index for g in coll.gpus if g.lost]
    if bad or unread:
        parts = [f"GPU {i}: {n} uncorrectable" for i, n in bad]
        if unread:
            parts.append(f"GPU {_gpu_list(unread)}: lost, not read")
        return CheckResult(name, False, "; ".join(parts), value=float(sum(n or 0 for _, n in bad)))
    unsupported = [g.index for g in coll.gpus if g.ecc_uncorrected_volatile_total is None]
    detail = "no uncorrectable ECC error since the last reset"
    if unsupported:
        detail += f" (GPU {_gpu_list(unsupported)}: ECC not reported)"
    return CheckResult(name, True, detail, value=0.0)


def _below(value: float, reference: float | None, tolerance: float) -> bool:
    return reference is not None and value < reference * (1.0 - tolerance)


def check_compute_burn(
    burner: Burner,
    *,
    gpus: Sequence[int],
    burn_s: float,
    reference: float | None,
    tolerance: float,
) -> CheckResult:
    """Every GPU's products agree with their checksums (no silent data corruption), and its
    TFLOP/s is at least `reference * (1 - tolerance)` (the comparison only with a reference).
    `value` is the slowest GPU's rate."""
    name = "compute_burn"
    if not gpus:
        return CheckResult(name, False, "no GPU to burn")
    try:
        results = burner.burn(gpus=gpus, seconds=burn_s)
    except WorkerError as e:
        return CheckResult(name, False, str(e), reference=reference)
    by_gpu = {r.gpu: r for r in results}
    problems = []
    for gpu in gpus:
        r = by_gpu.get(gpu)
        if r is None:
            problems.append(f"GPU {gpu}: no result")
        elif r.error:
            problems.append(f"GPU {gpu}: {r.error}")
        elif r.mismatches:
            problems.append(
                f"GPU {gpu}: {r.mismatches} of {r.iterations} products wrong "
                "(silent data corruption)"
            )
        elif _below(r.tflops, reference, tolerance):
            problems.append(
                f"GPU {gpu}: {r.tflops:.1f} TFLOP/s, below {reference:g} - {tolerance:.0%}"
            )
    rates = [by_gpu[g].tflops for g in gpus if g in by_gpu and not by_gpu[g].error]
    slowest = min(rates) if rates else 0.0
    if problems:
        return CheckResult(name, False, "; ".join(problems), value=slowest, reference=reference)
    products = sum(r.iterations for r in results)
    detail = f"{products} products on {len(gpus)} GPU(s) exact; slowest {slowest:.1f} TFLOP/s"
    if reference is None:
        detail += " (no reference: speed not judged)"
    return CheckResult(name, True, detail, value=slowest, reference=reference)


def check_collective(
    collective: Collective,
    *,
    gpus: Sequence[int],
    seconds: float,
    reference: float | None,
    tolerance: float,
) -> CheckResult:
    """An all-reduce among the node's GPUs gives the right sums at a bus bandwidth of at least
    `reference * (1 - tolerance)` GB/s (compared only with a reference)."""
    name = "collective_bandwidth"
    try:
        r = collective.all_reduce(gpus=gpus, seconds=seconds)
    except WorkerError as e:
        return CheckResult(name, False, str(e), reference=reference)
    if r.error:
        return CheckResult(name, False, r.error, reference=reference)
    if r.world < 2:
        return CheckResult(name, True, "one GPU: no collective to measure", reference=reference)
    if r.wrong:
        return CheckResult(
            name,
            False,
            f"{r.wrong} all-reduce(s) gave wrong sums",
            value=r.busbw_gbps,
            reference=reference,
        )
    detail = f"{r.backend} all-reduce among {r.world}: {r.busbw_gbps:.1f} GB/s bus bandwidth"
    if _below(r.busbw_gbps, reference, tolerance):
        return CheckResult(
            name,
            False,
            f"{detail}, below {reference:g} - {tolerance:.0%}",
            value=r.busbw_gbps,
            reference=reference,
        )
    if reference is None:
        detail += " (no reference: speed not judged)"
    return CheckResult(name, True, detail, value=r.busbw_gbps, reference=reference)


def check_ckpt_storage(ckpt_dir: str | None) -> CheckResult:
    """The checkpoint directory takes a file: write, fsync, read back the same bytes, remove."""
    name = "ckpt_storage"
    if ckpt_dir is None:
        return CheckResult(name, True, "skipped: no ckpt_dir given")
    payload = os.urandom(CKPT_PROBE_BYTES)
    path = Path(ckpt_dir) / f".trainguard-preflight-{uuid.uuid4().hex[:12]}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        if path.read_bytes() != payload:
            return CheckResult(name, False, f"{ckpt_dir}: read back differs from what was written")
    except OSError as e:
        return CheckResult(name, False, f"{ckpt_dir}: {e.strerror or e}")
    finally:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("event=preflight_probe_not_removed path=%s error=%r", path, str(e))
    return CheckResult(
        name, True, f"{ckpt_dir}: wrote, synced, read back and removed {CKPT_PROBE_BYTES} bytes"
    )


# -- the run ----------------------------------------------------------------------------------


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
                f"GPU {_gpu_list(lost)} lost: no all-reduce across the node",
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
