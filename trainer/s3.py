"""Optional S3 copy of committed checkpoints (boto3, imported here and only when configured).

Upload: every file of a committed checkpoint, `manifest.json` last, so an object listing that
has the manifest has the whole checkpoint. Download: the newest remote checkpoint whose
manifest exists, into a temporary local directory that the caller verifies and commits.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.trainer.manifest import MANIFEST_NAME, read_manifest

__all__ = ["S3Config", "S3Store"]

log = logging.getLogger("trainguard.trainer")
_STEP_PREFIX = re.compile(r"step_(\d{6,})/$")


@dataclass(frozen=True)
class S3Config:
    """Where checkpoints are copied. Credentials come from the usual boto3 chain (env, profile,
    instance role); they are never part of this config and never logged."""

    bucket: str
    prefix: str = "trainguard"
    endpoint_url: str | None = None  # for S3-compatible stores (MinIO, a local test server)
    region_name: str | None = None

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ValueError("S3Config.bucket must not be empty")


class S3Store:
    def __init__(self, config: S3Config) -> None:
        import boto3  # noqa: PLC0415 - lazy: only jobs that configure S3 need boto3

        self.config = config
        self._client: Any = boto3.client(
            "s3", endpoint_url=config.endpoint_url, region_name=config.region_name
        )

    def _key(self, *parts: str) -> str:
        prefix = self.config.prefix.strip("/")
        return "/".join(p for p in (prefix, *parts) if p)

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
        log.info(
            "event=checkpoint_uploaded step=%d bucket=%s key=%s",
            manifest.step,
            self.config.bucket,
            self._key(directory.name),
        )

    def remote_steps(self) -> list[int]:
        """Steps with a manifest in the bucket, newest first."""
        steps: list[int] = []
        paginator = self._client.get_paginator("list_objects_v2")
        base = self._key() + "/" if self.config.prefix.strip("/") else ""
        for page in paginator.paginate(Bucket=self.config.bucket, Prefix=base, Delimiter="/"):
            for cp in page.get("CommonPrefixes", []):
                m = _STEP_PREFIX.search(cp["Prefix"])
                if m is None:
                    continue
                step = int(m.group(1))
                head_key = self._key(f"step_{step:06d}", MANIFEST_NAME)
                try:
                    self._client.head_object(Bucket=self.config.bucket, Key=head_key)
                except self._client.exceptions.ClientError:
                    continue
                steps.append(step)
        steps.sort(reverse=True)
        return steps

    def download(self, step: int, dest: Path) -> None:
        """Fetch checkpoint `step` into `dest` (manifest first, then the files it lists)."""
        name = f"step_{step:06d}"
        dest.mkdir(parents=True, exist_ok=True)
        self._client.download_file(
            self.config.bucket, self._key(name, MANIFEST_NAME), str(dest / MANIFEST_NAME)
        )
        manifest = read_manifest(dest)
        for fname in sorted(manifest.files):
            target = dest / fname
            target.parent.mkdir(parents=True, exist_ok=True)
            self._client.download_file(self.config.bucket, self._key(name, fname), str(target))
        log.info("event=checkpoint_downloaded step=%d bucket=%s", step, self.config.bucket)
