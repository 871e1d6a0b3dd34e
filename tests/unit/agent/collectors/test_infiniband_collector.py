"""SysfsIbCollector on checked-in sysfs trees (tests/fixtures/sysfs) and damaged copies of them.

Unreadable files are made real ways that work as root too: a directory where a counter file
should be (read fails with EISDIR) and a FIFO with no writer (opened non-blocking, reads empty).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from trainguard.agent.collectors.infiniband import SysfsIbCollector, parse_rate_gbps, parse_state

SYSFS = Path(__file__).resolve().parents[3] / "fixtures" / "sysfs"


def _copy(tree: str, tmp_path: Path) -> Path:
    dst = tmp_path / tree
    shutil.copytree(SYSFS / tree, dst)
    return dst


def test_healthy_node_reports_eight_active_400g_ports():
    ports = SysfsIbCollector(root=str(SYSFS / "healthy_8port")).collect()

    assert [(p.device, p.port) for p in ports] == [(f"mlx5_{i}", 1) for i in range(8)]
    for p in ports:
        assert (p.state, p.state_code) == ("ACTIVE", 4)
        assert (p.phys_state, p.phys_state_code) == ("LinkUp", 5)
        assert p.rate_gbps == 400.0
        assert p.link_layer == "InfiniBand"
        assert p.unreadable == ()
        assert p.counters["symbol_error"] >= 0
        assert p.counters["port_xmit_data"] > 10**12  # raw 4-byte words, as sysfs gives
        assert p.hw_counters["rnr_nak_retry_err"] == 0
    assert ports[3].counters["symbol_error"] == 3
    assert ports[3].counters["link_error_recovery"] == 1
    assert set(ports[0].counters) >= {
        "port_rcv_errors",
        "symbol_error",
        "link_downed",
        "link_error_recovery",
        "port_xmit_discards",
        "port_xmit_data",
        "port_rcv_data",
        "excessive_buffer_overrun_errors",
        "local_link_integrity_errors",
    }
    assert set(ports[0].hw_counters) >= {
        "rnr_nak_retry_err",
        "out_of_sequence",
        "packet_seq_err",
        "implied_nak_seq_err",
        "local_ack_timeout_err",
    }


def test_mlx4_extended_counters_replace_the_stuck_32_bit_ones():
    (port,) = SysfsIbCollector(root=str(SYSFS / "mlx4_ext")).collect()

    assert (port.device, port.port, port.rate_gbps) == ("mlx4_0", 1, 56.0)
    # counters/ holds 2^32-1 for these; counters_ext/ the real 64-bit values
    assert port.counters["port_rcv_data"] == 1789569706240
    assert port.counters["port_xmit_data"] == 1801254109184
    assert port.counters["port_rcv_packets"] == 9876543210
    assert port.counters["port_xmit_packets"] == 9912345678
    assert port.counters["unicast_rcv_packets"] == 9876000000
    assert port.counters["multicast_xmit_packets"] == 345678
    assert port.counters["link_downed"] == 1  # counters/ without a 64-bit twin are kept
    assert "port_rcv_data_64" not in port.counters
    assert port.unreadable == ()


def test_an_unreadable_extended_counter_keeps_the_32_bit_one(tmp_path):
    root = _copy("mlx4_ext", tmp_path)
    bad = root / "mlx4_0" / "ports" / "1" / "counters_ext" / "port_rcv_data_64"
    bad.unlink()
    bad.mkdir()

    (port,) = SysfsIbCollector(root=str(root)).collect()

    assert port.counters["port_rcv_data"] == 4294967295
    assert port.counters["port_xmit_data"] == 1801254109184
    assert port.unreadable == ("counters_ext/port_rcv_data_64",)


def test_devices_sort_naturally(tmp_path):
    root = _copy("healthy_8port", tmp_path)
    shutil.copytree(root / "mlx5_1", root / "mlx5_10")

    devices = [p.device for p in SysfsIbCollector(root=str(root)).collect()]

    assert devices[-2:] == ["mlx5_7", "mlx5_10"]


def test_down_port_reports_state_and_link_downed():
    ports = SysfsIbCollector(root=str(SYSFS / "port_down")).collect()

    down, init = ports
    assert (down.device, down.state, down.state_code) == ("mlx5_0", "DOWN", 1)
    assert (down.phys_state, down.phys_state_code) == ("Disabled", 3)
    assert down.rate_gbps == 10.0
    assert down.counters["link_downed"] == 7
    assert down.counters["symbol_error"] == 1432
    assert (init.state, init.phys_state) == ("INIT", "LinkUp")


def test_no_pma_counters_are_absent_not_zero_or_unreadable():
    (port,) = SysfsIbCollector(root=str(SYSFS / "no_pma")).collect()

    assert port.counters == {}
    assert port.unreadable == ()
    assert port.link_layer == "Ethernet"
    assert port.hw_counters["out_of_sequence"] == 0


def test_a_counter_that_cannot_be_read_is_listed_and_the_others_kept(tmp_path):
    root = _copy("healthy_8port", tmp_path)
    counters = root / "mlx5_2" / "ports" / "1" / "counters"
    (counters / "symbol_error").unlink()
    (counters / "symbol_error").mkdir()  # read() fails with EISDIR, an OSError like EINVAL

    ports = SysfsIbCollector(root=str(root)).collect()

    p = ports[2]
    assert p.unreadable == ("counters/symbol_error",)
    assert "symbol_error" not in p.counters
    assert p.counters["link_downed"] == 0
    assert p.state == "ACTIVE"
    assert ports[1].unreadable == ()


def test_fifo_in_place_of_a_counter_never_blocks_and_is_unreadable(tmp_path):
    root = _copy("healthy_8port", tmp_path)
    hw = root / "mlx5_0" / "ports" / "1" / "hw_counters"
    (hw / "out_of_sequence").unlink()
    os.mkfifo(hw / "out_of_sequence")

    p = SysfsIbCollector(root=str(root)).collect()[0]

    assert p.unreadable == ("hw_counters/out_of_sequence",)
    assert p.hw_counters["packet_seq_err"] == 0


@pytest.mark.parametrize(
    ("rel", "content"),
    [
        pytest.param("counters/port_rcv_errors", "lots\n", id="junk-counter"),
        pytest.param("counters/port_rcv_errors", "-5\n", id="negative-counter"),
        pytest.param("counters/port_rcv_errors", f"{2**63}\n", id="counter-beyond-the-wires-int64"),
        pytest.param("counters/port_rcv_errors", "", id="empty-counter"),
        pytest.param("state", "ACTIVE\n", id="state-without-code"),
        pytest.param("phys_state", "\n", id="empty-phys-state"),
        pytest.param("rate", "fast\n", id="junk-rate"),
    ],
)
def test_junk_values_are_unreadable_and_the_rest_kept(tmp_path, rel, content):
    root = _copy("healthy_8port", tmp_path)
    (root / "mlx5_4" / "ports" / "1" / rel).write_text(content)

    p = SysfsIbCollector(root=str(root)).collect()[4]

    assert p.unreadable == (rel,)
    assert p.counters["symbol_error"] == 0
    assert p.link_layer == "InfiniBand"


def test_state_file_that_is_a_directory_is_unreadable(tmp_path):
    root = _copy("port_down", tmp_path)
    state = root / "mlx5_0" / "ports" / "1" / "state"
    state.unlink()
    state.mkdir()

    p = SysfsIbCollector(root=str(root)).collect()[0]

    assert (p.state, p.state_code) == (None, None)
    assert p.unreadable == ("state",)
    assert p.phys_state == "Disabled"


def test_missing_files_and_dirs_are_absent(tmp_path):
    root = _copy("healthy_8port", tmp_path)
    port = root / "mlx5_5" / "ports" / "1"
    shutil.rmtree(port / "hw_counters")
    (port / "rate").unlink()
    shutil.rmtree(root / "mlx5_6" / "ports")
    (root / "mlx5_7" / "ports" / "notaport").mkdir()

    ports = SysfsIbCollector(root=str(root)).collect()

    assert [p.device for p in ports] == [f"mlx5_{i}" for i in (0, 1, 2, 3, 4, 5, 7)]
    p5 = ports[5]
    assert p5.hw_counters == {}
    assert p5.rate_gbps is None
    assert p5.unreadable == ()


def test_missing_root_means_no_ports(tmp_path):
    assert SysfsIbCollector(root=str(tmp_path / "nope")).collect() == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("400 Gb/sec (4X NDR)", 400.0, id="ndr"),
        pytest.param("200 Gb/sec (4X HDR)", 200.0, id="hdr"),
        pytest.param("2.5 Gb/sec (1X SDR)", 2.5, id="sdr-fraction"),
        pytest.param("800 Gb/sec (4X XDR)", 800.0, id="xdr"),
    ],
)
def test_rates_parse(text, expected):
    assert parse_rate_gbps(text) == expected


def test_states_parse():
    assert parse_state("4: ACTIVE") == (4, "ACTIVE")
    assert parse_state("5: LinkUp") == (5, "LinkUp")
    assert parse_state("6: ACTIVE_DEFER") == (6, "ACTIVE_DEFER")
    with pytest.raises(ValueError, match="state"):
        parse_state("ACTIVE")
