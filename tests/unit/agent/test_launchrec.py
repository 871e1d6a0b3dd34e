"""Launch records: written atomically and privately, read back whole; a bad record file is
logged and ignored, never a crash; a process's start time tells a reused pid apart."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from trainguard.agent.launchrec import (
    LaunchRecord,
    load_records,
    proc_start_ticks,
    remove_record,
    write_record,
)


def record(**changes: object) -> LaunchRecord:
    base = LaunchRecord(
        job="llm",
        attempt=3,
        launch_id="0123456789abcdef0123456789abcdef",
        pid=4242,
        start_ticks=987654,
        pgid=4242,
        log_path="/var/lib/trainguard/jobs/llm-3.log",
        log_offset=128,
        status_path="/var/lib/trainguard/jobs/launches/llm-3-x.status",
        started_at=1700000000.5,
        unit="trainguard-job-llm-3-01234567.service",
        spec={"job": "llm", "attempt": 3, "command": ["train.py"]},
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_a_written_record_reads_back_equal_and_is_private(tmp_path: Path) -> None:
    rec = record()
    path = write_record(tmp_path / "launches", rec)
    assert path.name == "llm-3-0123456789abcdef0123456789abcdef.launch.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_records(tmp_path / "launches") == [rec]
    # no temporary file is left beside it
    assert [p.name for p in (tmp_path / "launches").iterdir()] == [path.name]
    remove_record(tmp_path / "launches", rec)
    remove_record(tmp_path / "launches", rec)  # a second removal is harmless
    assert load_records(tmp_path / "launches") == []


def test_records_come_back_oldest_launch_first(tmp_path: Path) -> None:
    newer = record(attempt=4, launch_id="b" * 32, started_at=2.0)
    older = record(job="other", launch_id="a" * 32, started_at=1.0)
    write_record(tmp_path, newer)
    write_record(tmp_path, older)
    assert load_records(tmp_path) == [older, newer]


def test_a_missing_directory_has_no_records(tmp_path: Path) -> None:
    assert load_records(tmp_path / "nowhere") == []


def test_rewriting_replaces_the_whole_record(tmp_path: Path) -> None:
    write_record(tmp_path, record(log_offset=1))
    write_record(tmp_path, record(log_offset=2))
    (got,) = load_records(tmp_path)
    assert got.log_offset == 2


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "Expecting value"),
        (b'{"job": "llm", "attempt": 3', "Expecting"),  # cut short
        (b"[1, 2]", "not a JSON object"),
        (b"\xff\xfe garbage", "Expecting value"),
        (None, "unknown record version"),
        (None, "pid: expected an integer"),
        (None, "pid/pgid: expected a process id above 1"),
        (None, "unknown keys ['extra']"),
        (None, "name another launch"),
    ],
    ids=[
        "empty", "truncated", "not-an-object", "not-utf8", "version", "pid-type", "pid-one",
        "unknown-key", "renamed",
    ],
)  # fmt: skip
def test_a_bad_record_is_logged_and_ignored_and_the_good_ones_still_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes | None, reason: str
) -> None:
    good = record(job="good", launch_id="c" * 32)
    write_record(tmp_path, good)
    bad = record()
    data = asdict(bad)
    if content is None:
        if reason.startswith("unknown record"):
            data["v"] = 99
        elif reason.startswith("pid: "):
            data["pid"] = "4242"
        elif reason.startswith("pid/pgid"):
            data["pid"] = 1
        elif reason.startswith("unknown keys"):
            data["extra"] = True
        else:
            data["attempt"] = 5  # the file name says attempt 3
        content = json.dumps(data).encode()
    (tmp_path / bad.file_name).write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="trainguard.agent.launchrec"):
        assert load_records(tmp_path) == [good]
    (line,) = [r.getMessage() for r in caplog.records]
    assert "event=launch_record_bad" in line and bad.file_name in line
    assert reason in line


def test_an_unreadable_record_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / record().file_name).mkdir()  # a directory where a file should be
    with caplog.at_level(logging.WARNING):
        assert load_records(tmp_path) == []
    assert "event=launch_record_bad" in caplog.text


def test_an_oversized_record_is_ignored(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / record().file_name).write_bytes(b" " * (300 * 1024))
    with caplog.at_level(logging.WARNING):
        assert load_records(tmp_path) == []
    assert "larger than" in caplog.text


def test_the_temporary_file_of_an_interrupted_write_is_removed(tmp_path: Path) -> None:
    leftover = tmp_path / f".{record().file_name}.tmp.123"
    leftover.write_bytes(b'{"job": "ll')
    (tmp_path / "unrelated.txt").write_text("kept")
    assert load_records(tmp_path) == []
    assert not leftover.exists()
    assert (tmp_path / "unrelated.txt").exists()


def test_a_failed_write_leaves_the_previous_record_and_no_temporary_file(tmp_path: Path) -> None:
    write_record(tmp_path, record(log_offset=1))
    with pytest.raises(TypeError):
        write_record(tmp_path, record(spec={"x": object()}))  # not JSON
    assert [r.log_offset for r in load_records(tmp_path)] == [1]
    assert len(list(tmp_path.iterdir())) == 1


def test_start_ticks_tell_a_process_apart_and_are_none_once_it_has_exited(tmp_path: Path) -> None:
    me = proc_start_ticks(os.getpid())
    assert isinstance(me, int) and me > 0
    assert proc_start_ticks(os.getpid()) == me
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert proc_start_ticks(child.pid) is None
    # a zombie (exited, not yet reaped) has exited too
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, zombie.pid, os.WEXITED | os.WNOWAIT)
    assert proc_start_ticks(zombie.pid) is None
    zombie.wait()
    # a fake /proc: comm with spaces and parentheses
    (tmp_path / "77").mkdir()
    fields = ["S", *["0"] * 18, "31337", "0"]
    (tmp_path / "77" / "stat").write_text(f"77 (a (b) c) {' '.join(fields)}\n")
    assert proc_start_ticks(77, proc_root=str(tmp_path)) == 31337
