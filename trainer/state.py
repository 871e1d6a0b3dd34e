"""Training state as tensors and primitives: RNG capture/restore, tensor split, host snapshots.

Everything a checkpoint stores passes through here, so that loading can always use
`torch.load(weights_only=True)`: RNG states become int64/uint8 tensors and plain numbers,
never pickled Python objects.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import mmap
import os
import random
import sys
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainguard.clock import SYSTEM_CLOCK, Clock

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

__all__ = [
    "SnapshotPool",
    "capture_rng",
    "check_storable",
    "derive_rng",
    "fill_tensors",
    "restore_rng",
    "split_tensors",
    "tensor_refs",
]

_TENSOR_REF = "__trainguard_tensor__"
_PRIMITIVES = (int, float, bool, str, bytes, type(None))
_PAGE_BYTES = mmap.PAGESIZE
_TOUCH_CHUNK_BYTES = 8 << 20  # ~2,000 page faults: a few ms of CPU between stop checks

log = logging.getLogger("trainguard.trainer")


def capture_rng() -> dict[str, Any]:
    """Python, numpy, torch CPU and every CUDA device's generator state, as tensors."""
    version, py_state, gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "python": {
            "version": int(version),
            "state": torch.tensor(py_state, dtype=torch.int64),
            "gauss": gauss,
        },
        "numpy": {
            "kind": str(np_kind),
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64).copy()),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.cpu() for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["kind"],
            npst["keys"].numpy().astype(np.uint32),
            int(npst["pos"]),
            int(npst["has_gauss"]),
            float(npst["gauss"]),
        )
    )
    torch.set_rng_state(state["torch"])
    cuda_states = list(state.get("cuda") or [])
    if cuda_states and torch.cuda.is_available():
        n = min(len(cuda_states), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(cuda_states[:n])


def derive_rng(state: Mapping[str, Any], *, step: int, rank: int, world_size: int) -> int:
    """Seed every generator (python, numpy, torch CPU and all CUDA devices) from a saved RNG
    state and this rank's place in a new world: used when a checkpoint is resumed at another
    world size, where the saved per-rank states have no rank to go to. The same checkpoint
    resumed at the same new world size always gives the same seeds. Returns the seed."""
    digest = hashlib.sha256()
    digest.update(state["torch"].numpy().tobytes())
    digest.update(f":{step}:{world_size}:{rank}".encode())
    seed = int.from_bytes(digest.digest()[:8], "big") >> 1
    random.seed(seed)
    np.random.seed(seed & 0xFFFF_FFFF)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def check_storable(obj: Any, path: str = "") -> None:
    """Raise TypeError naming the first value that `weights_only=True` could not load back."""
    if isinstance(obj, torch.Tensor) or isinstance(obj, _PRIMITIVES):
        return
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str | int):
                raise TypeError(f"{path or '<root>'}: key {k!r} is not a str or int")
            check_storable(v, f"{path}.{k}" if path else str(k))
        return
    if isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            check_storable(v, f"{path}[{i}]")
        return
    raise TypeError(
        f"{path or '<root>'}: {type(obj).__name__} cannot be checkpointed "
        "(only tensors, numbers, strings, None, and dicts/lists of them)"
    )


def split_tensors(obj: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Separate tensors from structure: ({path: tensor}, skeleton with references)."""
    flat: dict[str, torch.Tensor] = {}

    def walk(o: Any, path: str) -> Any:
        if isinstance(o, torch.Tensor):
            flat[path] = o
            return {_TENSOR_REF: path}
        if isinstance(o, Mapping):
            return {k: walk(v, f"{path}/{k}") for k, v in o.items()}
        if isinstance(o, list | tuple):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(o)]
            return items if isinstance(o, list) else tuple(items)
        return o

    skeleton = walk(obj, prefix)
    return flat, skeleton


def tensor_refs(skeleton: Any) -> list[str]:
    """The flat names a skeleton refers to (the keys `fill_tensors` will look up)."""
    if isinstance(skeleton, Mapping):
        if set(skeleton.keys()) == {_TENSOR_REF}:
            return [str(skeleton[_TENSOR_REF])]
        return [r for v in skeleton.values() for r in tensor_refs(v)]
    if isinstance(skeleton, list | tuple):
        return [r for v in skeleton for r in tensor_refs(v)]
    return []


def fill_tensors(skeleton: Any, flat: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of split_tensors; a missing tensor raises KeyError naming its path."""
    if isinstance(skeleton, Mapping):
        if set(skeleton.keys()) == {_TENSOR_REF}:
            return flat[skeleton[_TENSOR_REF]]
        return {k: fill_tensors(v, flat) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [fill_tensors(v, flat) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(fill_tensors(v, flat) for v in skeleton)
    return skeleton


class SnapshotPool:
    """Copies state into reusable host buffers (pinned when the source is on a GPU).

    Reusing the buffers between checkpoints avoids page-faulting fresh memory on every save,
    which is most of what a naive `.clone()` costs. Safe because at most one save is in flight:
    the writer is finished with the previous snapshot before the next one is taken.

    `prepare(state)` moves that cost off the first save too: a background thread allocates
    the buffers a snapshot of `state` needs and touches every page of them, so the first
    `snapshot()` only copies. The thread runs at the lowest CPU priority (nice 19, Linux),
    so it uses idle CPU only: at normal priority it competed with the loop's own threads
    and, on a loop that kept the cores busy, cost the loop more time than the first save
    gained (BENCHMARKS.md). A snapshot never waits for it to finish (a low-priority thread
    may be starved for long on a busy machine), nor allocates a second set beside it: if it
    comes while the thread is still working, it takes over. The thread stops at its next
    chunk (8 MiB of pages; pinned memory is not touched, so there it finishes the buffer it
    is allocating), and the snapshot keeps every buffer already made and allocates only the
    rest, as it would without preparation. Memory stays at one set of buffers: buffers whose
    path is no longer in the state, or whose shape or dtype changed, are dropped (and
    reallocated) by the next `prepare` or `snapshot`.
    """

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._buffers: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._wanted: list[_BufferSpec] | None = None
        self._worker: threading.Thread | None = None
        self._stop = threading.Event()
        self.bytes = 0
        self.allocated_bytes = 0  # bytes the last snapshot() had to allocate itself
        self.prepared_bytes = 0  # bytes the last preparation allocated in the background
        self.prepare_s: float | None = None  # how long it took; None until one finished whole

    @property
    def held_bytes(self) -> int:
        """Host memory held by the buffers now (what the next snapshot would reuse)."""
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def prepare(self, obj: Any) -> bool:
        """Allocate and pre-fault, in a background thread, the buffers a snapshot of `obj`
        needs; returns False when they are all there already. Reads only tensor shapes and
        dtypes of `obj` (on the calling thread); never copies data."""
        wanted: list[_BufferSpec] = []
        _collect_specs(obj, "", wanted, _loaded_dtensor_type())
        with self._lock:
            all_fit = len(self._buffers) == len(wanted) and all(
                _fits(self._buffers.get(s.path), s) for s in wanted
            )
            if self._worker is None and all_fit:
                return False
            self._wanted = wanted
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._prepare_loop,
                    name="trainguard-snapshot-prepare",
                    daemon=True,  # pre-faulting must never keep a finished job alive
                )
                _PREPARING.add(self)
                self._worker.start()
        return True

    def close(self) -> None:
        """Stop the preparation in progress (keeping what it made) and wait for its thread.
        A thread left inside torch while the interpreter exits aborts the process
        ("terminate called without an active exception"): close() and exit both stop it."""
        self._take_over()

    def ready(self) -> bool:
        """True when no preparation is in progress."""
        with self._lock:
            return self._worker is None

    def wait_ready(self, timeout_s: float | None = None) -> bool:
        """Wait (without taking over) for the preparation in progress; True when none is left."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.join(timeout_s)
        return self.ready()

    def snapshot(self, obj: Any) -> Any:
        """A copy of `obj` in the pool's host buffers. A DTensor (FSDP2, tensor parallel)
        becomes a DTensor of the same global shape and placements whose local shard is the
        host copy of this rank's shard: what DCP writes, and all this rank holds."""
        self._take_over()
        self.bytes = 0
        self.allocated_bytes = 0
        any_cuda = [False]
        used: set[str] = set()
        dtensor = _loaded_dtensor_type()
        with self._lock:
            out = self._copy(obj, "", any_cuda, used, dtensor)
            for stale in set(self._buffers) - used:
                del self._buffers[stale]
        if any_cuda[0]:
            torch.cuda.synchronize()
        return out

    def _take_over(self) -> None:
        """Stop the preparation in progress at its next chunk (keeping what it made)."""
        with self._lock:
            worker = self._worker
        if worker is None:
            return
        self._stop.set()
        worker.join()
        self._stop.clear()

    def _prepare_loop(self) -> None:
        _lower_thread_priority()
        while True:
            with self._lock:
                wanted, self._wanted = self._wanted, None
                if wanted is None or self._stop.is_set():
                    self._worker = None
                    return
            t0 = self.clock.monotonic()
            try:
                self.prepared_bytes = self._allocate(wanted)
            except Exception as e:
                # Not fatal: a snapshot allocates whatever is missing itself (and reports
                # the error there if it persists).
                log.warning(
                    "event=snapshot_prepare_failed reason=%s",
                    f"{type(e).__name__}:_{e}".replace(" ", "_"),
                )
                continue
            if self._stop.is_set():
                log.info("event=snapshot_prepare_interrupted reason=snapshot_taken")
                continue
            self.prepare_s = self.clock.monotonic() - t0
            log.info(
                "event=snapshot_prepared allocated_bytes=%d duration_s=%.3f",
                self.prepared_bytes,
                self.prepare_s,
            )

    def _allocate(self, wanted: list[_BufferSpec]) -> int:
        names = {s.path for s in wanted}
        with self._lock:
            for stale in set(self._buffers) - names:
                del self._buffers[stale]
        total = 0
        for spec in wanted:
            if self._stop.is_set():
                break
            with self._lock:
                if _fits(self._buffers.get(spec.path), spec):
                    continue
                # Drop a misfit first, so old and new never coexist here (a save in flight
                # keeps its own reference until it is done).
                self._buffers.pop(spec.path, None)
            buf = torch.empty(spec.shape, dtype=spec.dtype, device="cpu", pin_memory=spec.pinned)
            if not spec.pinned:  # pinned memory is locked in, so already resident
                _touch_pages(buf, self._stop)
            with self._lock:
                # Kept even when stopped halfway: valid memory, the snapshot faults the rest.
                self._buffers[spec.path] = buf
            total += buf.numel() * buf.element_size()
        return total

    def _copy(
        self, o: Any, path: str, any_cuda: list[bool], used: set[str], dtensor: type[DTensor] | None
    ) -> Any:
        if dtensor is not None and isinstance(o, dtensor):
            local = self._copy(_local_shard(o), path, any_cuda, used, None)
            # The private constructor, as torch's own checkpoint staging does: `from_local`
            # would move the host copy back to the mesh's device.
            return dtensor(local, o._spec, requires_grad=False)
        if isinstance(o, torch.Tensor):
            src = o.detach()
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
                self._buffers[path] = buf
                self.allocated_bytes += buf.numel() * buf.element_size()
            buf.copy_(src, non_blocking=src.is_cuda)
            used.add(path)
            any_cuda[0] = any_cuda[0] or src.is_cuda
            self.bytes += buf.numel() * buf.element_size()
            return buf
        if isinstance(o, Mapping):
            return {k: self._copy(v, f"{path}/{k}", any_cuda, used, dtensor) for k, v in o.items()}
        if isinstance(o, list | tuple):
            items = [self._copy(v, f"{path}/{i}", any_cuda, used, dtensor) for i, v in enumerate(o)]
            return items if isinstance(o, list) else tuple(items)
        return o


@dataclass(frozen=True)
class _BufferSpec:
    path: str
    shape: torch.Size
    dtype: torch.dtype
    pinned: bool


def _collect_specs(
    o: Any, path: str, out: list[_BufferSpec], dtensor: type[DTensor] | None
) -> None:
    """The buffers `SnapshotPool._copy` would use for `o`: same walk, same paths."""
    if dtensor is not None and isinstance(o, dtensor):
        o = _local_shard(o)
    if isinstance(o, torch.Tensor):
        out.append(_BufferSpec(path, o.shape, o.dtype, o.is_cuda))
    elif isinstance(o, Mapping):
        for k, v in o.items():
            _collect_specs(v, f"{path}/{k}", out, dtensor)
    elif isinstance(o, list | tuple):
        for i, v in enumerate(o):
            _collect_specs(v, f"{path}/{i}", out, dtensor)


def _loaded_dtensor_type() -> type[DTensor] | None:
    """`DTensor`, when its module is loaded; else None (no DTensor can exist then, and a
    single-process or DDP run never pays for importing it)."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    from torch.distributed.tensor import DTensor as loaded  # noqa: PLC0415 (loaded already)

    return loaded


def _local_shard(t: DTensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no communication; the tensor itself, no copy)."""
    return t.to_local()


_PREPARING: weakref.WeakSet[SnapshotPool] = weakref.WeakSet()


@atexit.register
def _stop_preparations() -> None:
    # atexit runs before the interpreter tears down torch; a loop that never called close()
    # must still exit cleanly
    for pool in list(_PREPARING):
        pool.close()


def _fits(buf: torch.Tensor | None, spec: _BufferSpec) -> bool:
    return buf is not None and buf.shape == spec.shape and buf.dtype == spec.dtype


def _touch_pages(buf: torch.Tensor, stop: threading.Event) -> None:
    """Write one byte in every page, so the kernel maps (and zeroes) them now, not during
    the copy of the first snapshot (whose copy overwrites them anyway). In chunks, so that a
    snapshot waiting for `stop` to take effect waits for one chunk at most."""
    if buf.numel() == 0:
        return
    raw = buf.view(-1).view(torch.uint8)
    for start in range(0, raw.numel(), _TOUCH_CHUNK_BYTES):
        if stop.is_set():
            return
        raw[start : start + _TOUCH_CHUNK_BYTES : _PAGE_BYTES].zero_()
    raw[-1:].zero_()


def _lower_thread_priority() -> None:
    """Nice 19 for the calling thread only: on Linux the nice value is per thread (elsewhere
    the same call would renice the whole process, so it is Linux only). Best effort."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
