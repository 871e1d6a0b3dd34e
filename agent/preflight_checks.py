"""The preflight's checks: each a small function that judges one thing about the node and
says why (`CheckResult`), and the two interfaces the measuring ones run through (`Burner`,
`Collective`; agent.preflight_backends). docs/hardware.md says what each proves."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trainguard.agent.burn import DeviceBurn
from trainguard.model import GpuCollection

log = logging.getLogger("trainguard.agent.preflight")

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


def gpu_list(indexes: Sequence[int]) -> str:
    return ",".join(str(i) for i in indexes)


def check_nvml_health(coll: GpuCollection, *, expected_gpus: int) -> CheckResult:
    """Every GPU answers NVML: none lost (GpuIsLost, fallen off the bus), and as many GPUs as
    the node has shown since the agent started (a GPU gone from the bus leaves the count)."""
    name = "nvml_health"
    lost = [g.index for g in coll.gpus if g.lost]
    if lost:
        return CheckResult(name, False, f"GPU {gpu_list(lost)} lost (NVML: GPU is lost)")
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
        problems.append(f"GPU {gpu_list(failed)}: row remapping failed")
    if pending:
        problems.append(f"GPU {gpu_list(pending)}: row remap pending")
    if unread:
        problems.append(f"GPU {gpu_list(unread)}: lost, not read")
    if problems:
        return CheckResult(name, False, "; ".join(problems))
    unsupported = [g.index for g in coll.gpus if g.remapped_rows_pending is None]
    detail = "no remap pending or failed"
    if unsupported:  # before Ampere: page retirement instead, nothing to judge here
        detail += f" (GPU {gpu_list(unsupported)}: row remapping not supported)"
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
            parts.append(f"GPU {gpu_list(unread)}: lost, not read")
        return CheckResult(name, False, "; ".join(parts), value=float(sum(n or 0 for _, n in bad)))
    unsupported = [g.index for g in coll.gpus if g.ecc_uncorrected_volatile_total is None]
    detail = "no uncorrectable ECC error since the last reset"
    if unsupported:
        detail += f" (GPU {gpu_list(unsupported)}: ECC not reported)"
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
