"""A rank's delta file: written against its base checkpoint's tensor file, and read back.

A delta checkpoint directory holds `delta_<rank>.bin` (the encoded blocks, trainer/delta.py)
and the usual rank file, whose `delta_index` says, per tensor, its dtype, shape and blocks
and whether it is encoded against the base's tensor of the same name. The base is a full
checkpoint in the "tensors" format (one raw tensor file per rank, trainer/checkpoint.py); its
tensor file is read and hashed against the base's manifest both when a delta is written and
when one is loaded, so a delta is never written against, nor decoded from, a corrupt base.
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainguard.trainer.delta import (
    DELTA_CODEC,
    DeltaStats,
    base_matches,
    decode_tensor,
    encode_tensor,
    write_blocks_fd,
)
from trainguard.trainer.manifest import (
    CheckpointInvalid,
    Manifest,
    read_manifest,
)

__all__ = ["BaseTensors", "delta_file_name", "read_base", "read_delta_file", "write_delta_file"]


def delta_file_name(rank: int) -> str:
    return f"delta_{rank:05d}.bin"


@dataclass(frozen=True)
class BaseTensors:
    """A base checkpoint's tensor file, read and verified: its bytes and its index."""

    step: int
    manifest: Manifest
    data: np.ndarray  # uint8, the whole tensor file
    index: dict[str, Any]


def read_base(directory: Path, *, step: int, rank: int) -> BaseTensors:
    """Read the base's tensor file for `rank`, hashing it against the base's manifest, and its
    index from the base's rank file; CheckpointInvalid naming the file otherwise."""
    # Deferred: checkpoint.py imports this module (the writer writes deltas).
    from trainguard.trainer.checkpoint import (  # noqa: PLC0415
        rank_file_name,
        tensor_file_name,
    )

    manifest = read_manifest(directory)
    if manifest.step != step or manifest.format != "tensors":
        raise CheckpointInvalid(
            str(directory), f"not a full checkpoint of step {step} (format {manifest.format!r})"
        )
    tname = tensor_file_name(rank)
    meta = manifest.files.get(tname)
    if meta is None:
        raise CheckpointInvalid(str(directory / tname), "not listed in the base's manifest")
    path = directory / tname
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CheckpointInvalid(str(path), f"unreadable: {e.strerror or e}") from None
    if len(raw) != meta["size"] or hashlib.sha256(raw).hexdigest() != meta["sha256"]:
        raise CheckpointInvalid(str(path), "base tensor file does not match its manifest")
    rname = rank_file_name(rank)
    rmeta = manifest.files.get(rname)
    rpath = directory / rname
    try:
        rraw = rpath.read_bytes()
    except OSError as e:
        raise CheckpointInvalid(str(rpath), f"unreadable: {e.strerror or e}") from None
    if rmeta is None or hashlib.sha256(rraw).hexdigest() != rmeta["sha256"]:
        raise CheckpointInvalid(str(rpath), "base rank file does not match its manifest")
    # From the bytes just hashed, not the file again: what is decoded is what was verified.
    rank_state = torch.load(io.BytesIO(rraw), map_location="cpu", weights_only=True)
    if not isinstance(rank_state, dict) or not isinstance(rank_state.get("tensor_index"), dict):
        raise CheckpointInvalid(str(rpath), "base rank file has no tensor index")
    index = rank_state["tensor_index"]
    return BaseTensors(
        step=step, manifest=manifest, data=np.frombuffer(raw, dtype=np.uint8), index=index
    )


def _byte_array(t: torch.Tensor) -> np.ndarray:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous() or flat.device.type != "cpu":
        flat = flat.contiguous().cpu()
    return flat.view(torch.uint8).numpy()


def _base_slice(base: BaseTensors, meta: dict[str, Any] | None) -> np.ndarray | None:
    if meta is None:
        return None
    offset, nbytes = int(meta["offset"]), int(meta["nbytes"])
    if offset < 0 or offset + nbytes > base.data.size:
        raise CheckpointInvalid(f"step {base.step}", "base tensor lies outside its file")
    return base.data[offset : offset + nbytes]


def write_delta_file(
    path: Path, tensors: dict[str, torch.Tensor], *, base: BaseTensors
) -> tuple[dict[str, Any], int, str, DeltaStats]:
    """Encode `tensors` against `base` into `path` (fsynced); returns (delta index, size,
    sha256, stats)."""
    digest = hashlib.sha256()
    stats = DeltaStats()
    index: dict[str, Any] = {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        append = write_blocks_fd(fd)

        def emit(data: bytes | memoryview) -> int:
            digest.update(data)
            stats.encoded_bytes += len(data)
            return append(data)

        for name, t in tensors.items():
            view = _byte_array(t)
            meta = {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "nbytes": int(view.size),
                "itemsize": t.element_size(),
            }
            base_meta = base.index.get(name)
            against = base_matches(meta, base_meta)
            meta["base"] = against
            meta["blocks"] = encode_tensor(
                view,
                _base_slice(base, base_meta) if against else None,
                itemsize=t.element_size(),
                emit=emit,
                stats=stats,
            )
            index[name] = meta
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"codec": DELTA_CODEC, "tensors": index}, stats.encoded_bytes, digest.hexdigest(), stats


def read_delta_file(
    path: Path, delta_index: dict[str, Any], *, base: BaseTensors
) -> dict[str, torch.Tensor]:
    """The tensors of a delta file, decoded against `base` (bitwise the tensors saved)."""
    if delta_index.get("codec") != DELTA_CODEC:
        raise CheckpointInvalid(str(path), f"unknown delta codec {delta_index.get('codec')!r}")
    try:
        data = memoryview(path.read_bytes())
    except OSError as e:
        raise CheckpointInvalid(str(path), f"unreadable: {e.strerror or e}") from None
    out: dict[str, torch.Tensor] = {}
    for name, meta in delta_index["tensors"].items():
        dtype = getattr(torch, str(meta["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointInvalid(str(path), f"tensor {name!r}: unknown dtype {meta['dtype']!r}")
        t = torch.empty([int(d) for d in meta["shape"]], dtype=dtype)
        base_meta = base.index.get(name) if meta["base"] else None
        if meta["base"] and not base_matches(meta, base_meta):
            raise CheckpointInvalid(str(path), f"tensor {name!r}: the base does not hold it")
        try:
            decode_tensor(
                meta["blocks"],
                data=data,
                base=_base_slice(base, base_meta),
                nbytes=int(meta["nbytes"]),
                itemsize=int(meta["itemsize"]),
                out=_byte_array(t) if t.numel() else np.empty(0, dtype=np.uint8),
            )
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointInvalid(str(path), f"tensor {name!r}: {e}") from None
        out[name] = t
    return out
