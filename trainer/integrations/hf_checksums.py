"""Checksums of an HF Trainer checkpoint (`checkpoint-N`): written after its save, verified
before a resume. No transformers here: the example and the tests use it without the callback.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from trainguard.trainer.manifest import fsync_dir, hash_file

__all__ = ["CHECKSUMS_NAME", "newest_verified_checkpoint", "verify_checkpoint", "write_checksums"]

log = logging.getLogger("trainguard.trainer")

# Written into each checkpoint-N directory after the Trainer's save: {file: {size, sha256}}
CHECKSUMS_NAME = "trainguard-checksums.json"
_CHECKSUMS_VERSION = 1
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


def write_checksums(directory: Path, *, step: int) -> int:
    """Record size and sha256 of every file under `directory` (a finished `checkpoint-N`) in
    CHECKSUMS_NAME, durably and atomically (temporary file, fsync, rename, directory fsync).
    Returns the bytes recorded."""
    files: dict[str, dict[str, Any]] = {}
    total = 0
    for path in sorted(directory.rglob("*")):
        if not path.is_file() or path.name.startswith(CHECKSUMS_NAME):
            continue
        size, sha256 = hash_file(path)
        files[path.relative_to(directory).as_posix()] = {"size": size, "sha256": sha256}
        total += size
    raw = json.dumps(
        {"version": _CHECKSUMS_VERSION, "step": step, "files": files}, indent=1, sort_keys=True
    ).encode()
    tmp = directory / f"{CHECKSUMS_NAME}.tmp"
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / CHECKSUMS_NAME)
    fsync_dir(directory)
    return total


def verify_checkpoint(directory: Path) -> str | None:
    """None when every file recorded in `directory`'s checksums is there with its size and
    sha256; else the reason it must not be loaded."""
    try:
        recorded = json.loads((directory / CHECKSUMS_NAME).read_text())
        files = recorded["files"]
        step = recorded["step"]
    except FileNotFoundError:
        return f"no {CHECKSUMS_NAME} (the save did not finish, or was not made under trainguard)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{CHECKSUMS_NAME} unreadable: {e}"
    m = _CHECKPOINT_DIR.match(directory.name)
    if m is None or int(m.group(1)) != step:
        return f"{CHECKSUMS_NAME} is of step {step}"
    for name, want in sorted(files.items()):
        try:
            size, sha256 = hash_file(directory / name)
        except OSError as e:
            return f"{name}: {e.strerror or e}"
        if size != want["size"]:
            return f"{name}: size {size}, recorded {want['size']}"
        if sha256 != want["sha256"]:
            return f"{name}: sha256 mismatch"
    return None


def newest_verified_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest `checkpoint-N` under `output_dir` whose files verify (pass it to
    `trainer.train(resume_from_checkpoint=...)`), or None. Each newer one that does not
    verify is skipped with a WARNING naming the reason."""
    root = Path(output_dir)
    found: list[tuple[int, Path]] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in root.iterdir():
            m = _CHECKPOINT_DIR.match(entry.name)
            if m is not None and entry.is_dir():
                found.append((int(m.group(1)), entry))
    for step, directory in sorted(found, reverse=True):
        reason = verify_checkpoint(directory)
        if reason is None:
            log.info("event=checkpoint_verified step=%d path=%s integration=hf", step, directory)
            return str(directory)
        log.warning(
            "event=checkpoint_skipped step=%d path=%s reason=%s: resuming from an older one",
            step,
            directory,
            reason.replace(" ", "_"),
        )
    return None
