"""The restore drill: a checkpoint from a source (usually the second-region replica) restored
into a checkpoint directory a job resumes from, with proof that it is whole and loadable.

Steps: fetch and verify every file against the manifest (sources.py), decode the model tensors
(export.py, as an export would), commit the copy as `step_<N>/` under `into` with one rename,
and measure what an operator reports: the restored step, its age (the recovery point) and the
restore time.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.trainer.ckpttool.export import ExportError, model_weights
from trainguard.trainer.ckpttool.sources import Source
from trainguard.trainer.manifest import (
    check_job,
    commit_dir,
    new_tmp_dir,
    read_manifest,
    step_dir_name,
    verify_dir,
)

__all__ = ["DrillError", "DrillResult", "restore"]


class DrillError(Exception):
    """The drill failed: the message says where and why."""


@dataclass(frozen=True)
class DrillResult:
    step: int
    path: Path
    job: str | None
    created_at: float
    age_s: float  # now - created_at: how much work a restore from this source loses
    bytes: int
    files: int
    tensors: int
    restore_s: float  # fetch, verify, decode and commit

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "path": str(self.path),
            "ckpt_dir": str(self.path.parent),
            "job": self.job,
            "created_at": self.created_at,
            "age_s": self.age_s,
            "bytes": self.bytes,
            "files": self.files,
            "tensors": self.tensors,
            "restore_s": self.restore_s,
        }


def restore(
    source: Source,
    *,
    step: int,
    into: Path,
    job: str | None,
    now: float,
    max_age_s: float | None = None,
) -> DrillResult:
    """Restore checkpoint `step` of `source` into `into/step_<N>/` and prove it loads."""
    # The restore time is a duration on this machine, not a timestamp: the monotonic clock.
    t0 = time.monotonic()
    final = into.absolute() / step_dir_name(step)
    if final.exists():
        raise DrillError(f"{final}: already exists; restore into an empty directory")
    into.mkdir(parents=True, exist_ok=True)
    with source.fetch(step) as directory:
        manifest = read_manifest(directory)
        where = f"{source.where}: step {step}"
        if job:
            check_job(manifest, job=job, where=where)
        try:
            tensors = len(model_weights(directory, manifest))
        except ExportError as e:
            raise DrillError(f"{where}: the model tensors do not decode: {e}") from None
        tmp = new_tmp_dir(into.absolute(), step)
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(directory, tmp)
    try:
        verify_dir(tmp, expected_step=step)  # the copy on this disk, as a resume will read it
    except Exception:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit_dir(tmp, final)
    age_s = max(0.0, now - manifest.created_at)
    if max_age_s is not None and age_s > max_age_s:
        raise DrillError(
            f"{where}: restored, but it is {age_s:.0f} s old, over --max-age-s {max_age_s:g} "
            "(the replica lags more than the recovery point objective allows)"
        )
    return DrillResult(
        step=step,
        path=final,
        job=manifest.job,
        created_at=manifest.created_at,
        age_s=age_s,
        bytes=sum(int(m["size"]) for m in manifest.files.values()),
        files=len(manifest.files),
        tensors=tensors,
        restore_s=time.monotonic() - t0,
    )
