"""XID and "fallen off the bus" events from the kernel log (/dev/kmsg), mapped to GPU indices.

`KernelLogParser` is pure (no I/O, no clock): kernel log lines in (/dev/kmsg records, dmesg or
journal lines, remote-syslog copies), hardware events out. It is stateful only to join the
driver's multi-line "fallen off the bus" message, which arrives as one /dev/kmsg record with
`\x0a` escapes, as an indented continuation in dmesg and the journal, or as separate records.
/dev/kmsg records whose facility is not the kernel's are never events: a user process that may
write to /dev/kmsg cannot forge an XID. `KmsgXidSource` owns the file descriptor: opened
non-blocking, read until EAGAIN on every poll, never blocking and never raising; a missing or
unreadable log is logged at most once a minute and retried on every poll.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import re
from collections.abc import Callable

from trainguard.agent.collectors import bus_id_device_prefix, normalize_bus_id
from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.model import HardwareEvent
from trainguard.protocol import EventKind

__all__ = ["KernelLogParser", "KmsgXidSource", "parse_kmsg_line"]

log = logging.getLogger("trainguard.agent.xid")

MESSAGE_MAX_CHARS = 256  # HardwareEvent.message is bounded text for people, never a label
# A /dev/kmsg record is at most ~8 KiB (message + dictionary); a smaller read gets EINVAL.
_READ_CHUNK_BYTES = 16384
_MAX_BYTES_PER_POLL = 4 * 1024 * 1024  # a flood of kernel lines is finished on the next poll
_MAX_PENDING_BYTES = 65536  # an unterminated line longer than this is dropped, not hoarded
ERROR_LOG_INTERVAL_S = 60.0
# The driver's "fallen off the bus" message is three lines; a start line waits this many
# further lines for its end before it is forgotten (other drivers may print in between).
FALLEN_PENDING_LINES = 8

# "6,1234,5678901,-;message": syslog priority (facility << 3 | level), sequence, usec since
# boot, flags; message. The kernel's own records have facility 0; a record written to
# /dev/kmsg by a user process gets LOG_USER (1) or any facility but 0.
_KMSG_PREFIX_RE = re.compile(r"^(?P<prio>\d+),\d+,\d+,[^;]*;")
_KMSG_ESCAPE_RE = re.compile(r"\\x([0-9a-fA-F]{2})")
# a PCI address as the driver prints it: with or without "PCI:", the domain and the function
_BUS = r"(?:PCI:)?(?P<bus>(?:[0-9a-fA-F]{1,8}:)?[0-9a-fA-F]{1,2}:[0-9a-fA-F]{1,2}(?:\.[0-7])?)"
# NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.
_XID_RE = re.compile(r"NVRM: Xid \(" + _BUS + r"\): (?P<code>\d+)(?:, ?(?P<rest>.*))?$")
# NVRM: GPU at PCI:0000:18:00: GPU-6f...: GPU has fallen off the bus.
# NVRM: GPU 0000:18:00.0: GPU has fallen off the bus.     NVRM: GPU 18:00.0: GPU has ...
_FALLEN_RE = re.compile(
    r"NVRM: GPU (?:at )?" + _BUS + r":(?: GPU-[0-9a-fA-F-]+:)? GPU has fallen off the bus"
)
# NVRM: The NVIDIA GPU 0000:b3:00.0 [(PCI ID: 10de:26b5)] installed in this system has ...
_THE_GPU_RE = re.compile(r"NVRM: The NVIDIA GPU " + _BUS + r"\b")
_FALLEN_END = "fallen off the bus and is not responding"
# a /dev/kmsg dictionary line (" SUBSYSTEM=pci"), never part of a message
_DICT_RE = re.compile(r"^\s+[A-Z_][A-Z0-9_]*=")
_FALLEN_MESSAGE = "GPU has fallen off the bus"


def _bounded(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MESSAGE_MAX_CHARS else text[: MESSAGE_MAX_CHARS - 1] + "…"


def _bus_or_none(raw: str) -> str | None:
    try:
        return normalize_bus_id(raw)
    except ValueError:
        return None


class KernelLogParser:
    """Kernel log lines -> "xid" and "fallen_off_bus" events (gpu unset; the source maps it).

    Pure and single-threaded; one instance per log, since it joins multi-line messages.
    `non_kernel_records_total` counts /dev/kmsg records dropped for their facility.
    """

    def __init__(self) -> None:
        self._pending_bus: str | None = None
        self._pending_left = 0
        self.non_kernel_records_total = 0

    def feed(self, line: str, *, now: float) -> list[HardwareEvent]:
        """Events completed by this line (usually none or one)."""
        if not line:
            return []
        line = line.rstrip("\r\n")
        m = _KMSG_PREFIX_RE.match(line)
        if m is not None:
            if int(m.group("prio")) >> 3 != 0:
                self.non_kernel_records_total += 1
                return []
            body = _KMSG_ESCAPE_RE.sub(lambda e: chr(int(e.group(1), 16)), line[m.end() :])
            events: list[HardwareEvent] = []
            for i, part in enumerate(body.split("\n")):
                events.extend(self._text(part, continuation=i > 0, now=now))
            return events
        if _DICT_RE.match(line):
            return []
        return self._text(line, continuation=line[0] in " \t", now=now)

    def _text(self, line: str, *, continuation: bool, now: float) -> list[HardwareEvent]:
        nvrm_at = line.find("NVRM: ")
        if nvrm_at < 0:
            self._age_pending()
            return []
        text = line[nvrm_at:].rstrip()
        pending = self._pending_bus
        if pending is not None and _FALLEN_END in text:
            self._pending_bus = None
            return [self._fallen(pending, now)]
        if continuation:  # the inside of a multi-line message never starts an event
            self._age_pending()
            return []
        m = _XID_RE.match(text)
        if m is not None:
            bus = _bus_or_none(m.group("bus"))
            if bus is None:
                return []
            return [
                HardwareEvent(
                    kind=EventKind.XID,
                    ts=now,
                    pci_bus_id=bus,
                    code=int(m.group("code")),
                    message=_bounded(m.group("rest") or ""),
                )
            ]
        m = _FALLEN_RE.match(text)
        if m is not None:
            bus = _bus_or_none(m.group("bus"))
            return [] if bus is None else [self._fallen(bus, now)]
        m = _THE_GPU_RE.match(text)
        if m is not None:
            bus = _bus_or_none(m.group("bus"))
            if bus is None:
                return []
            if _FALLEN_END in text:  # the whole message on one line
                return [self._fallen(bus, now)]
            self._pending_bus, self._pending_left = bus, FALLEN_PENDING_LINES
            return []
        self._age_pending()
        return []

    def _age_pending(self) -> None:
        if self._pending_bus is not None:
            self._pending_left -= 1
            if self._pending_left <= 0:
                self._pending_bus = None

    @staticmethod
    def _fallen(bus: str, now: float) -> HardwareEvent:
        return HardwareEvent(
            kind=EventKind.FALLEN_OFF_BUS, ts=now, pci_bus_id=bus, message=_FALLEN_MESSAGE
        )


def parse_kmsg_line(line: str, *, now: float) -> HardwareEvent | None:
    """One kernel log record or line on its own -> its first event, else None (a multi-line
    message split over several lines needs a `KernelLogParser` fed every line)."""
    events = KernelLogParser().feed(line, now=now)
    return events[0] if events else None


class KmsgXidSource:
    """Non-blocking reader of the kernel log that yields XID events with their GPU index.

    /dev/kmsg gives one record per read(); a regular file or FIFO (tests) gives arbitrary
    chunks, so both are split on newlines with the unfinished tail kept for the next poll.
    """

    def __init__(
        self,
        *,
        path: str = "/dev/kmsg",
        bus_to_index: Callable[[], dict[str, int]],
        clock: Clock = SYSTEM_CLOCK,
        from_start: bool = False,
    ) -> None:
        self.path = path
        self._bus_to_index = bus_to_index
        self._clock = clock
        self._from_start = from_start
        self._fd: int | None = None
        self._closed = False
        self._pending = b""
        self._bus_map: dict[str, int] | None = None
        self._prefix_map: dict[str, int] = {}
        self._last_error_log_mono: float | None = None
        self.last_error: str | None = None
        self.records_overwritten_total = 0  # EPIPE: the ring buffer lapped us
        self._parser = KernelLogParser()
        self._open()  # now, so the "end" we seek to is agent start, not the first poll

    def _report_error(self, what: str, err: OSError | str) -> None:
        reason = (err.strerror or str(err)) if isinstance(err, OSError) else err
        self.last_error = f"{what}: {reason}"
        mono = self._clock.monotonic()
        if (
            self._last_error_log_mono is None
            or mono - self._last_error_log_mono >= ERROR_LOG_INTERVAL_S
        ):
            self._last_error_log_mono = mono
            log.warning("event=kmsg_error path=%s op=%s reason=%r", self.path, what, reason)

    def _open(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            self._report_error("open", e)
            return False
        if not self._from_start:
            try:
                os.lseek(fd, 0, os.SEEK_END)
            except OSError as e:
                # a FIFO cannot seek and needs not: it only holds what is written from now on
                if e.errno != errno.ESPIPE:
                    os.close(fd)
                    self._report_error("seek", e)
                    return False
        self._fd = fd
        self._pending = b""
        if self.last_error is not None:
            log.info("event=kmsg_open path=%s recovered_from=%r", self.path, self.last_error)
        self.last_error = None
        return True

    def _read_available(self) -> list[bytes]:
        """Every complete line available now (bounded per poll)."""
        assert self._fd is not None
        lines: list[bytes] = []
        budget = _MAX_BYTES_PER_POLL
        while budget > 0:
            try:
                chunk = os.read(self._fd, _READ_CHUNK_BYTES)
            except BlockingIOError:
                break  # EAGAIN: nothing more right now
            except OSError as e:
                if e.errno == errno.EPIPE:
                    # /dev/kmsg: records we had not read yet were overwritten; the next read
                    # returns the oldest record still there
                    self.records_overwritten_total += 1
                    continue
                if e.errno == errno.EINTR:
                    continue
                self._report_error("read", e)
                self._close_fd()  # reopened on the next poll
                break
            if not chunk:
                break  # end of a regular file, or a FIFO without a writer
            budget -= len(chunk)
            data = self._pending + chunk
            parts = data.split(b"\n")
            self._pending = parts.pop()
            if len(self._pending) > _MAX_PENDING_BYTES:
                self._pending = b""
            lines.extend(parts)
        return lines

    def _resolve_gpu(self, bus: str | None, *, refreshed: list[bool]) -> int | None:
        if bus is None:
            return None
        if self._bus_map is None:
            self._refresh_bus_map()
        idx = self._lookup(bus)
        if idx is None and not refreshed[0]:
            # a GPU we have not mapped yet (or NVML came up late): refresh once per poll
            refreshed[0] = True
            self._refresh_bus_map()
            idx = self._lookup(bus)
        return idx

    def _lookup(self, bus: str) -> int | None:
        assert self._bus_map is not None
        idx = self._bus_map.get(bus)
        if idx is None:
            idx = self._prefix_map.get(bus_id_device_prefix(bus))
        return idx

    def _refresh_bus_map(self) -> None:
        try:
            raw = self._bus_to_index()
        except Exception as e:  # the mapping comes from NVML, which may be down
            log.warning("event=bus_map_error reason=%r", str(e)[:200])
            raw = {}
        bus_map: dict[str, int] = {}
        for key, idx in raw.items():
            try:
                bus_map[normalize_bus_id(key)] = idx
            except ValueError:
                continue
        self._bus_map = bus_map
        self._prefix_map = {bus_id_device_prefix(k): v for k, v in bus_map.items()}

    def poll(self) -> list[HardwareEvent]:
        """Events from every record written since the last poll. Never blocks or raises."""
        if self._closed or (self._fd is None and not self._open()):
            return []
        now = self._clock.now()
        events: list[HardwareEvent] = []
        refreshed = [False]
        for raw in self._read_available():
            line = raw.decode("utf-8", "replace")
            for event in self._parser.feed(line, now=now):
                events.append(self._with_gpu(event, refreshed=refreshed))
        return events

    @property
    def non_kernel_records_total(self) -> int:
        """/dev/kmsg records dropped because a user process, not the kernel, wrote them."""
        return self._parser.non_kernel_records_total

    def _with_gpu(self, event: HardwareEvent, *, refreshed: list[bool]) -> HardwareEvent:
        gpu = self._resolve_gpu(event.pci_bus_id, refreshed=refreshed)
        if gpu is not None:
            event = dataclasses.replace(event, gpu=gpu)
        log.info(
            "event=kernel_%s gpu=%s pci_bus_id=%s code=%s",
            event.kind,
            event.gpu,
            event.pci_bus_id,
            event.code,
        )
        return event

    def close(self) -> None:
        """Release the descriptor; later polls return nothing."""
        self._closed = True
        self._close_fd()

    def _close_fd(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass  # already gone; nothing to release
            self._fd = None
