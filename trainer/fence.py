"""Fencing of a checkpoint directory between attempts of one job: the attempt epoch on disk.

`<ckpt_dir>/EPOCH` holds the highest attempt epoch that has started in the directory (one
decimal line, replaced atomically: temp file, fsync, rename, directory fsync). A launch raises
it when it starts; a commit from an older epoch is refused (`StaleAttempt`). The check and the
raise both hold an flock on `<ckpt_dir>/.epoch.lock`, which makes them exclusive on one host
(and on file systems whose flock spans hosts); elsewhere the commit checks again after its
rename and withdraws a checkpoint that raced a newer launch.

`<ckpt_dir>/.launch.<epoch>.lock` is the launch lock: rank 0 of a launch holds an flock on it
while the launch runs, so a relaunch of the same epoch on the same host waits for (or refuses
to run beside) leftover workers of a killed launch. No torch in here.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path

from trainguard.clock import SYSTEM_CLOCK, Clock

__all__ = [
    "ATTEMPT_ENV",
    "EPOCH_NAME",
    "LaunchLock",
    "LaunchLocked",
    "StaleAttempt",
    "check_epoch",
    "epoch_from_env",
    "epoch_lock",
    "raise_epoch",
    "read_epoch",
    "write_epoch",
]

log = logging.getLogger("trainguard.trainer")

ATTEMPT_ENV = "TRAINGUARD_ATTEMPT"
EPOCH_NAME = "EPOCH"
_EPOCH_LOCK_NAME = ".epoch.lock"
_LAUNCH_LOCK = re.compile(r"^\.launch\.(\d+)\.lock$")
_LOCK_POLL_S = 0.1


class StaleAttempt(RuntimeError):
    """This launch's attempt epoch is older than the checkpoint directory's."""

    def __init__(self, *, epoch: int, current: int) -> None:
        self.epoch = epoch
        self.current = current
        super().__init__(
            f"checkpoint refused: attempt {epoch} is older than the directory's attempt {current}"
        )


class LaunchLocked(RuntimeError):
    """Another process of the same attempt still holds the launch lock."""


def epoch_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The attempt epoch from `TRAINGUARD_ATTEMPT` (unset or empty: None, no fencing)."""
    raw = (os.environ if env is None else env).get(ATTEMPT_ENV, "").strip()
    if not raw:
        return None
    try:
        epoch = int(raw)
    except ValueError:
        raise ValueError(f"{ATTEMPT_ENV}={raw!r} is not an integer") from None
    if epoch < 0:
        raise ValueError(f"{ATTEMPT_ENV}={raw!r} must be >= 0")
    return epoch


def read_epoch(ckpt_dir: Path) -> int | None:
    """The directory's epoch, or None when no fenced launch has started there."""
    try:
        raw = (ckpt_dir / EPOCH_NAME).read_text()
    except FileNotFoundError:
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{ckpt_dir / EPOCH_NAME}: not an integer: {raw[:40]!r}") from None


def write_epoch(ckpt_dir: Path, epoch: int) -> None:
    """Replace the EPOCH file atomically and durably: a reader sees the old or the new value."""
    tmp = ckpt_dir / f"{EPOCH_NAME}.tmp-{secrets.token_hex(4)}"
    try:
        with open(tmp, "w") as f:
            f.write(f"{epoch}\n")
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, ckpt_dir / EPOCH_NAME)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fd = os.open(ckpt_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def epoch_lock(ckpt_dir: Path) -> Iterator[None]:
    """Exclusive flock on `.epoch.lock` around a read-then-write of the epoch."""
    fd = os.open(ckpt_dir / _EPOCH_LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def raise_epoch(ckpt_dir: Path, epoch: int) -> int | None:
    """Record `epoch` as the directory's if it is newer; return the previous epoch.

    Raises `StaleAttempt` when the directory already holds a newer epoch."""
    with epoch_lock(ckpt_dir):
        current = read_epoch(ckpt_dir)
        if current is not None and current > epoch:
            raise StaleAttempt(epoch=epoch, current=current)
        if current != epoch:
            write_epoch(ckpt_dir, epoch)
    if current is None or current < epoch:
        _remove_older_launch_locks(ckpt_dir, epoch)
    return current


def check_epoch(ckpt_dir: Path, epoch: int) -> None:
    """Raise `StaleAttempt` if the directory's epoch is newer than `epoch`."""
    current = read_epoch(ckpt_dir)
    if current is not None and current > epoch:
        raise StaleAttempt(epoch=epoch, current=current)


def _remove_older_launch_locks(ckpt_dir: Path, epoch: int) -> None:
    """Lock files of fenced attempts guard nothing any more (their commits are refused)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(ckpt_dir):
            m = _LAUNCH_LOCK.match(entry.name)
            if m and int(m.group(1)) < epoch:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


class LaunchLock:
    """An flock on `<ckpt_dir>/.launch.<epoch>.lock`, held from `acquire()` to `release()` (or
    to the process's death: the kernel drops an flock with its last file descriptor, so a
    SIGKILLed holder never leaves it behind). The file records the holder's pid for the error
    message. Only one host sees it, unless the file system implements flock across hosts."""

    def __init__(self, ckpt_dir: Path, *, epoch: int, clock: Clock = SYSTEM_CLOCK) -> None:
        self.path = ckpt_dir / f".launch.{epoch}.lock"
        self.clock = clock
        self._fd: int | None = None

    def acquire(self, *, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the lock; raise `LaunchLocked` naming the holder."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = self.clock.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if self.clock.monotonic() >= deadline:
                    holder = _read_holder(fd)
                    os.close(fd)
                    raise LaunchLocked(
                        f"{self.path}: held by pid {holder} (a process of a launch of the same "
                        f"attempt still runs on this host); waited {timeout_s:.0f} s. Stop the "
                        "old launch's workers before relaunching this attempt"
                    ) from None
                self.clock.sleep(_LOCK_POLL_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read_holder(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return os.pread(fd, 32, 0).decode().strip() or "?"
    return "?"
