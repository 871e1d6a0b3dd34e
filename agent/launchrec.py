"""Launch records: what a restarted agent needs to re-adopt the jobs it launched.

One small JSON file per launch in the agent's state directory (`<jobs.work_dir>/launches/`),
written atomically before the start is acknowledged and removed once the launch's exit has
been reported. A record names the launch leader (the jobwrap process) by pid *and* its start
time from `/proc/<pid>/stat`, so a pid the kernel handed to another process is never taken
for the job. A record that cannot be read or decoded is logged and ignored, never fatal.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "RECORD_VERSION",
    "LaunchRecord",
    "load_records",
    "proc_start_ticks",
    "remove_record",
    "write_record",
]

log = logging.getLogger("trainguard.agent.launchrec")

RECORD_VERSION = 1
_SUFFIX = ".launch.json"
_MAX_RECORD_BYTES = 256 * 1024  # a start_job's args are bounded well below this


@dataclass(frozen=True)
class LaunchRecord:
    """One launch of one attempt of a job on this node."""

    job: str
    attempt: int
    launch_id: str  # the TRAINGUARD_LAUNCH_ID marker in every process of the launch
    pid: int  # the launch leader (the jobwrap process)
    start_ticks: int  # field 22 of /proc/<pid>/stat: clock ticks after boot
    pgid: int
    log_path: str
    log_offset: int  # where this launch's output begins in the (appended) log
    status_path: str  # written by the wrapper when the command has ended
    started_at: float  # unix time of the launch
    unit: str | None = None  # the transient systemd unit, where systemd runs the launch
    spec: dict[str, Any] = field(default_factory=dict)  # the start_job arguments
    v: int = RECORD_VERSION

    @property
    def file_name(self) -> str:
        return f"{self.job}-{self.attempt}-{self.launch_id}{_SUFFIX}"


def proc_start_ticks(pid: int, *, proc_root: str = "/proc") -> int | None:
    """The process's start time (clock ticks after boot), or None when it is gone or a
    zombie (it has exited: only its parent's wait is missing)."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    # fields[0] is field 3 (state); starttime is field 22
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except ValueError:
        return None


def write_record(directory: Path, record: LaunchRecord) -> Path:
    """Write `record` atomically (temporary file, fsync, rename, fsync of the directory);
    mode 0600 (it holds the job's start arguments). Raises OSError."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / record.file_name
    tmp = directory / f".{record.file_name}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(asdict(record), sort_keys=True).encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return path


def remove_record(directory: Path, record: LaunchRecord) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory / record.file_name).unlink()


def _decode(raw: bytes) -> LaunchRecord:
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    if data.get("v") != RECORD_VERSION:
        raise ValueError(f"unknown record version {data.get('v')!r}")
    ints = ("attempt", "pid", "start_ticks", "pgid", "log_offset")
    strs = ("job", "launch_id", "log_path", "status_path")
    for name in ints:
        if not isinstance(data.get(name), int) or isinstance(data.get(name), bool):
            raise ValueError(f"{name}: expected an integer")
    for name in strs:
        if not isinstance(data.get(name), str) or not data[name]:
            raise ValueError(f"{name}: expected a non-empty string")
    if data["pid"] <= 1 or data["pgid"] <= 1:
        raise ValueError("pid/pgid: expected a process id above 1")
    if not isinstance(data.get("started_at"), int | float):
        raise ValueError("started_at: expected a number")
    unit = data.get("unit")
    if unit is not None and not isinstance(unit, str):
        raise ValueError("unit: expected a string or null")
    spec = data.get("spec", {})
    if not isinstance(spec, dict):
        raise ValueError("spec: expected an object")
    known = set(LaunchRecord.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown keys {unknown}")
    return LaunchRecord(**{**data, "started_at": float(data["started_at"])})


def load_records(directory: Path) -> list[LaunchRecord]:
    """Every readable record in `directory`, oldest launch first. A record that cannot be
    read or decoded is logged (event=launch_record_bad) and ignored; leftover temporary
    files of an interrupted write are removed."""
    try:
        entries = sorted(directory.iterdir())
    except FileNotFoundError:
        return []
    except OSError as e:
        log.error("event=launch_records_unreadable dir=%s reason=%r", directory, str(e))
        return []
    out = []
    for path in entries:
        if path.name.startswith(".") and ".tmp." in path.name:
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        if not path.name.endswith(_SUFFIX):
            continue
        try:
            with path.open("rb") as f:
                raw = f.read(_MAX_RECORD_BYTES + 1)
            if len(raw) > _MAX_RECORD_BYTES:
                raise ValueError(f"larger than {_MAX_RECORD_BYTES} bytes")
            record = _decode(raw)
            if record.file_name != path.name:
                raise ValueError(f"its contents name another launch ({record.file_name})")
        except (OSError, ValueError, TypeError) as e:
            log.warning("event=launch_record_bad path=%s reason=%r", path, str(e))
            continue
        out.append(record)
    out.sort(key=lambda r: (r.started_at, r.file_name))
    return out
