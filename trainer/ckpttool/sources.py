"""Where trainguard-ckpt reads checkpoints: a local checkpoint directory or an S3 prefix.

Both go through the trainer's own code: manifest.py (list, read, verify, retention) and s3.py
(list, download, retention), so the tool sees, verifies and prunes exactly as the trainer does.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from trainguard.trainer.manifest import (
    MANIFEST_NAME,
    CheckpointInvalid,
    Manifest,
    apply_retention,
    delta_link,
    list_committed,
    read_manifest,
    step_dir_name,
    verify_dir,
    verify_link,
)
from trainguard.trainer.retention import RetentionPolicy
from trainguard.trainer.s3 import S3Config, S3Store

__all__ = ["Entry", "LocalSource", "S3Source", "Source", "open_source"]


@dataclass(frozen=True)
class Entry:
    """One checkpoint as listed: its manifest, or what is wrong with it."""

    step: int
    where: str
    manifest: Manifest | None
    problem: str = ""  # "<file>: <reason>" when the manifest is missing or malformed

    @property
    def size_bytes(self) -> int:
        if self.manifest is None:
            return 0
        return sum(int(meta["size"]) for meta in self.manifest.files.values())


class Source(Protocol):
    where: str

    def entries(self) -> list[Entry]:
        """Every checkpoint, complete or not, newest first."""
        ...

    def verify(self, step: int) -> Manifest:
        """Every file of `step` against its manifest, and for a delta every link of its chain
        (its base verifies and is the one it was written on); CheckpointInvalid naming the
        file."""
        ...

    def fetch(self, step: int) -> contextlib.AbstractContextManager[Path]:
        """A local, verified copy of `step` for as long as the context lasts (a delta's base
        beside it, in the sibling directory its manifest names)."""
        ...

    def prune(
        self, *, policy: RetentionPolicy, now: float, newest_good_step: int, dry_run: bool
    ) -> list[int]:
        """The trainer's own retention with `policy`; the steps deleted (or to delete)."""
        ...


class LocalSource:
    def __init__(self, ckpt_dir: Path) -> None:
        self.ckpt_dir = ckpt_dir.absolute()
        self.where = str(self.ckpt_dir)
        if not self.ckpt_dir.is_dir():
            raise CheckpointInvalid(self.where, "no such checkpoint directory")

    def entries(self) -> list[Entry]:
        out: list[Entry] = []
        for step, path in list_committed(self.ckpt_dir):
            try:
                out.append(Entry(step=step, where=str(path), manifest=read_manifest(path)))
            except CheckpointInvalid as e:
                out.append(Entry(step=step, where=str(path), manifest=None, problem=str(e)))
        return out

    def _dir(self, step: int) -> Path:
        path = self.ckpt_dir / step_dir_name(step)
        if not path.is_dir():
            raise CheckpointInvalid(str(path), f"no checkpoint of step {step}")
        return path

    def verify(self, step: int) -> Manifest:
        manifest = verify_dir(self._dir(step), expected_step=step)
        verify_link(self.ckpt_dir, manifest)
        return manifest

    @contextlib.contextmanager
    def fetch(self, step: int) -> Iterator[Path]:
        self.verify(step)
        yield self._dir(step)

    def prune(
        self, *, policy: RetentionPolicy, now: float, newest_good_step: int, dry_run: bool
    ) -> list[int]:
        gone = apply_retention(
            self.ckpt_dir,
            policy=policy,
            now=now,
            newest_good_step=newest_good_step,
            dry_run=dry_run,
        )
        return sorted((int(p.name.removeprefix("step_")) for p in gone), reverse=True)


class S3Source:
    """`s3://bucket/prefix`: the prefix a job's checkpoints live under (`trainguard/<job>`
    by default, see docs/trainer.md)."""

    def __init__(
        self, url: str, *, endpoint_url: str | None = None, region_name: str | None = None
    ) -> None:
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        if not bucket:
            raise CheckpointInvalid(url, "no bucket (s3://BUCKET/PREFIX)")
        self.where = f"s3://{bucket}/{prefix.strip('/')}"
        config = S3Config(
            bucket=bucket,
            prefix=prefix.strip("/"),
            endpoint_url=endpoint_url,
            region_name=region_name,
        )
        self.store = S3Store(config, job="")
        self.bucket = bucket

    def _where(self, step: int) -> str:
        return f"{self.where.rstrip('/')}/{step_dir_name(step)}"

    def entries(self) -> list[Entry]:
        out: list[Entry] = []
        for step in self.store.listed_steps():
            where = self._where(step)
            if not self.store.has_manifest(step):
                problem = f"{where}/{MANIFEST_NAME}: manifest missing (an incomplete upload)"
                out.append(Entry(step=step, where=where, manifest=None, problem=problem))
                continue
            try:
                out.append(Entry(step=step, where=where, manifest=self.store.manifest(step)))
            except CheckpointInvalid as e:
                out.append(Entry(step=step, where=where, manifest=None, problem=str(e)))
        return out

    def _download(self, step: int, dest: Path) -> Manifest:
        if not self.store.has_manifest(step):
            raise CheckpointInvalid(
                f"{self._where(step)}/{MANIFEST_NAME}", "manifest missing (no such checkpoint)"
            )
        try:
            self.store.download(step, dest, any_job=True)
        except CheckpointInvalid:
            raise
        except Exception as e:  # boto3's ClientError: a listed file is not in the bucket
            raise CheckpointInvalid(self._where(step), f"download failed: {e}") from None
        manifest = verify_dir(dest, expected_step=step)
        link = delta_link(manifest, where=self._where(step))
        if link is not None:  # the base beside it, then the link between them
            self._download(link.base_step, dest.parent / step_dir_name(link.base_step))
            verify_link(dest.parent, manifest)
        return manifest

    def verify(self, step: int) -> Manifest:
        with self.fetch(step) as directory:
            return read_manifest(directory)

    @contextlib.contextmanager
    def fetch(self, step: int) -> Iterator[Path]:
        tmp = Path(tempfile.mkdtemp(prefix="trainguard-ckpt-"))
        try:
            self._download(step, tmp / step_dir_name(step))
            yield tmp / step_dir_name(step)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def prune(
        self, *, policy: RetentionPolicy, now: float, newest_good_step: int, dry_run: bool
    ) -> list[int]:
        return self.store.apply_retention(
            policy=policy, now=now, newest_step=newest_good_step, dry_run=dry_run
        )


def open_source(
    location: str, *, endpoint_url: str | None = None, region_name: str | None = None
) -> Source:
    if location.startswith("s3://"):
        try:
            return S3Source(location, endpoint_url=endpoint_url, region_name=region_name)
        except ImportError as e:  # boto3 is the `aws` extra's
            raise CheckpointInvalid(location, f"s3:// needs boto3 (the aws extra): {e}") from None
    return LocalSource(Path(location))
