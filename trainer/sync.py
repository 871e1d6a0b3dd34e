"""Agreement between ranks: every rank acts on a request, a SIGTERM or a NaN at the same step.

An agreement is one small all_reduce(MAX) on a dedicated gloo group: [lowest rank holding a
pending request (encoded), sigterm seen, non-finite seen, proposed interval (the largest
wins), minus the longest interval this rank allows (the smallest wins), commit refused as a
stale attempt]. If any rank holds a
request, the lowest such rank broadcasts its (action, request_id, value: a `set_interval`'s
new checkpoint interval) and everyone acts on it.
`start()` posts the all_reduce without waiting and `finish()` collects it later (the caller
collects at the same step on every rank), so the collective's latency overlaps the training
step; `agree()` is both at once. Every rank joins the same collectives at the same steps
whatever it received, so a request that reached only some ranks never leaves anyone waiting.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

log = logging.getLogger("trainguard.trainer")

__all__ = [
    "ACTION_CODES",
    "REQUEST_ID_MAX_BYTES",
    "Agreement",
    "Coordinator",
    "DistCoordinator",
    "LocalCoordinator",
    "LocalView",
]

REQUEST_ID_MAX_BYTES = 256
_NO_CAP = 1 << 40
ACTION_CODES = {"checkpoint": 1, "stop": 2, "checkpoint_stop": 3, "set_interval": 4}
_VALUE_BYTES = 8  # a request's value, int64 little-endian, after the action code
_ACTIONS = {v: k for k, v in ACTION_CODES.items()}


@dataclass(frozen=True)
class LocalView:
    """What this rank knows at the sync step."""

    request: tuple[str, str] | None  # (action, request_id): the oldest pending request
    sigterm: bool
    nonfinite: bool
    interval: int = 1  # steps until the next sync this rank proposes (the max wins)
    max_interval: int | None = None  # the most steps this rank allows (the min wins); None: any
    stale: bool = False  # a commit of this rank was refused: a newer attempt owns the directory
    value: int = 0  # the request's value (set_interval: the new interval in steps)


@dataclass(frozen=True)
class Agreement:
    """What every rank acts on at this step (identical on all ranks)."""

    action: str | None = None
    request_id: str | None = None
    sigterm: bool = False
    nonfinite: bool = False
    interval: int = 1
    stale: bool = False
    value: int = 0  # the request's value (set_interval: the new interval in steps)


class Coordinator(Protocol):
    rank: int
    world_size: int
    distributed: bool

    @property
    def in_flight(self) -> bool: ...

    def start(self, view: LocalView) -> None: ...

    def finish(self) -> Agreement: ...

    def agree(self, view: LocalView) -> Agreement: ...

    def broadcast_int(self, value: int, *, checkpoint_group: bool = False) -> int: ...

    def broadcast_str(self, value: str) -> str: ...

    def all_gather_json(self, obj: Any) -> list[Any]: ...

    def close(self) -> None: ...


class LocalCoordinator:
    """One process: the local view is the agreement."""

    rank = 0
    world_size = 1
    distributed = False

    def __init__(self) -> None:
        self._posted: LocalView | None = None

    @property
    def in_flight(self) -> bool:
        return self._posted is not None

    def start(self, view: LocalView) -> None:
        if self._posted is not None:
            raise RuntimeError("an agreement is already in flight")
        self._posted = view

    def finish(self) -> Agreement:
        view, self._posted = self._posted, None
        if view is None:
            raise RuntimeError("no agreement in flight")
        action, rid = view.request if view.request else (None, None)
        return Agreement(
            action=action,
            request_id=rid,
            sigterm=view.sigterm,
            nonfinite=view.nonfinite,
            interval=_interval(view.interval, view.max_interval),
            stale=view.stale,
            value=view.value if view.request else 0,
        )

    def agree(self, view: LocalView) -> Agreement:
        self.start(view)
        return self.finish()

    def broadcast_int(self, value: int, *, checkpoint_group: bool = False) -> int:
        return value

    def broadcast_str(self, value: str) -> str:
        return value

    def all_gather_json(self, obj: Any) -> list[Any]:
        return [json.loads(json.dumps(obj))]

    def close(self) -> None:
        """Nothing to release."""


class DistCoordinator:
    """Collectives on two private gloo groups: `sync` (main thread: agreement, resume) and
    `ckpt` (the writer thread: DCP save, gathering checksums, commit). Separate groups keep
    the writer thread's collectives from interleaving with the main thread's, and both stay
    off the training process group (NCCL or gloo).

    Constructing it is itself a collective (`new_group`): every rank must do it, in order.
    `timeout_s` bounds the groups' collectives (None: torch's default for gloo).
    """

    distributed = True

    def __init__(self, *, timeout_s: float | None = None) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self._sync_group: Any = dist.new_group(backend="gloo", timeout=timeout)
        self._ckpt_group: Any = dist.new_group(backend="gloo", timeout=timeout)
        self._posted: tuple[LocalView, torch.Tensor, Any] | None = None

    @property
    def sync_group(self) -> Any:
        return _open(self._sync_group)

    @property
    def ckpt_group(self) -> Any:
        return _open(self._ckpt_group)

    @property
    def in_flight(self) -> bool:
        return self._posted is not None

    def start(self, view: LocalView) -> None:
        """Post this rank's view (non-blocking); nothing else may use the sync group until
        `finish()`."""
        if self._posted is not None:
            raise RuntimeError("an agreement is already in flight")
        code = self.world_size - self.rank if view.request else 0
        # MAX of the negated cap is minus the smallest cap: one all_reduce carries both.
        cap = -(view.max_interval if view.max_interval is not None else _NO_CAP)
        flags = torch.tensor(
            [code, int(view.sigterm), int(view.nonfinite), view.interval, cap, int(view.stale)],
            dtype=torch.int64,
        )
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.sync_group, async_op=True)
        self._posted = (view, flags, work)

    def finish(self) -> Agreement:
        """Wait for the posted all_reduce; then, if a rank holds a request, its broadcast."""
        if self._posted is None:
            raise RuntimeError("no agreement in flight")
        view, flags, work = self._posted
        self._posted = None
        work.wait()
        top, sigterm, nonfinite, interval, neg_cap, stale = (int(x) for x in flags.tolist())
        action: str | None = None
        rid: str | None = None
        value = 0
        if top > 0:
            src = self.world_size - top
            head = 1 + _VALUE_BYTES
            buf = torch.zeros(head + REQUEST_ID_MAX_BYTES, dtype=torch.uint8)
            if self.rank == src and view.request is not None:
                raw = view.request[1].encode()
                buf[0] = ACTION_CODES[view.request[0]]
                packed = view.value.to_bytes(_VALUE_BYTES, "little", signed=True)
                buf[1:head] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
                buf[head : head + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            dist.broadcast(buf, src=src, group=self.sync_group)
            action = _ACTIONS[int(buf[0])]
            value = int.from_bytes(buf[1:head].numpy().tobytes(), "little", signed=True)
            raw_id = buf[head:].numpy().tobytes().rstrip(b"\0")
            rid = raw_id.decode()
        return Agreement(
            action=action,
            request_id=rid,
            sigterm=bool(sigterm),
            nonfinite=bool(nonfinite),
            interval=_interval(interval, None if -neg_cap >= _NO_CAP else -neg_cap),
            stale=bool(stale),
            value=value,
        )

    def agree(self, view: LocalView) -> Agreement:
        self.start(view)
        return self.finish()

    def abandon(self) -> None:
        """Forget a posted agreement without waiting: its world is gone (a peer was lost)."""
        self._posted = None

    def broadcast_int(self, value: int, *, checkpoint_group: bool = False) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        group = self.ckpt_group if checkpoint_group else self.sync_group
        dist.broadcast(t, src=0, group=group)
        return int(t.item())

    def broadcast_str(self, value: str) -> str:
        raw = value.encode()
        n = self.broadcast_int(len(raw))
        buf = torch.zeros(n, dtype=torch.uint8)
        if self.rank == 0 and n:
            buf[:] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.sync_group)
        return buf.numpy().tobytes().decode()

    def all_gather_json(self, obj: Any) -> list[Any]:
        """All ranks' JSON values, on the checkpoint group (no pickle: bytes in a tensor)."""
        raw = json.dumps(obj).encode()
        length = torch.tensor([len(raw)], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(lengths, length, group=self.ckpt_group)
        size = max(int(x.item()) for x in lengths)
        mine = torch.zeros(size, dtype=torch.uint8)
        mine[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        bufs = [torch.zeros(size, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(bufs, mine, group=self.ckpt_group)
        return [
            json.loads(b[: int(n.item())].numpy().tobytes().decode())
            for b, n in zip(bufs, lengths, strict=True)
        ]

    def close(self) -> None:
        """Destroy the two private groups, once, while the interpreter is whole: a gloo group
        left to the interpreter's (or the C++ runtime's) teardown can abort a finished process
        with SIGABRT ("terminate called without an active exception"), and torchrun then
        reports a job that trained and committed as failed. Local: no collective, so a peer
        that is gone cannot hold it. The caller waits for the writer thread first (the
        checkpoint group is its own)."""
        groups = [g for g in (self._sync_group, self._ckpt_group) if g is not None]
        self._sync_group = self._ckpt_group = None
        self._posted = None
        if not dist.is_initialized():  # the job destroyed every group already
            return
        for group in groups:
            try:
                dist.destroy_process_group(group)
            except (RuntimeError, ValueError) as e:  # already gone: nothing left to release
                log.info("event=coordinator_group_release_skipped reason=%s", type(e).__name__)


def _open(group: Any) -> Any:
    """A private group, never None: None would silently mean the job's default group."""
    if group is None:
        raise RuntimeError("the coordinator is closed: its process groups are destroyed")
    return group


def _interval(proposed: int, cap: int | None) -> int:
    """The agreed interval: the largest proposal, within the smallest cap, at least 1."""
    return max(1, proposed if cap is None else min(proposed, cap))
