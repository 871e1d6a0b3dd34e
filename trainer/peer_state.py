"""State from a peer: a re-formed world agrees who holds the newest state and copies it over.

Every rank of a re-formed world calls `agree_source` with the step its state is complete at
(None: a replacement, no state). The newest step wins; its lowest holding rank is the source.
`transfer_state` then broadcasts the source's model, optimizer, scheduler, scaler, sampler
and extra state over the new process group, no disk involved: the structure (every value
that is not a tensor) as one `torch.save` blob loaded back with `weights_only=True`, the
tensors one broadcast each. Only data-parallel replicas can give their state this way: a
rank whose state holds DTensor shards (FSDP2) offers none (`replica_state_ok`) and the
world falls back to the checkpoint. Per-rank state (RNG) is not copied: the receiver takes
its own from a checkpoint of exactly that step when one exists, or derives it.
"""

from __future__ import annotations

import io
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.trainer.checkpoint import load_rank_file, rank_file_name
from trainguard.trainer.checkpoint_manager import TrainState
from trainguard.trainer.manifest import CheckpointInvalid, read_manifest, step_dir_name
from trainguard.trainer.state import (
    check_storable,
    derive_rng,
    fill_tensors,
    restore_rng,
    split_tensors,
)
from trainguard.trainer.sync import DistCoordinator

__all__ = ["NO_STATE", "Source", "agree_source", "replica_state_ok", "transfer_state"]

log = logging.getLogger("trainguard.trainer")

NO_STATE = -(1 << 62)  # the step a rank without state offers (below any real step)


@dataclass(frozen=True)
class Source:
    """The agreed state of the re-formed world: complete at `step`, held by rank `rank`
    (-1: no rank holds any; the world loads the checkpoint)."""

    step: int
    rank: int

    @property
    def found(self) -> bool:
        return self.rank >= 0


def replica_state_ok(state: TrainState) -> bool:
    """Whether this rank's model and optimizer are a whole replica (plain tensors): sharded
    state (DTensor, FSDP2) is only a part, which no peer can be given whole."""
    # Deferred heavy dependency: torch.distributed.tensor is only needed for this check.
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    tensors: list[torch.Tensor] = list(state.model.parameters())
    if state.optimizer is not None:
        for per_param in state.optimizer.state.values():
            tensors.extend(v for v in per_param.values() if isinstance(v, torch.Tensor))
    return not any(isinstance(t, DTensor) for t in tensors)


def agree_source(coord: DistCoordinator, *, step: int | None) -> Source:
    """Every rank: the newest complete step any rank holds, and its lowest holder."""
    offered = NO_STATE if step is None else step
    t = torch.tensor([offered], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=coord.sync_group)
    newest = int(t.item())
    if newest == NO_STATE:
        return Source(step=-1, rank=-1)
    holder = torch.tensor(
        [coord.rank if offered == newest else coord.world_size], dtype=torch.int64
    )
    dist.all_reduce(holder, op=dist.ReduceOp.MIN, group=coord.sync_group)
    return Source(step=newest, rank=int(holder.item()))


def transfer_state(
    state: TrainState,
    *,
    coord: DistCoordinator,
    source: Source,
    load: bool,
    ckpt_dir: Path,
) -> int:
    """Broadcast the source's state to every rank; a rank with `load` loads it (a rank that
    already holds the source's step passes False and only takes part). Returns the bytes
    moved."""
    is_source = coord.rank == source.rank
    tensors: dict[str, torch.Tensor] = {}
    blob = b""
    if is_source:
        shared = _capture_shared(state)
        tensors, skeleton = split_tensors(shared)
        check_storable(skeleton)
        meta = [
            (name, str(t.dtype).removeprefix("torch."), list(t.shape))
            for name, t in tensors.items()
        ]
        buf = io.BytesIO()
        torch.save({"skeleton": skeleton, "meta": meta}, buf)
        blob = buf.getvalue()
    header = _broadcast_bytes(blob, coord=coord, src=source.rank)
    head = torch.load(io.BytesIO(header), weights_only=True)
    moved = len(header)
    received: dict[str, torch.Tensor] = {}
    for name, dtype, shape in head["meta"]:
        if is_source:
            t = tensors[name].detach()
            t = t if t.is_contiguous() else t.contiguous()
        else:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=_device(state))
        group = None if t.is_cuda else coord.sync_group  # CUDA on the training group (NCCL)
        dist.broadcast(t, src=source.rank, group=group)
        received[name] = t
        moved += t.numel() * t.element_size()
    if load and not is_source:
        _load_shared(state, fill_tensors(head["skeleton"], received))
        _take_rng(
            received[_RNG_REF],
            ckpt_dir=ckpt_dir,
            step=source.step,
            rank=coord.rank,
            world_size=coord.world_size,
        )
    return moved


_RNG_REF = "/source_rng"


def _device(state: TrainState) -> torch.device:
    for p in state.model.parameters():
        return p.device
    return torch.device("cpu")


def _capture_shared(state: TrainState) -> dict[str, Any]:
    # Deferred heavy dependency: torch.distributed.checkpoint's state-dict helpers (~0.6 s of
    # imports) give wrapper-independent names (a DDP-wrapped and a bare module agree).
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        get_model_state_dict,
        get_state_dict,
    )

    if state.optimizer is None:
        msd, osd = dict(get_model_state_dict(state.model)), {}
    else:
        m, o = get_state_dict(state.model, state.optimizer)
        msd, osd = dict(m), dict(o)
    return {
        "model": msd,
        "optim": osd,
        "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
        "scaler": state.scaler.state_dict() if state.scaler is not None else None,
        "sampler": state.sampler.state_dict() if state.sampler is not None else None,
        "extra": {name: obj.state_dict() for name, obj in state.extra.items()},
        "source_rng": torch.get_rng_state(),
    }


def _load_shared(state: TrainState, full: dict[str, Any]) -> None:
    # Deferred heavy dependency, as in _capture_shared.
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        set_model_state_dict,
        set_state_dict,
    )

    if state.optimizer is None:
        set_model_state_dict(state.model, full["model"])
    else:
        set_state_dict(
            state.model,
            state.optimizer,
            model_state_dict=full["model"],
            optim_state_dict=full["optim"],
        )
    if state.scheduler is not None and full["scheduler"] is not None:
        state.scheduler.load_state_dict(full["scheduler"])
    if state.scaler is not None and full["scaler"] is not None:
        state.scaler.load_state_dict(full["scaler"])
    if state.sampler is not None and full["sampler"] is not None:
        state.sampler.load_state_dict(full["sampler"])
    for name, obj in state.extra.items():
        obj.load_state_dict(full["extra"][name])


def _take_rng(
    source_rng: torch.Tensor, *, ckpt_dir: Path, step: int, rank: int, world_size: int
) -> None:
    """This rank's RNG: from its file of the checkpoint of exactly `step` (same world size),
    else derived from the source's generator, the step and this rank's place."""
    path = ckpt_dir / step_dir_name(step)
    try:
        manifest = read_manifest(path)
        if manifest.world_size == world_size:
            restore_rng(load_rank_file(path / rank_file_name(rank))["rng"])
            log.info("event=rng_from_checkpoint rank=%d step=%d", rank, step)
            return
    except (OSError, ValueError, KeyError, CheckpointInvalid) as e:
        log.info("event=rng_derived rank=%d step=%d reason=%s", rank, step, type(e).__name__)
    seed = derive_rng({"torch": source_rng}, step=step, rank=rank, world_size=world_size)
    log.info("event=rng_derived rank=%d step=%d seed=%d", rank, step, seed)


def _broadcast_bytes(raw: bytes, *, coord: DistCoordinator, src: int) -> bytes:
    n = torch.tensor([len(raw)], dtype=torch.int64)
    dist.broadcast(n, src=src, group=coord.sync_group)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    if coord.rank == src and raw:
        buf[:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=coord.sync_group)
    return buf.numpy().tobytes()
