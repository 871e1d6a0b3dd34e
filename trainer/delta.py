"""The delta encoding of an incremental checkpoint: a lossless, per-tensor difference from a base.

Each tensor's raw bytes are XORed with the same tensor's bytes in the base checkpoint (a
tensor the base lacks, or holds with another dtype or size, is stored whole), the result is
split into byte planes (every element's byte 0, then byte 1, ...: the sign, exponent and high
mantissa bytes of a weight that moved a little are zero after the XOR, the low mantissa bytes
are noise), and each plane of each 4 MiB chunk is compressed with zlib at level 1, or stored
raw when that does not make it smaller (a plane whose first 64 KiB do not shrink by 3 % is
stored raw untried: the noise planes cost no compression time). Decoding reverses it bit for
bit. Measured against zlib alone, XOR alone and a higher zlib level: bench/checkpoint_delta.py,
BENCHMARKS.md.

No torch here: tensors arrive and leave as byte views (numpy), so the encoding is testable on
its own and the writer thread and the loader share it.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "DELTA_CODEC",
    "DeltaStats",
    "base_matches",
    "decode_tensor",
    "encode_tensor",
    "write_blocks_fd",
]

# Names the encoding in the delta's index, so a later encoding can be told apart.
DELTA_CODEC = "xor-planes-zlib1"
_CHUNK_BYTES = 4 << 20
_ZLIB_LEVEL = 1
_RAW, _ZLIB = "r", "z"
_PROBE_BYTES = 64 << 10
_PROBE_MAX_RATIO = 0.97


@dataclass
class DeltaStats:
    """What one delta encoding wrote, for the log line and the bench."""

    raw_bytes: int = 0  # the tensors' own size (what a full checkpoint writes)
    encoded_bytes: int = 0  # what the delta file holds
    tensors_whole: int = 0  # tensors stored whole (no counterpart in the base)


def _planes(chunk: np.ndarray, itemsize: int) -> list[np.ndarray]:
    if itemsize <= 1 or chunk.size % itemsize:
        return [chunk]
    grid = chunk.reshape(-1, itemsize)
    return [np.ascontiguousarray(grid[:, i]) for i in range(itemsize)]


def _worth_compressing(plane: np.ndarray) -> bool:
    if plane.size <= 2 * _PROBE_BYTES:
        return True
    probe = zlib.compress(plane[:_PROBE_BYTES].data, _ZLIB_LEVEL)
    return len(probe) < _PROBE_MAX_RATIO * _PROBE_BYTES


def encode_tensor(
    new: np.ndarray,
    base: np.ndarray | None,
    *,
    itemsize: int,
    emit: Callable[[bytes | memoryview], int],
    stats: DeltaStats,
) -> list[list[Any]]:
    """Encode one tensor's bytes (`new`, uint8) against `base` (uint8 of the same length, or
    None: stored whole). `emit(data)` writes a block and returns its offset in the delta file.
    Returns the blocks, in order: [offset, length, "z" | "r"] per plane of every chunk."""
    if base is not None and base.size != new.size:
        raise ValueError(f"base has {base.size} bytes, the tensor {new.size}")
    blocks: list[list[Any]] = []
    step = _CHUNK_BYTES - _CHUNK_BYTES % max(itemsize, 1)
    for start in range(0, new.size, step):
        chunk = new[start : start + step]
        if base is not None:
            chunk = np.bitwise_xor(chunk, base[start : start + step])
        for plane in _planes(chunk, itemsize):
            raw = plane.data
            packed = zlib.compress(raw, _ZLIB_LEVEL) if _worth_compressing(plane) else b""
            if packed and len(packed) < plane.size:
                blocks.append([emit(packed), len(packed), _ZLIB])
            else:
                blocks.append([emit(raw), plane.size, _RAW])
    stats.raw_bytes += new.size
    if base is None:
        stats.tensors_whole += 1
    return blocks


def decode_tensor(
    blocks: list[list[Any]],
    *,
    data: memoryview,
    base: np.ndarray | None,
    nbytes: int,
    itemsize: int,
    out: np.ndarray,
) -> None:
    """Reverse `encode_tensor` into `out` (uint8, `nbytes` long); ValueError on any block
    that does not decode to the size its position needs (a corrupt or foreign delta)."""
    if out.size != nbytes or (base is not None and base.size != nbytes):
        raise ValueError("delta: sizes of the tensor, its base and the output differ")
    step = _CHUNK_BYTES - _CHUNK_BYTES % max(itemsize, 1)
    it = iter(blocks)
    for start in range(0, nbytes, step):
        size = min(step, nbytes - start)
        n_planes = itemsize if itemsize > 1 and size % itemsize == 0 else 1
        planes = []
        for _ in range(n_planes):
            block = next(it, None)
            if block is None:
                raise ValueError("delta: fewer blocks than the tensor needs")
            offset, length, codec = int(block[0]), int(block[1]), block[2]
            if offset < 0 or offset + length > len(data):
                raise ValueError("delta: a block lies outside the file")
            raw = data[offset : offset + length]
            plane = zlib.decompress(raw) if codec == _ZLIB else bytes(raw)
            if codec not in (_ZLIB, _RAW) or len(plane) != size // n_planes:
                raise ValueError("delta: a block decodes to the wrong size")
            planes.append(np.frombuffer(plane, dtype=np.uint8))
        chunk = out[start : start + size]
        if n_planes == 1:
            chunk[:] = planes[0]
        else:
            chunk.reshape(-1, n_planes)[:] = np.stack(planes, axis=1)
        if base is not None:
            np.bitwise_xor(chunk, base[start : start + size], out=chunk)
    if next(it, None) is not None:
        raise ValueError("delta: more blocks than the tensor needs")


def base_matches(meta: Mapping[str, Any], base_meta: Mapping[str, Any] | None) -> bool:
    """Whether a tensor is encoded against the base's tensor of the same name."""
    return (
        base_meta is not None
        and base_meta.get("dtype") == meta.get("dtype")
        and int(base_meta.get("nbytes", -1)) == int(meta["nbytes"])
    )


def write_blocks_fd(fd: int) -> Callable[[bytes | memoryview], int]:
    """An `emit` for `encode_tensor` that appends to an open file descriptor."""
    offset = 0

    def emit(data: bytes | memoryview) -> int:
        nonlocal offset
        start = offset
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        offset += len(data)
        return start

    return emit
