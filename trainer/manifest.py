"""Checkpoint directories on disk: naming, checksums, the manifest, commit, verify, retention.

Layout under `ckpt_dir`:

    step_000020.tmp-<nonce>/   being written (never loaded; removed at the next start)
    step_000020/               committed: one atomic rename of the whole directory
        manifest.json          step, world size, format, {file: {size, sha256}}, ...
        rank_00000.pt ...      per-rank state (torch.save of tensors/primitives only)
        dcp/...                sharded tensors (torch.distributed.checkpoint), distributed only
        tensors_00000.bin      raw tensors, one file per rank (format "tensors": a full one)
        delta_00000.bin        or: tensors encoded against a base (format "delta")

A delta checkpoint's manifest names its base (`extra.delta`: the base's step and the sha256
of the base's manifest); it is good only when its base is good too (`verify_link`).

"latest" is the newest committed directory whose manifest and every listed file verify.
No torch in here: this module is shared by the writer thread, the loader and the tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from trainguard.trainer.retention import CheckpointInfo, RetentionPolicy, select

__all__ = [
    "MANIFEST_NAME",
    "DELTA_FORMAT",
    "CheckpointInvalid",
    "DeltaLink",
    "ForeignCheckpoint",
    "HashingWriter",
    "Manifest",
    "apply_retention",
    "check_job",
    "checkpoint_info",
    "clean_stale",
    "commit_dir",
    "find_latest_good",
    "fsync_dir",
    "hash_file",
    "info_of",
    "delta_link",
    "list_committed",
    "manifest_milestones",
    "manifest_sha256",
    "new_tmp_dir",
    "parse_manifest",
    "read_manifest",
    "step_dir_name",
    "verify_dir",
    "verify_link",
    "write_manifest",
]

log = logging.getLogger("trainguard.trainer")

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_STALE = re.compile(r"^step_\d{6,}\.(tmp|replaced)-[0-9a-f]+$")
_CHUNK_BYTES = 8 << 20


class CheckpointInvalid(Exception):
    """A checkpoint that must not be loaded; `file` names the offending file."""

    def __init__(self, file: str, reason: str) -> None:
        self.file = file
        self.reason = reason
        super().__init__(f"{file}: {reason}")


class ForeignCheckpoint(Exception):
    """A checkpoint written by another job: never loaded, whatever else is right with it."""

    def __init__(self, where: str, *, theirs: str, ours: str) -> None:
        self.where = where
        self.theirs = theirs
        self.ours = ours
        super().__init__(
            f"{where}: checkpoint of job {theirs!r}, this run is job {ours!r}; refusing to load "
            f"another job's state. Give this job its own ckpt_dir (and S3 prefix), or run it "
            f"under the name {theirs!r} (job= or TRAINGUARD_JOB) if it is that job"
        )


@dataclass(frozen=True)
class Manifest:
    step: int
    world_size: int
    # "tensors": a raw tensor file per rank; "delta": a delta file per rank against a base
    # (extra.delta); "dcp": dcp/ shards + rank_*.pt skeletons
    format: str
    files: dict[str, dict[str, Any]]  # relative path -> {"size": int, "sha256": hex}
    created_at: float
    loss_finite: bool
    trainguard_version: str
    request_id: str | None = None
    job: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "manifest_version": MANIFEST_VERSION,
            "step": self.step,
            "world_size": self.world_size,
            "format": self.format,
            "files": self.files,
            "created_at": self.created_at,
            "loss_finite": self.loss_finite,
            "trainguard_version": self.trainguard_version,
            "request_id": self.request_id,
            "job": self.job,
            "extra": self.extra,
        }


# `torchrun --standalone` makes up a new uuid4 run id for every launch; a job named by it has no
# name that lasts from one launch to the next.
_LAUNCH_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def check_job(manifest: Manifest, *, job: str, where: str) -> None:
    """Raise `ForeignCheckpoint` if `manifest` names another job. Not compared: a manifest
    without a job (written before manifests recorded it) and a name that is torchrun's
    per-launch uuid4 on either side (a job started with `--standalone` and no name)."""
    theirs = manifest.job
    if not theirs or theirs == job or _LAUNCH_UUID.fullmatch(theirs) or _LAUNCH_UUID.fullmatch(job):
        return
    raise ForeignCheckpoint(where, theirs=theirs, ours=job)


DELTA_FORMAT = "delta"


@dataclass(frozen=True)
class DeltaLink:
    """A delta checkpoint's link to its base (the manifest's `extra.delta`). Every delta is
    encoded against one full checkpoint, its base, so its parent is its base and a chain is
    one link deep: a corrupt delta loses itself only, a corrupt base loses its deltas."""

    base_step: int
    parent_step: int
    base_manifest_sha256: str
    index: int  # this delta's position after its base: 1, 2, ... (full_every counts them)
    codec: str

    def to_json(self) -> dict[str, Any]:
        return {
            "base_step": self.base_step,
            "parent_step": self.parent_step,
            "base_manifest_sha256": self.base_manifest_sha256,
            "index": self.index,
            "codec": self.codec,
        }


def delta_link(manifest: Manifest, *, where: str = "") -> DeltaLink | None:
    """The base link of a delta checkpoint; None for a full one; CheckpointInvalid when a
    delta's link is malformed."""
    if manifest.format != DELTA_FORMAT:
        return None
    raw = manifest.extra.get("delta")
    try:
        if not isinstance(raw, dict):
            raise TypeError("extra.delta missing")
        link = DeltaLink(
            base_step=int(raw["base_step"]),
            parent_step=int(raw["parent_step"]),
            base_manifest_sha256=str(raw["base_manifest_sha256"]),
            index=int(raw["index"]),
            codec=str(raw["codec"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointInvalid(where or f"step {manifest.step}", f"bad delta link: {e}") from None
    if not 0 <= link.base_step < manifest.step or link.parent_step != link.base_step:
        raise CheckpointInvalid(where or f"step {manifest.step}", "bad delta link: base step")
    return link


def manifest_sha256(directory: Path) -> str:
    """sha256 of a committed directory's manifest.json (what a delta's link records)."""
    return hash_file(directory / MANIFEST_NAME)[1]


def verify_link(
    ckpt_dir: Path, manifest: Manifest, *, verified: dict[int, str] | None = None
) -> None:
    """For a delta: its base is committed, verifies, is a full checkpoint and is the very one
    the delta was written against (its manifest's sha256). CheckpointInvalid naming the base
    otherwise. `verified`: base step -> manifest sha256 of bases verified already (a cache)."""
    link = delta_link(manifest)
    if link is None:
        return
    base_dir = ckpt_dir / step_dir_name(link.base_step)
    where = f"base {base_dir}"
    digest = verified.get(link.base_step) if verified is not None else None
    if digest is None:
        try:
            base = verify_dir(base_dir, expected_step=link.base_step)
        except CheckpointInvalid as e:
            raise CheckpointInvalid(e.file, f"base step {link.base_step}: {e.reason}") from None
        if base.format != "tensors":
            raise CheckpointInvalid(where, f"not a full checkpoint (format {base.format!r})")
        try:
            digest = manifest_sha256(base_dir)
        except OSError as e:
            raise CheckpointInvalid(where, f"unreadable: {e}") from None
        if verified is not None:
            verified[link.base_step] = digest
    if digest != link.base_manifest_sha256:
        raise CheckpointInvalid(where, "manifest differs from the one the delta was written on")


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def new_tmp_dir(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"


class HashingWriter:
    """A write-only file object that hashes what passes through it (one pass over the bytes)."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f
        self._h = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._h.update(data)
        n = self._f.write(data)
        self.size += len(data)
        return n if n is not None else len(data)

    def flush(self) -> None:
        self._f.flush()

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def hash_file(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK_BYTES)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    """Write manifest.json durably (file fsync + directory fsync)."""
    raw = json.dumps(manifest.to_json(), indent=1, sort_keys=True, allow_nan=False).encode()
    path = directory / MANIFEST_NAME
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(directory)


def commit_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Publish `tmp_dir` as `final_dir` with one rename, then make the rename durable.

    If `final_dir` already exists (the same step checkpointed again after a rollback), it is
    first renamed aside; a crash in between leaves the older checkpoints as "latest".
    """
    parent = final_dir.parent
    replaced: Path | None = None
    if final_dir.exists():
        replaced = parent / f"{final_dir.name}.replaced-{secrets.token_hex(4)}"
        os.rename(final_dir, replaced)
    os.rename(tmp_dir, final_dir)
    fsync_dir(parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)


def list_committed(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Committed step directories, newest first (validity not checked)."""
    out: list[tuple[int, Path]] = []
    try:
        entries = list(os.scandir(ckpt_dir))
    except FileNotFoundError:
        return out
    for e in entries:
        m = _STEP_DIR.match(e.name)
        if m and e.is_dir(follow_symlinks=False):
            out.append((int(m.group(1)), Path(e.path)))
    out.sort(key=lambda x: x[0], reverse=True)
    return out


def read_manifest(directory: Path) -> Manifest:
    path = directory / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointInvalid(str(path), "manifest missing") from None
    except OSError as e:
        raise CheckpointInvalid(str(path), f"unreadable: {e.strerror or e}") from None
    return parse_manifest(raw, where=str(path))


def parse_manifest(raw: bytes, *, where: str) -> Manifest:
    """A manifest from its bytes (a file, an S3 object); CheckpointInvalid naming `where`."""
    path = where
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointInvalid(path, f"not valid JSON: {e}") from None
    try:
        if data.get("manifest_version") != MANIFEST_VERSION:
            raise CheckpointInvalid(
                path, f"unsupported manifest_version {data.get('manifest_version')!r}"
            )
        files = data["files"]
        if not isinstance(files, dict) or not files:
            raise CheckpointInvalid(path, "files: empty or not a mapping")
        for name, meta in files.items():
            if (
                not isinstance(meta, dict)
                or not isinstance(meta.get("size"), int)
                or not isinstance(meta.get("sha256"), str)
                or os.path.isabs(name)
                or ".." in Path(name).parts
            ):
                raise CheckpointInvalid(path, f"files[{name!r}]: malformed entry")
        return Manifest(
            step=int(data["step"]),
            world_size=int(data["world_size"]),
            format=str(data["format"]),
            files=files,
            created_at=float(data["created_at"]),
            loss_finite=bool(data["loss_finite"]),
            trainguard_version=str(data["trainguard_version"]),
            request_id=data.get("request_id"),
            job=str(data.get("job", "")),
            extra=dict(data.get("extra") or {}),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, CheckpointInvalid):
            raise
        raise CheckpointInvalid(path, f"malformed manifest: {e!r}") from None


def verify_dir(directory: Path, *, expected_step: int | None = None) -> Manifest:
    """Read the manifest and check every listed file's size and sha256; raise CheckpointInvalid."""
    manifest = read_manifest(directory)
    if expected_step is not None and manifest.step != expected_step:
        raise CheckpointInvalid(
            str(directory / MANIFEST_NAME),
            f"manifest step {manifest.step} does not match directory step {expected_step}",
        )
    if not manifest.loss_finite:
        raise CheckpointInvalid(str(directory / MANIFEST_NAME), "state was not finite")
    for name, meta in sorted(manifest.files.items()):
        path = directory / name
        try:
            size, digest = hash_file(path)
        except FileNotFoundError:
            raise CheckpointInvalid(str(path), "listed in manifest but missing") from None
        except OSError as e:
            raise CheckpointInvalid(str(path), f"unreadable: {e.strerror or e}") from None
        if size != meta["size"]:
            raise CheckpointInvalid(str(path), f"size {size} != manifest size {meta['size']}")
        if digest != meta["sha256"]:
            raise CheckpointInvalid(str(path), "sha256 mismatch")
    return manifest


def iter_good(
    ckpt_dir: Path, *, skipped: list[tuple[int, CheckpointInvalid]] | None = None
) -> Iterator[tuple[int, Path, Manifest]]:
    """Committed checkpoints that verify, newest first, a delta only with its base (every
    link of its chain); bad ones are logged, appended to `skipped` and passed over."""
    bases: dict[int, str] = {}
    for step, path in list_committed(ckpt_dir):
        try:
            manifest = verify_dir(path, expected_step=step)
            verify_link(ckpt_dir, manifest, verified=bases)
        except CheckpointInvalid as e:
            if skipped is not None:
                skipped.append((step, e))
            log.warning(
                "event=checkpoint_skipped step=%d dir=%s file=%s reason=%s",
                step,
                path,
                e.file,
                e.reason.replace(" ", "_"),
            )
            continue
        yield step, path, manifest


def find_latest_good(
    ckpt_dir: Path, *, skipped: list[tuple[int, CheckpointInvalid]] | None = None
) -> tuple[int, Path, Manifest] | None:
    return next(iter_good(ckpt_dir, skipped=skipped), None)


def checkpoint_info(step: int, directory: Path) -> CheckpointInfo:
    """What retention needs of a committed directory (its manifest unread or bad: no time)."""
    try:
        manifest = read_manifest(directory)
    except CheckpointInvalid:
        return CheckpointInfo(step=step, created_at=None)
    return info_of(manifest, step=step)


def info_of(manifest: Manifest, *, step: int | None = None) -> CheckpointInfo:
    """What retention needs of a manifest (its step, time, milestones and delta base)."""
    try:
        link = delta_link(manifest)
    except CheckpointInvalid:
        link = None
    return CheckpointInfo(
        step=manifest.step if step is None else step,
        created_at=manifest.created_at,
        milestones=manifest_milestones(manifest),
        base_step=link.base_step if link is not None else None,
    )


def manifest_milestones(manifest: Manifest) -> tuple[str, ...]:
    """The milestone names a manifest carries (`extra.milestones`); malformed ones ignored."""
    names = manifest.extra.get("milestones")
    if not isinstance(names, list):
        return ()
    return tuple(n for n in names if isinstance(n, str))


def apply_retention(
    ckpt_dir: Path,
    *,
    policy: RetentionPolicy,
    now: float,
    newest_good_step: int,
    dry_run: bool = False,
) -> list[Path]:
    """Delete the committed checkpoints no tier of `policy` keeps (trainer/retention.py);
    never `newest_good_step` or anything newer. Returns what it deleted (`dry_run`: what it
    would delete, deleting nothing).

    Called only after a newer checkpoint committed (or verified), so an older one is never the
    last copy.
    """
    removed: list[Path] = []
    if policy.keeps_all:
        return removed
    committed = list_committed(ckpt_dir)
    tiers = select(
        policy=policy,
        checkpoints=[checkpoint_info(step, path) for step, path in committed],
        now=now,
        newest_good_step=newest_good_step,
    )
    for step, path in committed:
        if tiers[step] or step >= newest_good_step:
            continue
        removed.append(path)
        if dry_run:
            continue
        shutil.rmtree(path, ignore_errors=True)
        log.info("event=checkpoint_deleted step=%d dir=%s reason=retention", step, path)
    return removed


def clean_stale(ckpt_dir: Path, *, older_than_s: float = 0.0) -> list[Path]:
    """Remove leftover temporary / replaced directories (a crash mid-write leaves them)."""
    removed: list[Path] = []
    now = time.time()
    try:
        entries = list(os.scandir(ckpt_dir))
    except FileNotFoundError:
        return removed
    for e in entries:
        if _STALE.match(e.name) and e.is_dir(follow_symlinks=False):
            with contextlib.suppress(OSError):
                if now - e.stat().st_mtime < older_than_s:
                    continue
                shutil.rmtree(e.path)
                removed.append(Path(e.path))
                log.info("event=checkpoint_stale_removed dir=%s", e.path)
    return removed
