"""Writing and reading checkpoints: the background writer thread and the per-format loaders.

A save is: snapshot in host memory (main thread, the only part the loop waits for), then in a
background thread: write every file into `step_K.tmp-<nonce>/`, fsync, checksum, gather the
checksums on rank 0, write the manifest, one atomic rename to `step_K/`, tell every rank the
outcome, apply retention, upload to S3, hand it to the replica (its own thread). A delta save
(incremental checkpoints, not with a process group) writes `delta_<rank>.bin` against its base
in place of the tensor file, or a full checkpoint when its base no longer verifies. At most one
save is in flight; a new save first waits for the previous one. A failed save is reported and
never becomes "latest". With an attempt epoch, rank 0 refuses the commit when the directory's
epoch is newer (trainer/fence.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import secrets
import shutil
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.trainer.delta import DELTA_CODEC
from trainguard.trainer.delta_files import delta_file_name, read_base, write_delta_file
from trainguard.trainer.fence import StaleAttempt, check_epoch, epoch_lock, read_epoch
from trainguard.trainer.hooks import StepHook
from trainguard.trainer.manifest import (
    DELTA_FORMAT,
    DeltaLink,
    HashingWriter,
    Manifest,
    apply_retention,
    commit_dir,
    fsync_dir,
    hash_file,
    manifest_sha256,
    step_dir_name,
    write_manifest,
)
from trainguard.trainer.replica import Replicator
from trainguard.trainer.retention import RetentionPolicy
from trainguard.trainer.s3 import S3Store
from trainguard.trainer.sync import Coordinator

__all__ = [
    "CheckpointWriter",
    "SaveResult",
    "load_rank_file",
    "rank_file_name",
    "read_tensor_file",
    "tensor_file_name",
    "write_tensor_file",
]

log = logging.getLogger("trainguard.trainer")
_FAILED, _COMMITTED, _STALE = 0, 1, 2
_DCP_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


_BLOCK_BYTES = 4 << 20
_HASH_AHEAD_BLOCKS = 4
_WRITEBACK_BYTES = 32 << 20
_ALIGN_BYTES = 64
_ZEROS = bytes(_ALIGN_BYTES)


def _stale_reason(ckpt_dir: Path, epoch: int | None) -> str:
    """A non-zero rank's reason for the refusal rank 0 decided (the same EPOCH file)."""
    with contextlib.suppress(OSError, ValueError):
        current = read_epoch(ckpt_dir)
        if epoch is not None and current is not None:
            return str(StaleAttempt(epoch=epoch, current=current))
    return "checkpoint refused: a newer attempt of the job owns the directory (see rank 0)"


_CAUSE_CHARS = 500


def _cause(prefix: str, e: BaseException) -> str:
    """`prefix: <the error's text, on one line>`, bounded: a DCP CheckpointException's text
    holds a traceback per failed rank."""
    text = " ".join(str(e).split())
    if len(text) > _CAUSE_CHARS:
        text = text[: _CAUSE_CHARS - 3] + "..."
    return f"{prefix}: {text}" if text else prefix


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def tensor_file_name(rank: int) -> str:
    return f"tensors_{rank:05d}.bin"


def _byte_view(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous() or flat.device.type != "cpu":
        flat = flat.contiguous().cpu()
    return flat.view(torch.uint8).numpy().data


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _advise_dontneed(fd: int, offset: int, length: int) -> None:
    """POSIX_FADV_DONTNEED: on Linux it starts writeback of the range's dirty pages and drops
    its clean ones. Advisory only (fsync still makes the file durable), so a platform or file
    system without it just skips it."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    with contextlib.suppress(OSError):
        advise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class _Writeback:
    """Keeps the page cache footprint of a large sequential write small and the final fsync
    short: every `window_bytes` written, start writeback of that window, and drop the pages
    of the window written two windows before (written back by then, so clean).

    Without it the whole file sits dirty until fsync, which then waits for all of it, and
    every page of the file is a fresh page-cache allocation; with it the disk works while
    the CPU copies and hashes, and the writer reuses the pages it just released.
    """

    def __init__(self, fd: int, *, window_bytes: int) -> None:
        self.fd = fd
        self.window_bytes = window_bytes
        self.marks = [0]

    def written(self, end: int) -> None:
        if self.window_bytes <= 0 or end - self.marks[-1] < self.window_bytes:
            return
        _advise_dontneed(self.fd, self.marks[-1], end - self.marks[-1])
        self.marks.append(end)
        if len(self.marks) >= 4:
            _advise_dontneed(self.fd, self.marks[-4], self.marks[-3] - self.marks[-4])

    def release(self) -> None:
        """After fsync: every page is clean; drop them all (a checkpoint is not re-read soon)."""
        if self.window_bytes > 0:
            _advise_dontneed(self.fd, 0, 0)


def write_tensor_file(
    path: Path,
    tensors: dict[str, torch.Tensor],
    *,
    block_bytes: int = _BLOCK_BYTES,
    writeback_bytes: int = _WRITEBACK_BYTES,
) -> tuple[dict[str, Any], int, str]:
    """Write tensors as raw bytes (64-byte aligned) with fsync; returns (index, size, sha256).

    No serializer and no intermediate copy: each block goes from the snapshot buffer's own
    memory to `os.write`, and a second thread hashes the same block while it is written
    (hashlib and os.write both release the GIL). Blocks are small enough (4 MiB) that the
    second reader finds them in the CPU cache, and the hasher may run at most a few blocks
    behind. Writeback starts early (see `_Writeback`), so the final fsync has little left
    to wait for. Loading needs no unpickling at all.
    """
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    index: dict[str, Any] = {}
    digest = hashlib.sha256()
    offset = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        writeback = _Writeback(fd, window_bytes=writeback_bytes)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainguard-hash") as hasher:
            pending: deque[Future[None]] = deque()

            def emit(block: memoryview | bytes) -> None:
                nonlocal offset
                if len(pending) >= _HASH_AHEAD_BLOCKS:
                    pending.popleft().result()
                pending.append(hasher.submit(digest.update, block))
                _write_all(fd, block)
                offset += len(block)
                writeback.written(offset)

            for name, t in tensors.items():
                pad = -offset % _ALIGN_BYTES
                if pad:
                    emit(_ZEROS[:pad])
                view = _byte_view(t)
                index[name] = {
                    "dtype": str(t.dtype).removeprefix("torch."),
                    "shape": list(t.shape),
                    "offset": offset,
                    "nbytes": len(view),
                }
                for i in range(0, len(view), block_bytes):
                    emit(view[i : i + block_bytes])
            while pending:
                pending.popleft().result()
        os.fsync(fd)
        writeback.release()
    finally:
        os.close(fd)
    return index, offset, digest.hexdigest()


def read_tensor_file(path: Path, index: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors of a raw tensor file, per its index (dtypes limited to real torch dtypes)."""
    size = path.stat().st_size
    buf = bytearray(size)
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"{path}: shorter than its size")
            got += n
    out: dict[str, torch.Tensor] = {}
    for name, meta in index.items():
        dtype = getattr(torch, str(meta["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{path}: tensor {name!r} has unknown dtype {meta['dtype']!r}")
        shape = [int(d) for d in meta["shape"]]
        offset, nbytes = int(meta["offset"]), int(meta["nbytes"])
        if offset < 0 or offset + nbytes > size:
            raise ValueError(f"{path}: tensor {name!r} lies outside the file")
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
        out[name] = raw.view(dtype).reshape(shape)
    return out


def load_rank_file(path: Path) -> dict[str, Any]:
    """Per-rank state; tensors and primitives only (never unpickles arbitrary objects)."""
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a dict, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class SaveResult:
    step: int
    request_id: str | None
    ok: bool
    duration_s: float
    path: str
    bytes: int = 0
    reason: str = ""
    stale: bool = False  # refused: a newer attempt of the job owns the directory
    # seconds the save held the training loop (waiting for the previous save, the snapshot);
    # None where not measured. What a checkpoint costs the job (controller.ckptinterval).
    block_s: float | None = None
    # A delta checkpoint: the step of its base (None: a full checkpoint, or not committed).
    base_step: int | None = None


class CheckpointWriter:
    """Runs one save at a time in a daemon thread; results are collected by the main thread."""

    def __init__(
        self,
        *,
        ckpt_dir: Path,
        coordinator: Coordinator,
        retention: RetentionPolicy,
        job: str,
        version: str,
        run_nonce: str,
        epoch: int | None = None,
        s3: S3Store | None = None,
        replicator: Replicator | None = None,
        hooks: tuple[StepHook, ...] = (),
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.ckpt_dir = ckpt_dir
        self.replicator = replicator
        self.coord = coordinator
        self.retention = retention
        self.job = job
        self.version = version
        self.run_nonce = run_nonce
        self.epoch = epoch
        self.s3 = s3
        self.hooks = hooks
        self.clock = clock
        self._thread: threading.Thread | None = None
        self._results: list[SaveResult] = []
        self._lock = threading.Lock()
        self._counter = 0
        self._stale: StaleAttempt | None = None

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait for the in-flight save; True when none is left in flight."""
        t = self._thread
        if t is None:
            return True
        t.join(timeout_s)
        return not t.is_alive()

    def take_results(self) -> list[SaveResult]:
        with self._lock:
            out, self._results = self._results, []
        return out

    def start(
        self,
        *,
        step: int,
        request_id: str | None,
        rank_state: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        snapshot_bytes: int,
        milestones: tuple[str, ...] = (),
        delta_base: int | None = None,
        delta_index: int = 0,
    ) -> None:
        """Start writing a snapshot (the caller has waited for any previous save);
        `milestones`: the names the job marked for this checkpoint (its manifest keeps them);
        `delta_base`: write a delta against the full checkpoint of that step (the
        `delta_index`-th after it), or a full one if that base does not verify."""
        if self.busy():
            raise RuntimeError("a checkpoint save is already in flight")
        self._counter += 1
        tmp = self.ckpt_dir / f"{step_dir_name(step)}.tmp-{self.run_nonce}{self._counter:04x}"
        self._thread = threading.Thread(
            target=self._run,
            name=f"trainguard-ckpt-{step}",
            kwargs={
                "step": step,
                "request_id": request_id,
                "rank_state": rank_state,
                "tensors": tensors,
                "tmp": tmp,
                "snapshot_bytes": snapshot_bytes,
                "milestones": milestones,
                "delta": (delta_base, delta_index) if delta_base is not None else None,
            },
            daemon=True,  # a stuck write must never keep a finished or preempted job alive
        )
        self._thread.start()

    def _write_local(
        self,
        step: int,
        rank_state: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        tmp: Path,
        delta: tuple[int, int] | None = None,
    ) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None]:
        """This rank's files in `tmp`, and the delta link when it wrote a delta."""
        rank = self.coord.rank
        tmp.mkdir(parents=True, exist_ok=True)
        files: dict[str, dict[str, Any]] = {}
        link: dict[str, Any] | None = None
        if self.coord.distributed:
            # Deferred heavy dependency: torch.distributed.checkpoint adds ~700 modules (~0.6 s)
            # to torch's import and only distributed runs use it (write the DCP shards of a save).
            from torch.distributed.checkpoint import FileSystemWriter, save  # noqa: PLC0415

            group = getattr(self.coord, "ckpt_group", None)
            save(
                tensors,
                storage_writer=FileSystemWriter(str(tmp / "dcp"), sync_files=True),
                process_group=group,
            )
        else:
            written = self._write_delta(step, tensors, tmp, delta) if delta is not None else None
            if written is not None:
                dname, meta, delta_index, link = written
                files[dname] = meta
                rank_state = {**rank_state, "delta_index": delta_index}
            else:
                tname = tensor_file_name(rank)
                index, size, digest = write_tensor_file(tmp / tname, tensors)
                files[tname] = {"size": size, "sha256": digest}
                rank_state = {**rank_state, "tensor_index": index}
        name = rank_file_name(rank)
        with open(tmp / name, "wb") as f:
            for hook in self.hooks:
                hook.before_rank_file(step=step, rank=rank, tmp=tmp, file=f)
            hw = HashingWriter(f)
            torch.save(rank_state, hw)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        files[name] = {"size": hw.size, "sha256": hw.hexdigest()}
        if self.coord.distributed:
            for entry in sorted(os.listdir(tmp / "dcp")):
                m = _DCP_RANK_FILE.match(entry)
                if m and int(m.group(1)) == rank:
                    size, digest = hash_file(tmp / "dcp" / entry)
                    files[f"dcp/{entry}"] = {"size": size, "sha256": digest}
        return files, link

    def _write_delta(
        self, step: int, tensors: dict[str, torch.Tensor], tmp: Path, delta: tuple[int, int]
    ) -> tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]] | None:
        """Write this rank's delta against its base: (file name, its manifest entry, the delta
        index for the rank file, the link for the manifest); None (write a full checkpoint)
        when the base is gone or does not verify."""
        base_step, index = delta
        rank = self.coord.rank
        base_dir = self.ckpt_dir / step_dir_name(base_step)
        try:
            base_sha = manifest_sha256(base_dir)
            base = read_base(base_dir, step=base_step, rank=rank)
        except Exception as e:  # whatever is wrong with the base: this save is a full one
            log.warning(
                "event=checkpoint_delta_base_invalid job=%s rank=%d step=%d base_step=%d "
                "reason=%s action=write_full",
                self.job,
                rank,
                step,
                base_step,
                str(e).replace(" ", "_"),
            )
            return None
        name = delta_file_name(rank)
        delta_index, size, digest, stats = write_delta_file(tmp / name, tensors, base=base)
        log.info(
            "event=checkpoint_delta_written job=%s rank=%d step=%d base_step=%d raw_bytes=%d "
            "encoded_bytes=%d tensors_whole=%d",
            self.job,
            rank,
            step,
            base_step,
            stats.raw_bytes,
            stats.encoded_bytes,
            stats.tensors_whole,
        )
        link = DeltaLink(
            base_step=base_step,
            parent_step=base_step,
            base_manifest_sha256=base_sha,
            index=index,
            codec=DELTA_CODEC,
        )
        return name, {"size": size, "sha256": digest}, delta_index, link.to_json()

    def _run(
        self,
        *,
        step: int,
        request_id: str | None,
        rank_state: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        tmp: Path,
        snapshot_bytes: int,
        milestones: tuple[str, ...] = (),
        delta: tuple[int, int] | None = None,
    ) -> None:
        """The save thread: never dies silently. Whatever a save raises, of any class (DCP's
        `CheckpointException` is a `BaseException`), ends in a failed result, a log line and
        no temporary directory left behind."""
        t0 = self.clock.monotonic()
        try:
            committed_here = self._save(
                step=step,
                request_id=request_id,
                rank_state=rank_state,
                tensors=tensors,
                tmp=tmp,
                snapshot_bytes=snapshot_bytes,
                t0=t0,
                milestones=milestones,
                delta=delta,
            )
        except BaseException as e:  # the thread's last word: report, never die
            rank = self.coord.rank
            reason = _cause(f"rank {rank}: {type(e).__name__}", e)
            shutil.rmtree(tmp, ignore_errors=True)
            log.error(
                "event=checkpoint_failed job=%s rank=%d step=%d request_id=%s reason=%s",
                self.job,
                rank,
                step,
                request_id or "-",
                reason.replace(" ", "_"),
            )
            with self._lock:
                self._results.append(
                    SaveResult(
                        step=step,
                        request_id=request_id,
                        ok=False,
                        duration_s=self.clock.monotonic() - t0,
                        path=str(tmp),
                        bytes=snapshot_bytes,
                        reason=reason,
                    )
                )
            return
        if committed_here:
            try:
                self._after_commit(step, self.ckpt_dir / step_dir_name(step))
            except BaseException as e:  # committed and reported; only the aftermath failed
                log.error(
                    "event=checkpoint_after_commit_failed job=%s step=%d reason=%s",
                    self.job,
                    step,
                    _cause(type(e).__name__, e).replace(" ", "_"),
                )

    def _save(
        self,
        *,
        step: int,
        request_id: str | None,
        rank_state: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        tmp: Path,
        snapshot_bytes: int,
        t0: float,
        milestones: tuple[str, ...] = (),
        delta: tuple[int, int] | None = None,
    ) -> bool:
        """Write, agree, commit or give up, report; True when this rank (0) committed."""
        rank = self.coord.rank
        final = self.ckpt_dir / step_dir_name(step)
        mine: dict[str, Any] = {"ok": True, "reason": "", "files": {}, "delta": None}
        try:
            mine["files"], mine["delta"] = self._write_local(step, rank_state, tensors, tmp, delta)
        except BaseException as e:  # DCP raises CheckpointException(BaseException)
            mine = {
                "ok": False,
                "reason": _cause(f"rank {rank}: {type(e).__name__}", e),
                "files": {},
                "delta": None,
            }
        committed = 0  # the outcome every rank learns: _FAILED, _COMMITTED or _STALE
        reason = ""
        try:
            everyone = self.coord.all_gather_json(mine) if self.coord.distributed else [mine]
            failures = [r["reason"] for r in everyone if not r["ok"]]
            if rank == 0:
                committed = self._decide(
                    step,
                    request_id=request_id,
                    tmp=tmp,
                    final=final,
                    everyone=everyone,
                    failures=failures,
                    milestones=milestones,
                )
                if committed == _STALE and self.epoch is not None:
                    reason = str(self._stale)
                elif failures:
                    reason = failures[0]
            elif failures:
                reason = failures[0]
        except BaseException as e:  # see above
            reason = _cause(f"rank {rank}: commit: {type(e).__name__}", e)
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
        if self.coord.distributed:
            try:
                committed = self.coord.broadcast_int(committed, checkpoint_group=True)
            except BaseException as e:  # see above
                committed, reason = _FAILED, _cause(f"rank {rank}: outcome broadcast", e)
        stale = committed == _STALE
        if stale and rank != 0:
            reason = _stale_reason(self.ckpt_dir, self.epoch)
        if committed != _COMMITTED and not reason:
            reason = "rank 0 could not commit (see its log)"
        committed = int(committed == _COMMITTED)
        if not committed:
            # Rank 0 removed it already on every path it decided; this covers the rest (a
            # rank whose own write failed, a failed broadcast). Idempotent on a shared FS.
            shutil.rmtree(tmp, ignore_errors=True)
        duration_s = self.clock.monotonic() - t0
        result = SaveResult(
            step=step,
            request_id=request_id,
            ok=bool(committed),
            duration_s=duration_s,
            path=str(final if committed else tmp),
            bytes=snapshot_bytes,
            reason=reason,
            stale=stale,
            base_step=int(mine["delta"]["base_step"]) if committed and mine["delta"] else None,
        )
        if committed:
            log.info(
                "event=checkpoint_committed job=%s rank=%d step=%d request_id=%s duration_s=%.3f "
                "bytes=%d dir=%s",
                self.job,
                rank,
                step,
                request_id or "-",
                duration_s,
                snapshot_bytes,
                final,
            )
        elif stale:
            log.error(
                "event=checkpoint_failed job=%s rank=%d step=%d request_id=%s reason=stale_attempt "
                'epoch=%s detail="%s"',
                self.job,
                rank,
                step,
                request_id or "-",
                self.epoch,
                reason,
            )
        else:
            log.error(
                "event=checkpoint_failed job=%s rank=%d step=%d request_id=%s reason=%s",
                self.job,
                rank,
                step,
                request_id or "-",
                reason.replace(" ", "_"),
            )
        with self._lock:
            self._results.append(result)
        return bool(committed) and rank == 0

    def _decide(
        self,
        step: int,
        *,
        request_id: str | None,
        tmp: Path,
        final: Path,
        everyone: list[Any],
        failures: list[str],
        milestones: tuple[str, ...] = (),
    ) -> int:
        """Rank 0: commit, or refuse (stale attempt) or give up (a rank failed); the outcome.

        The epoch is checked under the epoch lock, which a newer launch's raise also takes; a
        file system whose flock does not span hosts leaves a window between the check and the
        rename, so the epoch is read again after the rename and a raced commit withdrawn."""
        if self.epoch is None:
            if failures:
                shutil.rmtree(tmp, ignore_errors=True)
                return _FAILED
            self._commit(
                step,
                request_id=request_id,
                tmp=tmp,
                final=final,
                everyone=everyone,
                milestones=milestones,
            )
            return _COMMITTED
        with epoch_lock(self.ckpt_dir):
            try:
                check_epoch(self.ckpt_dir, self.epoch)
            except StaleAttempt as e:
                self._stale = e
                shutil.rmtree(tmp, ignore_errors=True)
                return _STALE
            if failures:
                shutil.rmtree(tmp, ignore_errors=True)
                return _FAILED
            self._commit(
                step,
                request_id=request_id,
                tmp=tmp,
                final=final,
                everyone=everyone,
                milestones=milestones,
            )
        try:
            check_epoch(self.ckpt_dir, self.epoch)
        except StaleAttempt as e:
            self._stale = e
            aside = self.ckpt_dir / f"{final.name}.replaced-{secrets.token_hex(4)}"
            os.rename(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
            log.error(
                "event=checkpoint_withdrawn job=%s step=%d epoch=%d directory_epoch=%d",
                self.job,
                step,
                e.epoch,
                e.current,
            )
            return _STALE
        return _COMMITTED

    def _commit(
        self,
        step: int,
        *,
        request_id: str | None,
        tmp: Path,
        final: Path,
        everyone: list[Any],
        milestones: tuple[str, ...] = (),
    ) -> None:
        files: dict[str, dict[str, Any]] = {}
        for r in everyone:
            files.update(r["files"])
        dcp_dir = tmp / "dcp"
        if dcp_dir.is_dir():
            # DCP's own metadata (and any file no rank claimed) is hashed here, by rank 0.
            for entry in sorted(os.listdir(dcp_dir)):
                rel = f"dcp/{entry}"
                if rel not in files:
                    size, digest = hash_file(dcp_dir / entry)
                    files[rel] = {"size": size, "sha256": digest}
            fsync_dir(dcp_dir)
        # Deltas are written without a process group only (one rank): its link is the link.
        link = everyone[0].get("delta") if len(everyone) == 1 else None
        fmt = "dcp" if dcp_dir.is_dir() else (DELTA_FORMAT if link else "tensors")
        extra = self._extra(milestones)
        if link:
            extra["delta"] = link
        manifest = Manifest(
            step=step,
            world_size=self.coord.world_size,
            format=fmt,
            files=files,
            created_at=self.clock.now(),
            loss_finite=True,
            trainguard_version=self.version,
            request_id=request_id,
            job=self.job,
            extra=extra,
        )
        write_manifest(tmp, manifest)
        commit_dir(tmp, final)

    def _extra(self, milestones: tuple[str, ...]) -> dict[str, Any]:
        """The manifest's `extra`: provenance (which attempt wrote it; the fence itself is the
        EPOCH file), the job's retention policy (so trainguard-ckpt shows the tiers the job
        keeps) and the milestones marked for this checkpoint."""
        extra: dict[str, Any] = {"retention": self.retention.to_json()}
        if self.epoch is not None:
            extra["epoch"] = self.epoch
        if milestones:
            extra["milestones"] = sorted(set(milestones))
        return extra

    def _after_commit(self, step: int, final: Path) -> None:
        now = self.clock.now()
        with contextlib.suppress(Exception):
            apply_retention(self.ckpt_dir, policy=self.retention, now=now, newest_good_step=step)
        if self.s3 is not None:
            self._upload(step, final, now)
        if self.replicator is not None:
            # Its own thread copies it: the next save never waits for the second region.
            self.replicator.submit(step=step, directory=final, committed_at=now)

    def _upload(self, step: int, final: Path, now: float) -> None:
        assert self.s3 is not None
        try:
            self.s3.upload(final)
        except Exception as e:
            log.error(
                "event=checkpoint_upload_failed job=%s step=%d reason=%s",
                self.job,
                step,
                str(e).replace(" ", "_"),
            )
            return
        # Only after this upload succeeded: the bucket then holds the newest copy.
        try:
            self.s3.apply_retention(policy=self.retention, now=now, newest_step=step)
        except Exception as e:
            log.error(
                "event=checkpoint_remote_retention_failed job=%s step=%d reason=%s",
                self.job,
                step,
                str(e).replace(" ", "_"),
            )
