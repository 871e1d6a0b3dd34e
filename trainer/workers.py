"""DataLoader worker processes kept out of a job's stop path.

A job is stopped by signalling its processes: torchrun forwards SIGTERM to each rank's
process group, the agent signals every process of the launch, a terminal sends SIGINT to the
foreground group. DataLoader workers are in all of these; a worker killed by the signal makes
the rank's next `next(batches)` raise ("DataLoader worker (pid N) is killed by signal"), so the
emergency checkpoint the signal asked for is never written. `WorkerInit` makes each worker
ignore SIGTERM and SIGINT; the rank alone decides when to stop, and its workers then end the
loader's own ways: the iterator's shutdown (done event + end marker) when it is dropped, and
the worker's watchdog when the rank exits without one (it polls the parent every 5 s).
That watchdog takes the parent's pid when the worker starts its loop, so a rank killed while
a worker is still starting (a loaded machine) leaves that worker polling an orphan's parent
forever; `WorkerInit` therefore watches the rank too, from the pid multiprocessing recorded
when it made the worker, and ends the worker once it has been orphaned.

Workers inherit the rank's signal mask, so the rank blocks SIGTERM and SIGINT while it starts
them (`stop_signals_blocked`, used by `ResumableSampler.batches` and `resumable_loader`'s
loader): a signal that arrives before a worker has run `WorkerInit` waits, and is ignored then.
The rank itself gets a signal sent meanwhile as soon as the workers are started.

One case needs help: a rank that exits normally while an iterator is still alive (a loop at
module level) has multiprocessing terminate its daemonic children at exit with SIGTERM, and
waits for them. A worker ignoring that SIGTERM would hang the exit forever, so this module
registers, in the rank, an exit hook that runs just before multiprocessing's and releases
the workers: a SIGTERM after the release ends them (exit code 0, which the loader does not
report as a failure).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing
import multiprocessing.synchronize
import multiprocessing.util  # registers multiprocessing's exit hook before ours (LIFO order)
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["WorkerInit", "guard_workers", "stop_signals_blocked", "worker_init_fn"]

log = logging.getLogger("trainguard.trainer")

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_lock = threading.Lock()
_release: multiprocessing.synchronize.Event | None = None
# Set in a worker by WorkerInit: the parent's release event, read by the signal handler.
_worker_release: multiprocessing.synchronize.Event | None = None


def _release_event() -> multiprocessing.synchronize.Event:
    """The rank's release event, made once (with its exit hook) on first use."""
    global _release
    with _lock:
        if _release is None:
            # A spawn-context event can be handed to workers of any start method (fork
            # inherits it; spawn and forkserver pickle it while starting the worker).
            _release = multiprocessing.get_context("spawn").Event()
            atexit.register(_release_workers)
        return _release


def _release_workers() -> None:
    if _release is not None:
        _release.set()


def _on_stop_signal(signum: int, frame: FrameType | None) -> None:
    release = _worker_release
    if release is not None and release.is_set():
        os._exit(0)  # the rank is exiting: end now, as the loader expects of its workers


class WorkerInit:
    """A DataLoader `worker_init_fn`: ignore SIGTERM/SIGINT in the worker, then run `inner`.

    Picklable (the loader hands it to spawned workers), so `inner` must be too.
    """

    def __init__(self, inner: Callable[[int], Any] | None = None) -> None:
        self.inner: Callable[[int], Any] | None = (
            inner.inner if isinstance(inner, WorkerInit) else inner
        )
        self.release = _release_event()

    def __call__(self, worker_id: int) -> None:
        global _worker_release
        _worker_release = self.release
        for sig in _STOP_SIGNALS:
            signal.signal(sig, _on_stop_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # blocked while starting
        parent = multiprocessing.parent_process()
        if parent is not None and parent.pid is not None:
            _watch_parent(parent.pid)
        if self.inner is not None:
            self.inner(worker_id)


def _watch_parent(rank_pid: int, interval_s: float = 1.0) -> None:
    """End this worker once the rank that made it is gone (it has been reparented)."""
    if os.getppid() != rank_pid:
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(interval_s)
            if os.getppid() != rank_pid:
                os._exit(0)

    threading.Thread(target=watch, name="trainguard-rank-watch", daemon=True).start()


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGTERM and SIGINT in this thread (workers started here inherit the mask until
    `WorkerInit` has installed its handler); on exit, restore the mask, which delivers any
    signal that arrived meanwhile."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def worker_init_fn(inner: Callable[[int], Any] | None = None) -> WorkerInit:
    """`DataLoader(..., worker_init_fn=worker_init_fn(my_init))`: workers that ignore the stop
    signals meant for the rank, then run `my_init` (optional) as before."""
    return WorkerInit(inner)


def guard_workers(loader: Any) -> Any:
    """Give an existing DataLoader's workers `WorkerInit` (wrapping its own worker_init_fn);
    returns the loader. Takes effect for workers started afterwards: a loader whose persistent
    workers already run keeps them as they are (logged)."""
    if getattr(loader, "num_workers", 0) <= 0 or isinstance(loader.worker_init_fn, WorkerInit):
        return loader
    if getattr(loader, "_iterator", None) is not None:
        log.warning(
            "event=loader_workers_unguarded reason=persistent_workers_already_started "
            "fix=call_guard_workers_before_the_first_iteration"
        )
        return loader
    loader.worker_init_fn = WorkerInit(loader.worker_init_fn)
    return loader
