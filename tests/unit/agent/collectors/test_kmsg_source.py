"""KmsgXidSource on real files, FIFOs and (read-only) the real /dev/kmsg: non-blocking reads,
bus id -> GPU mapping, missing paths, errors that never escape."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import pytest

from trainguard.agent.collectors import xid as xid_mod
from trainguard.agent.collectors.xid import KmsgXidSource
from trainguard.clock import FakeClock

KMSG = Path(__file__).resolve().parents[3] / "fixtures" / "kmsg"
XID79 = "3,1534,270001337,-;NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.\n"
XID48 = (
    "4,1526,230118456,-;NVRM: Xid (PCI:0000:ab:00): 48, pid='<unknown>', name=<unknown>, "
    "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at "
    "partition 6, subpartition 0.\n"
)
BUS_MAP = {"0000:18:00.0": 0, "0000:2a:00.0": 1, "0000:ab:00.0": 5}


class CountingMap:
    """bus_to_index that records how often it is asked and can change its answer."""

    def __init__(self, *answers: dict[str, int]) -> None:
        self.answers = list(answers)
        self.calls = 0

    def __call__(self) -> dict[str, int]:
        self.calls += 1
        return self.answers[min(self.calls, len(self.answers)) - 1]


def _append(path: Path, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def test_only_records_written_after_open_are_reported(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text(XID48)  # before the agent started: not news
    clock = FakeClock()
    src = KmsgXidSource(path=str(log), bus_to_index=lambda: BUS_MAP, clock=clock)

    assert src.poll() == []
    _append(log, XID79)
    events = src.poll()

    assert [(e.kind, e.code, e.gpu, e.pci_bus_id) for e in events] == [
        ("xid", 79, 0, "0000:18:00.0")
    ]
    assert events[0].ts == clock.now()
    assert src.poll() == []
    src.close()


def test_from_start_reads_the_whole_fixture_log(tmp_path):
    src = KmsgXidSource(
        path=str(KMSG / "h100_xids.kmsg"), bus_to_index=lambda: BUS_MAP, from_start=True
    )

    events = src.poll()
    src.close()

    assert [e.code for e in events if e.kind == "xid"] == [
        13, 13, 31, 43, 45, 48, 63, 64, 74, 94, 95, 119, 154, 79, 79,
    ]  # fmt: skip
    assert [(e.kind, e.gpu) for e in events if e.kind == "fallen_off_bus"] == [
        ("fallen_off_bus", 0),
        ("fallen_off_bus", 1),
    ]
    by_bus = {e.pci_bus_id: e.gpu for e in events}
    assert by_bus["0000:ab:00.0"] == 5
    assert by_bus["0000:3b:00.0"] is None  # not a GPU NVML knows: reported, unmapped


def test_partial_line_waits_for_its_newline(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("")
    src = KmsgXidSource(path=str(log), bus_to_index=lambda: BUS_MAP)

    _append(log, XID79[:40])
    first = src.poll()
    _append(log, XID79[40:])
    second = src.poll()

    assert first == []
    assert [e.code for e in second] == [79]


def test_bus_map_is_fetched_lazily_cached_and_refreshed_on_a_miss(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("")
    bus_map = CountingMap({"0000:18:00.0": 0}, {"0000:18:00.0": 0, "0000:ab:00.0": 5})
    src = KmsgXidSource(path=str(log), bus_to_index=bus_map)
    assert bus_map.calls == 0

    _append(log, XID79 + XID79)
    assert [e.gpu for e in src.poll()] == [0, 0]
    assert bus_map.calls == 1
    _append(log, XID48)
    assert [e.gpu for e in src.poll()] == [5]
    assert bus_map.calls == 2
    _append(log, XID48 + XID79)
    assert [e.gpu for e in src.poll()] == [5, 0]
    assert bus_map.calls == 2


def test_bus_map_failure_still_reports_the_event(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("")

    def broken() -> dict[str, int]:
        raise RuntimeError("nvml down")

    src = KmsgXidSource(path=str(log), bus_to_index=broken)
    _append(log, XID79)

    events = src.poll()

    assert [(e.code, e.gpu, e.pci_bus_id) for e in events] == [(79, None, "0000:18:00.0")]


def test_fifo_without_writer_or_data_never_blocks(tmp_path):
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    src = KmsgXidSource(path=str(fifo), bus_to_index=lambda: BUS_MAP)

    assert src.poll() == []  # no writer yet: EOF, not a hang
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        assert src.poll() == []  # writer, no data: EAGAIN
        os.write(fd, XID48.encode())
        events = src.poll()
    finally:
        os.close(fd)
        src.close()

    assert [(e.code, e.gpu) for e in events] == [(48, 5)]


def test_missing_log_is_retried_and_logged_once_a_minute(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="trainguard.agent.xid")
    log = tmp_path / "later" / "kmsg"
    clock = FakeClock()
    src = KmsgXidSource(path=str(log), bus_to_index=lambda: BUS_MAP, clock=clock)

    for _ in range(5):
        clock.advance(1)
        assert src.poll() == []
    logged_early = len(caplog.records)
    clock.advance(60)
    src.poll()
    logged_later = len(caplog.records)
    log.parent.mkdir()
    log.write_text(XID48)  # what was there before we could open it is not news
    assert src.poll() == []
    _append(log, XID79)
    events = src.poll()

    assert logged_early == 1
    assert logged_later == 2
    assert "op=open" in caplog.records[0].getMessage()
    assert f"path={log}" in caplog.records[0].getMessage()
    assert src.last_error is None
    assert [e.code for e in events] == [79]


def test_overwritten_records_epipe_are_skipped_and_reading_continues(tmp_path, monkeypatch):
    log = tmp_path / "kmsg"
    log.write_text("")
    src = KmsgXidSource(path=str(log), bus_to_index=lambda: BUS_MAP)
    _append(log, XID79)
    real_read = os.read
    raised = []

    def read_with_one_epipe(fd: int, n: int) -> bytes:
        # what /dev/kmsg does when the ring buffer overwrote records we had not read yet
        if not raised:
            raised.append(True)
            raise OSError(errno.EPIPE, "Broken pipe")
        return real_read(fd, n)

    monkeypatch.setattr(xid_mod.os, "read", read_with_one_epipe)
    events = src.poll()
    monkeypatch.undo()

    assert [e.code for e in events] == [79]
    assert src.records_overwritten_total == 1


def test_read_error_is_reported_and_the_log_reopened(tmp_path, monkeypatch):
    log = tmp_path / "kmsg"
    log.write_text("")
    src = KmsgXidSource(path=str(log), bus_to_index=lambda: BUS_MAP)

    def read_eio(fd: int, n: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(xid_mod.os, "read", read_eio)
    assert src.poll() == []
    monkeypatch.undo()
    assert src.last_error == "read: Input/output error"
    _append(log, XID79)  # written while closed, before the reopen: the reopen starts at the end
    assert src.poll() == []
    _append(log, XID48)

    assert [e.code for e in src.poll()] == [48]


def test_closed_source_returns_nothing(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("")
    src = KmsgXidSource(path=str(log), bus_to_index=lambda: BUS_MAP)
    src.close()
    _append(log, XID79)

    assert src.poll() == []


def test_real_dev_kmsg_is_read_without_blocking():
    if not os.access("/dev/kmsg", os.R_OK):
        pytest.skip("/dev/kmsg is not readable here")
    done = threading.Event()
    result: list[object] = []

    def run() -> None:
        src = KmsgXidSource(path="/dev/kmsg", bus_to_index=dict, from_start=True)
        try:
            result.append(src.poll())  # every record since boot, then EAGAIN
            result.append(src.poll())
            result.append(src.last_error)
        finally:
            src.close()
            done.set()

    threading.Thread(target=run, daemon=True).start()

    assert done.wait(timeout=30), "poll() on /dev/kmsg blocked"
    assert isinstance(result[0], list)
    assert result[2] is None
