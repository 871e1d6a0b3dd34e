"""Optional S3 copy of committed checkpoints (boto3, imported here and only when configured).

Upload: every file of a committed checkpoint, `manifest.json` last, so an object listing that
has the manifest has the whole checkpoint. Retention: after an upload, the bucket keeps what
the job's retention policy keeps (trainer/retention.py, as on disk); an older checkpoint loses
its manifest first, so a deletion cut short never leaves something that looks complete.
Read-back (`verify_remote`): every object of a checkpoint against its manifest's sizes and
checksums, as the second-region replica (trainer/replica.py) checks each copy.
Download: the newest remote checkpoint whose manifest exists, into a temporary local
directory that the caller verifies and commits; a manifest of another job stops the download
before any other file is fetched. Keys live under `prefix`, by default `trainguard/<job>`, so
jobs sharing a bucket never see each other's checkpoints.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.trainer.manifest import (
    MANIFEST_NAME,
    CheckpointInvalid,
    Manifest,
    check_job,
    info_of,
    parse_manifest,
    read_manifest,
)
from trainguard.trainer.retention import CheckpointInfo, RetentionPolicy, select

__all__ = ["S3Config", "S3Store"]

log = logging.getLogger("trainguard.trainer")
_STEP_PREFIX = re.compile(r"step_(\d{6,})/$")
_DELETE_BATCH = 1000  # DeleteObjects takes at most 1,000 keys
_READ_CHUNK_BYTES = 8 * 1024 * 1024  # a read-back's hashing streams: memory stays bounded


def default_prefix(job: str) -> str:
    """`trainguard/<job>`, the job name made key-safe."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job) or "default"
    return f"trainguard/{safe}"


@dataclass(frozen=True)
class S3Config:
    """Where checkpoints are copied. Credentials come from the usual boto3 chain (env, profile,
    instance role); they are never part of this config and never logged."""

    bucket: str
    prefix: str | None = None  # None: trainguard/<job>, one place per job
    endpoint_url: str | None = None  # for S3-compatible stores (MinIO, a local test server)
    region_name: str | None = None

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("S3Config.bucket must not be empty")


class S3Store:
    def __init__(self, config: S3Config, *, job: str) -> None:
        import boto3  # noqa: PLC0415 - lazy: only jobs that configure S3 need boto3

        self.config = config
        self.job = job
        self.prefix = (config.prefix if config.prefix is not None else default_prefix(job)).strip(
            "/"
        )
        self._client: Any = boto3.client(
            "s3", endpoint_url=config.endpoint_url, region_name=config.region_name
        )
        # Manifests read for retention, by step: a committed step's manifest does not change
        # (an upload of the same step again replaces the entry).
        self._manifests: dict[int, Manifest] = {}

    def _key(self, *parts: str) -> str:
        return "/".join(p for p in (self.prefix, *parts) if p)

    def upload(self, directory: Path) -> None:
        """Upload a committed checkpoint directory; the manifest goes last."""
        manifest = read_manifest(directory)
        for name in sorted(manifest.files):
            self._client.upload_file(
                str(directory / name), self.config.bucket, self._key(directory.name, name)
            )
        self._client.upload_file(
            str(directory / MANIFEST_NAME),
            self.config.bucket,
            self._key(directory.name, MANIFEST_NAME),
        )
        self._manifests[manifest.step] = manifest
        log.info(
            "event=checkpoint_uploaded step=%d bucket=%s key=%s",
            manifest.step,
            self.config.bucket,
            self._key(directory.name),
        )

    def listed_steps(self) -> list[int]:
        """Every step with any object in the bucket (complete or not), newest first."""
        return self._step_prefixes()

    def has_manifest(self, step: int) -> bool:
        return self._has_manifest(step)

    def _step_prefixes(self) -> list[int]:
        """Every step with any object in the bucket (complete or not), newest first."""
        steps: list[int] = []
        paginator = self._client.get_paginator("list_objects_v2")
        base = self._key() + "/" if self.prefix else ""
        for page in paginator.paginate(Bucket=self.config.bucket, Prefix=base, Delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                m = _STEP_PREFIX.search(cp["Prefix"])
                if m is not None:
                    steps.append(int(m.group(1)))
        steps.sort(reverse=True)
        return steps

    def _has_manifest(self, step: int) -> bool:
        try:
            self._client.head_object(
                Bucket=self.config.bucket, Key=self._key(f"step_{step:06d}", MANIFEST_NAME)
            )
        except self._client.exceptions.ClientError:
            return False
        return True

    def remote_steps(self) -> list[int]:
        """Steps with a manifest in the bucket, newest first."""
        return [s for s in self._step_prefixes() if self._has_manifest(s)]

    def manifest(self, step: int) -> Manifest:
        """The manifest of remote checkpoint `step` (CheckpointInvalid when it is malformed)."""
        cached = self._manifests.get(step)
        if cached is not None:
            return cached
        manifest = self._read_manifest(self._key(f"step_{step:06d}", MANIFEST_NAME))
        self._manifests[step] = manifest
        return manifest

    def _info(self, step: int) -> CheckpointInfo:
        try:
            manifest = self.manifest(step)
        except Exception:  # unreadable or malformed: only the count-based tiers hold it
            return CheckpointInfo(step=step, created_at=None)
        return info_of(manifest, step=step)  # a delta's base included: retention keeps it

    def apply_retention(
        self, *, policy: RetentionPolicy, now: float, newest_step: int, dry_run: bool = False
    ) -> list[int]:
        """Delete the remote checkpoints no tier of `policy` keeps, and incomplete uploads
        older than `newest_step` (a complete upload); never `newest_step` or anything newer.
        Returns the steps deleted (`dry_run`: the steps it would delete, deleting nothing)."""
        if policy.keeps_all:
            return []
        steps = self._step_prefixes()
        complete = [s for s in steps if self._has_manifest(s)]
        if newest_step not in complete:
            return []
        tiers = select(
            policy=policy,
            checkpoints=[self._info(s) for s in complete],
            now=now,
            newest_good_step=newest_step,
        )
        deleted: list[int] = []
        for step in steps:
            if step >= newest_step or tiers.get(step):
                continue
            deleted.append(step)
            if dry_run:
                continue
            self._delete_step(step)
            self._manifests.pop(step, None)
            log.info(
                "event=checkpoint_deleted step=%d bucket=%s key=%s reason=retention",
                step,
                self.config.bucket,
                self._key(f"step_{step:06d}"),
            )
        return deleted

    def _delete_step(self, step: int) -> None:
        name = f"step_{step:06d}"
        manifest_key = self._key(name, MANIFEST_NAME)
        # The manifest first: from then on nothing treats the rest as a checkpoint.
        self._client.delete_object(Bucket=self.config.bucket, Key=manifest_key)
        paginator = self._client.get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=self.config.bucket, Prefix=self._key(name) + "/"):
            keys = [o["Key"] for o in page.get("Contents", [])]
            for i in range(0, len(keys), _DELETE_BATCH):
                batch = [{"Key": k} for k in keys[i : i + _DELETE_BATCH]]
                self._client.delete_objects(
                    Bucket=self.config.bucket, Delete={"Objects": batch, "Quiet": True}
                )

    def verify_remote(self, manifest: Manifest) -> None:
        """Read checkpoint `manifest.step` back from the bucket: every file the manifest lists
        with its size and sha256, and the manifest itself. CheckpointInvalid naming the first
        object that differs or is missing."""
        name = f"step_{manifest.step:06d}"
        bucket = self.config.bucket
        for fname, meta in sorted(manifest.files.items()):
            key = self._key(name, fname)
            where = f"s3://{bucket}/{key}"
            try:
                body = self._client.get_object(Bucket=bucket, Key=key)["Body"]
            except self._client.exceptions.ClientError as e:
                raise CheckpointInvalid(where, f"unreadable: {e}") from None
            digest = hashlib.sha256()
            size = 0
            for chunk in body.iter_chunks(_READ_CHUNK_BYTES):
                digest.update(chunk)
                size += len(chunk)
            if size != int(meta["size"]):
                raise CheckpointInvalid(where, f"size {size}, manifest says {meta['size']}")
            if digest.hexdigest() != meta["sha256"]:
                raise CheckpointInvalid(where, "sha256 differs from the manifest")
        key = self._key(name, MANIFEST_NAME)
        remote = self._read_manifest(key)
        if remote.files != manifest.files or remote.step != manifest.step:
            raise CheckpointInvalid(f"s3://{bucket}/{key}", "differs from the local manifest")

    def _read_manifest(self, key: str) -> Manifest:
        raw = self._client.get_object(Bucket=self.config.bucket, Key=key)["Body"].read()
        return parse_manifest(raw, where=f"s3://{self.config.bucket}/{key}")

    def download(self, step: int, dest: Path, *, any_job: bool = False) -> None:
        """Fetch checkpoint `step` into `dest` (manifest first, then the files it lists);
        `any_job`: no check that it is this store's job's (an operator's tool reading it)."""
        name = f"step_{step:06d}"
        dest.mkdir(parents=True, exist_ok=True)
        self._client.download_file(
            self.config.bucket, self._key(name, MANIFEST_NAME), str(dest / MANIFEST_NAME)
        )
        manifest = read_manifest(dest)
        if not any_job:
            where = f"s3://{self.config.bucket}/{self._key(name)}"
            check_job(manifest, job=self.job, where=where)
        for fname in sorted(manifest.files):
            target = dest / fname
            target.parent.mkdir(parents=True, exist_ok=True)
            self._client.download_file(self.config.bucket, self._key(name, fname), str(target))
        log.info("event=checkpoint_downloaded step=%d bucket=%s", step, self.config.bucket)
