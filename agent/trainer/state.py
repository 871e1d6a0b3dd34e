"""Training state as tensors and primitives: RNG capture/restore, tensor split, host snapshots.

Everything a checkpoint stores passes through here, so that loading can always use
`torch.load(weights_only=True)`: RNG states become int64/uint8 tensors and plain numbers,
never pickled Python objects.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "SnapshotPool",
    "capture_rng",
    "check_storable",
    "fill_tensors",
    "restore_rng",
    "split_tensors",
]

_TENSOR_REF = "__trainguard_tensor__"
_PRIMITIVES = (int, float, bool, str, bytes, type(None))


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
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.bytes = 0

    def snapshot(self, obj: Any) -> Any:
        self.bytes = 0
        any_cuda = [False]
        out = self._copy(obj, "", any_cuda)
        if any_cuda[0]:
            torch.cuda.synchronize()
        return out

    def _copy(self, o: Any, path: str, any_cuda: list[bool]) -> Any:
        if isinstance(o, torch.Tensor):
            src = o.detach()
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)
                self._buffers[path] = buf
            buf.copy_(src, non_blocking=src.is_cuda)
            any_cuda[0] = any_cuda[0] or src.is_cuda
            self.bytes += buf.numel() * buf.element_size()
            return buf
        if isinstance(o, Mapping):
            return {k: self._copy(v, f"{path}/{k}", any_cuda) for k, v in o.items()}
        if isinstance(o, list | tuple):
            items = [self._copy(v, f"{path}/{i}", any_cuda) for i, v in enumerate(o)]
            return items if isinstance(o, list) else tuple(items)
        return o
