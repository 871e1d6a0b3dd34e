"""The compute burn: a matmul loop per GPU for a given time, every product checked against
checksums computed independently of it, and the TFLOP/s each GPU achieved.

It runs in a child process (`python -m trainguard.agent.burn '<json>'`, one JSON line out), so
torch and a CUDA context never live in the agent and a hung kernel ends with the child. The
matrices hold small integers in float32 with TF32 off: every partial sum is an integer below
2**24, so the product is exact whatever order the hardware sums in, and its row and column
sums (float64) must equal `A @ (B 1)` and `(1' A) @ B` exactly (algorithm-based fault
tolerance, Huang & Abraham 1984). A wrong bit anywhere in a product changes its row and its
column sum: that is silent data corruption caught. `corrupt` flips one bit of one product on
the GPUs it names: how the sim backend stands in for a corrupting GPU, and how a test proves
the check catches one.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from trainguard.clock import SYSTEM_CLOCK, Clock

# Matrix side per device: 8192 on a GPU (1.1 TFLOP per product, ~20 ms on an H100 in FP32),
# 256 on a CPU stand-in (a few ms: the check's logic, not the CPU's speed, is what it shows).
CUDA_SIZE = 8192
CPU_SIZE = 256
SEED = 20240611
# the bit flipped by `corrupt`: a mantissa bit, so the value stays finite and plausible
CORRUPT_BIT = 1 << 10


@dataclass(frozen=True)
class DeviceBurn:
    """What one GPU (or its CPU stand-in) did: products computed and checked, how many
    disagreed with the checksums, and the rate it achieved."""

    gpu: int
    iterations: int
    mismatches: int
    seconds: float
    tflops: float
    error: str = ""


class _Ops:
    """One device's matrices and the three operations the loop needs."""

    def __init__(
        self,
        *,
        matmul: Callable[[], Any],
        check: Callable[[Any], bool],
        flip: Callable[[Any], None],
    ) -> None:
        self.matmul = matmul
        self.check = check
        self.flip = flip


def _numpy_ops(size: int) -> _Ops:
    import numpy as np  # noqa: PLC0415 - heavy: only the burn's child process loads it

    rng = np.random.default_rng(SEED)
    a = rng.integers(-2, 3, size=(size, size)).astype(np.float32)
    b = rng.integers(-2, 3, size=(size, size)).astype(np.float32)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    col_ref = a64.sum(axis=0) @ b64
    row_ref = a64 @ b64.sum(axis=1)

    def check(c: Any) -> bool:
        c64 = c.astype(np.float64)
        return bool(
            np.array_equal(c64.sum(axis=0), col_ref) and np.array_equal(c64.sum(axis=1), row_ref)
        )

    def flip(c: Any) -> None:
        c.view(np.int32)[0, 0] ^= CORRUPT_BIT

    return _Ops(matmul=lambda: a @ b, check=check, flip=flip)


@dataclass(frozen=True)
class _TorchInputs:
    """The matrices (int8 on the host) and their checksums, made once for every GPU."""

    a: Any
    b: Any
    col_ref: Any
    row_ref: Any


def _torch_inputs(size: int) -> _TorchInputs:
    import torch  # noqa: PLC0415 - heavy: only the burn's child process loads torch

    gen = torch.Generator().manual_seed(SEED)
    a = torch.randint(-2, 3, (size, size), generator=gen, dtype=torch.int8)
    b = torch.randint(-2, 3, (size, size), generator=gen, dtype=torch.int8)
    # on the host in float64, exact for these integers: a reference the GPU did not compute
    col_ref = a.sum(dim=0, dtype=torch.float64) @ b.to(torch.float64)
    row_ref = a.to(torch.float64) @ b.sum(dim=1, dtype=torch.float64)
    return _TorchInputs(a=a, b=b, col_ref=col_ref, row_ref=row_ref)


def _torch_ops(inputs: _TorchInputs, device: str) -> _Ops:
    import torch  # noqa: PLC0415 - heavy: only the burn's child process loads torch

    torch.backends.cuda.matmul.allow_tf32 = False  # TF32 rounds: the product must be exact
    torch.set_float32_matmul_precision("highest")
    a = inputs.a.to(device=device, dtype=torch.float32)
    b = inputs.b.to(device=device, dtype=torch.float32)
    col_ref = inputs.col_ref.to(device)
    row_ref = inputs.row_ref.to(device)

    def check(c: Any) -> bool:
        ok = torch.equal(c.sum(dim=0, dtype=torch.float64), col_ref) and torch.equal(
            c.sum(dim=1, dtype=torch.float64), row_ref
        )
        return bool(ok)

    def flip(c: Any) -> None:
        c.view(torch.int32)[0, 0] ^= CORRUPT_BIT

    return _Ops(matmul=lambda: a @ b, check=check, flip=flip)


def burn_device(
    ops: _Ops, *, gpu: int, size: int, seconds: float, corrupt: bool, clock: Clock = SYSTEM_CLOCK
) -> DeviceBurn:
    """Multiply and check until `seconds` have passed (at least one product)."""
    iterations = mismatches = 0
    start = clock.monotonic()
    while True:
        c = ops.matmul()
        if corrupt and iterations == 0:
            ops.flip(c)
        if not ops.check(c):
            mismatches += 1
        iterations += 1
        elapsed = clock.monotonic() - start
        if elapsed >= seconds:
            break
    flops = 2.0 * size**3 * iterations
    return DeviceBurn(
        gpu=gpu,
        iterations=iterations,
        mismatches=mismatches,
        seconds=round(elapsed, 6),
        tflops=flops / max(elapsed, 1e-9) / 1e12,
    )


def _guarded(gpu: int, body: Callable[[], DeviceBurn]) -> DeviceBurn:
    try:
        return body()
    except Exception as e:  # one GPU failing (CUDA error, out of memory) is that GPU's result
        return DeviceBurn(
            gpu=gpu,
            iterations=0,
            mismatches=0,
            seconds=0.0,
            tflops=0.0,
            error=f"{type(e).__name__}: {e}"[:300],
        )


def burn(
    *,
    gpus: Sequence[int],
    seconds: float,
    device: str,
    corrupt: Sequence[int] = (),
    size: int | None = None,
) -> list[DeviceBurn]:
    """Burn every GPU of `gpus` for `seconds`: on "cuda" all at once (a thread per GPU, the
    CUDA ordinal being the position in `gpus` with CUDA_VISIBLE_DEVICES set by the caller), on
    "cpu" one after another for `seconds / len(gpus)` each (a stand-in: one CPU is every GPU)."""
    if device == "cuda":
        n = size or CUDA_SIZE
        inputs = _torch_inputs(n)
        results: dict[int, DeviceBurn] = {}

        def run(ordinal: int, gpu: int) -> None:
            results[gpu] = _guarded(
                gpu,
                lambda: burn_device(
                    _torch_ops(inputs, f"cuda:{ordinal}"),
                    gpu=gpu,
                    size=n,
                    seconds=seconds,
                    corrupt=gpu in corrupt,
                ),
            )

        threads = [
            threading.Thread(target=run, args=(i, g), name=f"burn-{g}") for i, g in enumerate(gpus)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [results[g] for g in gpus]
    n = size or CPU_SIZE
    each_s = seconds / max(1, len(gpus))
    return [
        _guarded(
            g,
            lambda g=g: burn_device(
                _cpu_ops(n), gpu=g, size=n, seconds=each_s, corrupt=g in corrupt
            ),  # type: ignore[misc]
        )
        for g in gpus
    ]


def _cpu_ops(size: int) -> _Ops:
    """numpy when it is there (lighter to load), else torch on the CPU."""
    try:
        import numpy  # noqa: F401, PLC0415 - only to learn whether it is installed
    except ImportError:
        return _torch_ops(_torch_inputs(size), "cpu")
    return _numpy_ops(size)


def main(argv: Sequence[str]) -> int:
    """`python -m trainguard.agent.burn '{"gpus": [..], "seconds": s, "device": d, ...}'`:
    prints one JSON line, `{"results": [DeviceBurn, ...]}`."""
    spec = json.loads(argv[0])
    results = burn(
        gpus=[int(g) for g in spec["gpus"]],
        seconds=float(spec["seconds"]),
        device=str(spec["device"]),
        corrupt=[int(g) for g in spec.get("corrupt", [])],
        size=spec.get("size"),
    )
    print(json.dumps({"results": [asdict(r) for r in results]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
