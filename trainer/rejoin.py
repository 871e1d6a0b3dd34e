"""Membership of a re-formed world: who a rank is next, where it meets, and how it gets there.

A world whose rank died is re-formed without relaunching the healthy ranks (docs/trainer.md,
"In-process rejoin"): whoever replaces the lost rank (the controller, later; a test today)
names a `Membership` for every rank of the new world: its rank and world size, the address
of the new world's rendezvous `TCPStore` (run by its rank 0, or by a process that outlives
every rank), and the next attempt epoch. A healthy rank
learns of the loss as `PeerLost` (a broken collective, converted by `PeerLossGuard`), waits
for its membership (a `rejoin` Control on its control socket, trainer/membership_inbox.py; or,
where a test re-forms the world, a key of a TCPStore: `wait_membership`), leaves the old
process group (with NCCL, aborting its communicators first: `abort_world`) and initialises
the new one (`leave_world`, `join_world`; a membership with `host_store` makes this rank run
the new world's store), and `Trainguard.rejoin` does the rest. A replacement process calls
`join_world` with the membership it was started with. No state moves here
(trainer/peer_state.py moves it).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Literal

import torch
import torch.distributed as dist

from trainguard.membership import Membership

__all__ = [
    "MEMBERSHIP_KEY_PREFIX",
    "PeerLost",
    "PeerLossGuard",
    "RejoinFailed",
    "abort_world",
    "is_collective_failure",
    "join_world",
    "leave_world",
    "membership_key",
    "publish_membership",
    "wait_membership",
]

log = logging.getLogger("trainguard.trainer")

MEMBERSHIP_KEY_PREFIX = "trainguard/membership"
_WORLD_PREFIX = "trainguard/world"
# What gloo (and NCCL) put in the RuntimeError a collective raises when a peer is gone or
# silent past the group's timeout; torch's own DistError subclasses are matched by type.
_PEER_FAILURE_MARKERS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",
    "NCCL communicator was aborted",
)


class PeerLost(RuntimeError):
    """A collective of this world failed: a peer died or fell silent past the timeout.

    `last_step`: the last step this rank completed (its `Trainguard.step()` was entered);
    the rank's state is exactly the state after it, so the re-formed world continues at
    `last_step + 1` and loses at most the step in flight. None: no step completed yet."""

    def __init__(self, *, last_step: int | None, cause: str) -> None:
        self.last_step = last_step
        self.cause = cause
        super().__init__(f"a peer of this world was lost after step {last_step}: {cause}")


class RejoinFailed(RuntimeError):
    """The in-process path could not re-form the world; fall back to a full restart."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether `exc` is what a collective raises when a peer is lost (not a bug of the job)."""
    if isinstance(exc, dist.DistError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return any(marker in text for marker in _PEER_FAILURE_MARKERS)


class PeerLossGuard:
    """`with guard:` around a step's collectives turns their failure into `PeerLost`.

    The original exception is dropped, with its traceback: the frames it holds keep the old
    world's objects (a DistributedDataParallel and its reducer) alive, and those must go
    before the rank trains in the new world."""

    def __init__(self, last_step: Callable[[], int | None]) -> None:
        self.last_step = last_step  # read when the failure comes: the step may complete inside

    def __enter__(self) -> PeerLossGuard:
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        if exc is None or isinstance(exc, PeerLost) or not is_collective_failure(exc):
            return False
        lost = PeerLost(last_step=self.last_step(), cause=_first_line(exc))
        # This frame stays in `lost`'s traceback: it must not hold the old one either.
        exc.__traceback__ = None
        del tb
        lost.__suppress_context__ = True
        raise lost


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def membership_key(*, job: str, pid: int) -> str:
    """The store key a process waits on for its next membership (pid: one process's)."""
    return f"{MEMBERSHIP_KEY_PREFIX}/{job}/{pid}"


def _client(host: str, port: int, timeout_s: float, *, master: bool = False) -> dist.TCPStore:
    """A client of the store at host:port; `master`: this process runs the store there."""
    return dist.TCPStore(
        host, port, is_master=master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


def publish_membership(store: dist.Store, *, job: str, pid: int, membership: Membership) -> None:
    """Tell the process `pid` its next membership (the side that re-forms the world)."""
    store.set(membership_key(job=job, pid=pid), membership.to_json())


def wait_membership(
    *, store_host: str, store_port: int, job: str, pid: int, timeout_s: float
) -> Membership:
    """Block until this process's membership is published (RejoinFailed after timeout_s)."""
    key = membership_key(job=job, pid=pid)
    try:
        store = _client(store_host, store_port, timeout_s)
        store.wait([key], timedelta(seconds=timeout_s))
        raw = store.get(key)
    except (RuntimeError, dist.DistError) as e:
        raise RejoinFailed(f"no membership for {key} within {timeout_s:.0f} s: {e}") from None
    return Membership.from_json(raw)


def leave_world(*, abort_timeout_s: float = 30.0) -> None:
    """Destroy every process group of the old world (the training group and the library's
    own); a dead peer does not block it. With NCCL the communicators are aborted first
    (`abort_world`, bounded by `abort_timeout_s`): destroying one whose collective hangs on
    the lost peer would hang too."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if "nccl" in str(dist.get_backend()):
        abort_world(timeout_s=abort_timeout_s)
    if dist.is_initialized():
        dist.destroy_process_group()


# torch's own abort of every group of a process (`_abort_process_group`, experimental but the
# one torch offers) from this version on; before it, each NCCL backend is shut down alone.
_ABORT_API_SINCE = (2, 6)


def abort_world(*, timeout_s: float) -> None:
    """Abort every NCCL communicator of this process's world, in a thread bounded by
    `timeout_s` (`RejoinFailed` when the abort itself hangs or fails: the rank must then exit
    and the job takes a full restart). Aborting makes a collective hung on a lost peer return
    with an error and releases the communicators without the peer, which destroying them does
    not (NCCL's destroy waits for every rank). Not runnable without a GPU: its unit test fakes
    torch at this edge."""
    done = threading.Event()
    failed: list[str] = []
    api: list[str] = []

    def run() -> None:
        try:
            api.append(_abort_groups())
        except Exception as e:  # any failure of the abort is reported below
            failed.append(f"{type(e).__name__}: {e}")
        finally:
            done.set()

    t0 = time.monotonic()
    threading.Thread(target=run, name="trainguard-abort-world", daemon=True).start()
    if not done.wait(timeout_s):
        raise RejoinFailed(f"aborting the NCCL communicators took over {timeout_s:.0f} s")
    if failed:
        raise RejoinFailed(f"aborting the NCCL communicators failed: {failed[0]}")
    log.info(
        "event=world_aborted backend=nccl api=%s duration_s=%.3f",
        api[0],
        time.monotonic() - t0,
    )


def _abort_groups() -> str:
    """Abort through the API the installed torch offers; returns which one."""
    # Deferred: the module holds torch's private world state, read only on this path.
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415

    if _torch_version(torch.__version__) >= _ABORT_API_SINCE:
        # Every group (the default one included) within one NCCL group call, so that no
        # communicator's abort waits on another's; torch forgets the world afterwards.
        c10d._abort_process_group()
        return "abort_process_group"
    if not dist.is_nccl_available():
        return "none"
    cuda = torch.device("cuda")
    for group in list(c10d._world.pg_names):
        try:
            backend = group._get_backend(cuda)
        except RuntimeError:  # a group without a CUDA backend (gloo): nothing to abort
            continue
        if isinstance(backend, dist.ProcessGroupNCCL):
            backend._shutdown()  # type: ignore[attr-defined]  # torch < 2.6 only
    return "backend_shutdown"


def _torch_version(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", str(version))
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


def join_world(m: Membership) -> None:
    """Initialise torch.distributed as rank `m.rank` of the new world. The world's keys live
    under a prefix of its epoch, so nothing of an older world's rendezvous is read again."""
    if dist.is_initialized():
        raise RejoinFailed("join_world: a process group is still initialised (leave_world first)")
    try:
        store = _client(m.store_host, m.store_port, m.timeout_s, master=m.host_store)
        dist.init_process_group(
            m.backend,
            store=dist.PrefixStore(f"{_WORLD_PREFIX}/{m.epoch}", store),
            rank=m.rank,
            world_size=m.world_size,
            timeout=timedelta(seconds=m.timeout_s),
        )
    except (RuntimeError, dist.DistError) as e:
        raise RejoinFailed(
            f"could not join world of epoch {m.epoch} as rank {m.rank}/{m.world_size}: {e}"
        ) from None
    log.info(
        "event=world_joined rank=%d world_size=%d epoch=%d store=%s:%d",
        m.rank,
        m.world_size,
        m.epoch,
        m.store_host,
        m.store_port,
    )


def settle_ddp_buckets(model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor]) -> None:
    """Make a DDP wrapper built at a step > 0 (after `rejoin()`, in a replacement after
    `join_from_peer()`, after a resume) reduce its gradients the way the long-running one
    does, so the steps after a recovery are bitwise the uninterrupted run's.

    A new DistributedDataParallel all-reduces its first backward as one bucket in parameter
    order and only then rebuilds its buckets in the order gradients become ready; gloo's ring
    all-reduce adds an element's contributions in an order set by its offset in the bucket, so
    with 3 or more ranks that first step's sums differ from the uninterrupted run's in the
    last bit (with 2 ranks a + b == b + a and nothing shows). One discarded forward and
    backward, on every rank (it is a collective), lets DDP rebuild first: `loss_fn` computes
    the loss of the next batch through `model`. The CPU (and CUDA) RNG state and the module's
    buffers are restored afterwards and the gradients are left for the caller's
    `zero_grad()`. Call it inside `peer_loss_guard()`: a peer lost during it is a `PeerLost`.
    Assumes the gradient-ready order is the same every step (no `find_unused_parameters`, no
    dynamic graph), as the bitwise claim does anyway.
    """
    module = getattr(model, "module", model)
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    buffers = [b.detach().clone() for b in module.buffers()]
    loss_fn().backward()
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    with torch.no_grad():
        for b, saved in zip(module.buffers(), buffers, strict=True):
            b.copy_(saved)
