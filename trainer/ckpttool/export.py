"""Model weights of a verified checkpoint, consolidated from its shards, as a safetensors file.

The formats the writer produces (trainer/checkpoint.py): "tensors" (one raw tensor file per
rank with its index in the rank file), "delta" (decoded against its base, the sibling directory
its manifest names: trainer/delta_files.py) and "dcp" (torch.distributed.checkpoint shards,
FSDP2 and DTensor state included: every chunk is placed at its offsets in the full tensor).
Nothing here unpickles arbitrary objects: rank files and DCP chunks load with
`weights_only=True`, and DCP's `.metadata` pickle through an unpickler that admits only DCP's
own metadata classes.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainguard.trainer.checkpoint import (
    load_rank_file,
    rank_file_name,
    read_tensor_file,
    tensor_file_name,
)
from trainguard.trainer.delta_files import delta_file_name, read_base, read_delta_file
from trainguard.trainer.manifest import CheckpointInvalid, Manifest, delta_link, step_dir_name
from trainguard.trainer.state import fill_tensors, tensor_refs

__all__ = ["ExportError", "model_weights", "write_safetensors"]

_DCP_METADATA = ".metadata"
# What DCP's metadata pickle may name: its dataclasses, torch.Size and the dtype/layout/memory
# format singletons (checked to be those, by type, below).
_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
}
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


class ExportError(Exception):
    """The checkpoint cannot be exported; the text names the file and the field."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: io.BufferedIOBase, *, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, torch.dtype | torch.layout | torch.memory_format):
                return obj
        raise ExportError(f"{self.where}: refers to {module}.{name}, not DCP metadata")


def _dcp_metadata(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return _MetadataUnpickler(f, where=str(path)).load()
    except FileNotFoundError:
        raise ExportError(f"{path}: missing (a DCP checkpoint needs its metadata)") from None
    except ExportError:
        raise
    except Exception as e:
        raise ExportError(f"{path}: unreadable DCP metadata: {e}") from None


def _refs(skeleton: Any) -> dict[str, Any]:
    """The model part of a rank file's skeleton: {parameter name: tensor reference}."""
    if not isinstance(skeleton, Mapping) or not isinstance(skeleton.get("model"), Mapping):
        raise ExportError("rank file: skeleton.model missing: not a trainguard model state")
    return dict(skeleton["model"])


def _tensors_only(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def model_weights(directory: Path, manifest: Manifest) -> dict[str, torch.Tensor]:
    """{parameter name: full tensor} of a verified checkpoint directory."""
    rank0 = directory / rank_file_name(0)
    try:
        rs = load_rank_file(rank0)
    except Exception as e:
        raise ExportError(f"{rank0}: unreadable rank file: {e}") from None
    refs = _refs(rs.get("skeleton"))
    if manifest.format == "tensors":
        index = rs.get("tensor_index")
        if not isinstance(index, dict):
            raise ExportError(f"{rank0}: tensor_index missing")
        try:
            flat = read_tensor_file(directory / tensor_file_name(0), index)
            return _tensors_only(fill_tensors(refs, flat))
        except (KeyError, ValueError) as e:
            raise ExportError(f"{directory / tensor_file_name(0)}: {e}") from None
    if manifest.format == "dcp":
        return _tensors_only(fill_tensors(refs, _dcp_tensors(directory / "dcp", refs)))
    link = delta_link(manifest, where=str(directory))
    if link is not None:
        index = rs.get("delta_index")
        if not isinstance(index, dict):
            raise ExportError(f"{rank0}: delta_index missing")
        try:
            base_dir = directory.parent / step_dir_name(link.base_step)
            base = read_base(base_dir, step=link.base_step, rank=0)
            flat = read_delta_file(directory / delta_file_name(0), index, base=base)
            return _tensors_only(fill_tensors(refs, flat))
        except (CheckpointInvalid, KeyError, ValueError) as e:
            raise ExportError(f"{directory / delta_file_name(0)}: {e}") from None
    raise ExportError(f"{directory}/manifest.json: format {manifest.format!r} is not exportable")


def _dcp_tensors(dcp_dir: Path, refs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """Full tensors of the references `refs` names, each assembled from its DCP chunks."""
    meta_path = dcp_dir / _DCP_METADATA
    meta = _dcp_metadata(meta_path)
    sd_meta = getattr(meta, "state_dict_metadata", None)
    storage = getattr(meta, "storage_data", None)
    if not isinstance(sd_meta, dict) or not isinstance(storage, dict):
        raise ExportError(f"{meta_path}: state_dict_metadata or storage_data missing")
    by_chunk = {(idx.fqn, tuple(idx.offset or ())): info for idx, info in storage.items()}
    out: dict[str, torch.Tensor] = {}
    for fqn in sorted(set(tensor_refs(refs))):
        tmeta = sd_meta.get(fqn)
        if tmeta is None or not hasattr(tmeta, "chunks"):
            raise ExportError(f"{meta_path}: no tensor {fqn!r}")
        full = torch.empty(tuple(tmeta.size), dtype=tmeta.properties.dtype)
        covered = 0
        for chunk in tmeta.chunks:
            info = by_chunk.get((fqn, tuple(chunk.offsets)))
            if info is None:
                raise ExportError(
                    f"{meta_path}: tensor {fqn!r}: chunk {list(chunk.offsets)} unlisted"
                )
            part = _read_chunk(dcp_dir, info, fqn=fqn)
            if tuple(part.shape) != tuple(chunk.sizes):
                raise ExportError(
                    f"{dcp_dir / info.relative_path}: tensor {fqn!r}: chunk shape "
                    f"{list(part.shape)} != {list(chunk.sizes)}"
                )
            view = full
            for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                view = view.narrow(dim, off, size)
            view.copy_(part)
            covered += part.numel()
        if covered != full.numel():
            raise ExportError(
                f"{meta_path}: tensor {fqn!r}: chunks cover {covered} of {full.numel()} elements"
            )
        out[fqn] = full
    return out


def _read_chunk(dcp_dir: Path, info: Any, *, fqn: str) -> torch.Tensor:
    path = dcp_dir / str(info.relative_path)
    if getattr(info, "transform_descriptors", None):
        raise ExportError(f"{path}: tensor {fqn!r}: transformed (compressed) chunks unsupported")
    with open(path, "rb") as f:
        f.seek(int(info.offset))
        raw = f.read(int(info.length))
    if len(raw) != int(info.length):
        raise ExportError(f"{path}: tensor {fqn!r}: file shorter than its metadata")
    try:
        t = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ExportError(f"{path}: tensor {fqn!r}: unreadable chunk: {e}") from None
    if not isinstance(t, torch.Tensor):
        raise ExportError(f"{path}: tensor {fqn!r}: chunk is not a tensor")
    return t


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str]
) -> int:
    """Write `tensors` as a safetensors file (written aside, then renamed); its size."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        code = _SAFETENSORS_DTYPES.get(t.dtype)
        if code is None:
            raise ExportError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code")
        blob = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return 8 + len(raw) + offset
