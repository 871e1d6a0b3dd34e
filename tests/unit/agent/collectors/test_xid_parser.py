"""parse_kmsg_line: real-format kernel lines (fixtures in tests/fixtures/kmsg) into events."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.agent.collectors import normalize_bus_id
from trainguard.agent.collectors.xid import MESSAGE_MAX_CHARS, parse_kmsg_line

KMSG = Path(__file__).resolve().parents[3] / "fixtures" / "kmsg"

NOW = 1_700_000_123.5


def _records() -> dict[int, str]:
    """kmsg sequence number -> the whole record line."""
    out = {}
    for line in (KMSG / "h100_xids.kmsg").read_text().splitlines():
        if line and not line.startswith(" "):
            out[int(line.split(",")[1])] = line
    return out


RECORDS = _records()


@pytest.mark.parametrize(
    ("seq", "kind", "code", "bus", "message_start"),
    [
        pytest.param(
            1521, "xid", 13, "0000:3b:00.0", "pid=1234, name=python, Graphics SM", id="xid13"
        ),
        pytest.param(
            1523, "xid", 31, "0000:18:00.0", "pid=2817, name=python3, Ch 00000010", id="xid31"
        ),
        pytest.param(1524, "xid", 43, "0000:2a:00.0", "pid=4096", id="xid43"),
        pytest.param(1525, "xid", 45, "0000:2a:00.0", "pid=4096", id="xid45"),
        pytest.param(1526, "xid", 48, "0000:ab:00.0", "pid='<unknown>'", id="xid48-dbe"),
        pytest.param(1527, "xid", 63, "0000:ab:00.0", "pid='<unknown>'", id="xid63-row-remap"),
        pytest.param(1528, "xid", 64, "0000:5d:00.0", "pid='<unknown>'", id="xid64-remap-failure"),
        pytest.param(1529, "xid", 74, "0000:9a:00.0", "pid='<unknown>'", id="xid74-nvlink"),
        pytest.param(1530, "xid", 94, "0000:ab:00.0", "pid=91234", id="xid94-contained"),
        pytest.param(1531, "xid", 95, "0000:ab:00.0", "pid='<unknown>'", id="xid95-uncontained"),
        pytest.param(
            1532, "xid", 119, "0000:db:00.0", "pid=1902, name=python, Timeout", id="xid119-gsp"
        ),
        pytest.param(1533, "xid", 154, "0000:db:00.0", "GPU recovery action changed", id="xid154"),
        pytest.param(
            1534, "xid", 79, "0000:18:00.0", "pid=0, GPU has fallen off", id="xid79-old-pid"
        ),
        pytest.param(
            1537, "xid", 79, "0000:18:00.0", "pid='<unknown>', name=<unknown>, GPU", id="xid79"
        ),
        pytest.param(
            1538, "fallen_off_bus", None, "0000:18:00.0", "GPU has fallen", id="fallen-gpu-bdf"
        ),
        pytest.param(
            1539, "fallen_off_bus", None, "0000:2a:00.0", "GPU has fallen", id="fallen-gpu-at-uuid"
        ),
    ],
)
def test_kmsg_record_becomes_event(seq, kind, code, bus, message_start):
    event = parse_kmsg_line(RECORDS[seq], now=NOW)

    assert event is not None
    assert (event.kind, event.code, event.pci_bus_id, event.gpu) == (kind, code, bus, None)
    assert event.ts == NOW
    assert event.message.startswith(message_start)


@pytest.mark.parametrize(
    "seq",
    [
        pytest.param(1520, id="other-driver"),
        pytest.param(1535, id="nvrm-gpu-at-without-fall"),
        pytest.param(1536, id="nvrm-board-serial"),
        pytest.param(1540, id="nvswitch-sxid"),
    ],
)
def test_non_xid_kernel_records_are_ignored(seq):
    assert parse_kmsg_line(RECORDS[seq], now=NOW) is None


@pytest.mark.parametrize(
    "line",
    [
        pytest.param(" SUBSYSTEM=pci", id="dictionary"),
        pytest.param(" DEVICE=+pci:0000:18:00.0", id="dictionary-device"),
        pytest.param(
            " NVRM: Xid (PCI:0000:18:00): 79, pid=0, GPU has fallen off the bus.", id="indented-xid"
        ),
        pytest.param("", id="empty"),
        pytest.param("6,1,0,-;", id="empty-record"),
        pytest.param("4,9,9,-;NVRM: Xid (PCI:zz:18:00): 79, pid=0, x", id="bad-bus-id"),
        pytest.param("4,9,9,-;NVRM: Xid (PCI:0000:18:00): seventy-nine", id="no-code"),
    ],
)
def test_continuation_and_malformed_lines_are_not_events(line):
    assert parse_kmsg_line(line, now=NOW) is None


@pytest.mark.parametrize(
    ("index", "code", "bus"),
    [
        pytest.param(0, 13, "0000:3b:00.0", id="dmesg"),
        pytest.param(1, 74, "0000:9a:00.0", id="dmesg-T"),
        pytest.param(2, 48, "0000:86:00.0", id="journal"),
        pytest.param(3, 79, "0000:18:00.0", id="journal-without-PCI-prefix"),
    ],
)
def test_dmesg_and_journal_lines_parse_too(index, code, bus):
    line = (KMSG / "dmesg_and_journal.txt").read_text().splitlines()[index]

    event = parse_kmsg_line(line, now=NOW)

    assert event is not None
    assert (event.kind, event.code, event.pci_bus_id) == ("xid", code, bus)


def test_message_is_bounded_and_single_line():
    line = "4,1,1,-;NVRM: Xid (PCI:0000:18:00): 13, pid=1, " + "x" * 5000 + "\r\n"

    event = parse_kmsg_line(line, now=NOW)

    assert event is not None
    assert len(event.message) <= MESSAGE_MAX_CHARS
    assert "\n" not in event.message and "\r" not in event.message


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param("00000000:18:00.0", "0000:18:00.0", id="nvml-8-digit-domain"),
        pytest.param("00000000:2A:00.0", "0000:2a:00.0", id="nvml-upper-case"),
        pytest.param(b"00000000:DB:00.0\x00", "0000:db:00.0", id="nvml-bytes"),
        pytest.param("0000:18:00", "0000:18:00.0", id="kernel-no-function"),
        pytest.param("PCI:0000:18:00", "0000:18:00.0", id="kernel-pci-prefix"),
        pytest.param("18:00.0", "0000:18:00.0", id="no-domain"),
        pytest.param("0001:c1:00.1", "0001:c1:00.1", id="other-domain-function"),
    ],
)
def test_bus_ids_normalise(raw, expected):
    assert normalize_bus_id(raw) == expected


@pytest.mark.parametrize("raw", ["", "GPU-6f1c", "0000:18", "0000:18:00.9", "x:y:z"])
def test_bad_bus_ids_are_rejected(raw):
    with pytest.raises(ValueError, match="not a PCI bus id"):
        normalize_bus_id(raw)
