"""InfiniBand / RoCE port state and counters from sysfs (/sys/class/infiniband).

Reads `<root>/<dev>/ports/<n>/{state,phys_state,rate,link_layer,counters/*,hw_counters/*}`,
and `counters_ext/*` where the driver has it (mlx4): its 64-bit data and packet counters stand
in for the 32-bit `counters/` ones of the same meaning, which stick at 2^32-1. One bad file
never drops the others: "N/A (no PMA)" is absent, a file that cannot be read
(EINVAL and friends) or holds junk is listed in `IbPortSample.unreadable`. Raw values only:
counter wrap and rates are the consumer's business.
"""

from __future__ import annotations

import os
import re

from trainguard.bounds import INT64_MAX
from trainguard.model import IbPortSample

__all__ = ["SysfsIbCollector", "parse_rate_gbps", "parse_state"]

_READ_MAX_BYTES = 4096  # one sysfs page
_STATE_RE = re.compile(r"^(\d+):\s*(\S.*)$")
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*Gb/sec")
_NATURAL_RE = re.compile(r"(\d+)")
# counters_ext/ (mlx4's extended port counters, 64-bit) -> the counters/ name they replace
EXTENDED_COUNTERS = {
    "port_rcv_data_64": "port_rcv_data",
    "port_xmit_data_64": "port_xmit_data",
    "port_rcv_packets_64": "port_rcv_packets",
    "port_xmit_packets_64": "port_xmit_packets",
    "port_unicast_rcv_packets": "unicast_rcv_packets",
    "port_unicast_xmit_packets": "unicast_xmit_packets",
    "port_multicast_rcv_packets": "multicast_rcv_packets",
    "port_multicast_xmit_packets": "multicast_xmit_packets",
}


class _Unreadable(Exception):
    """A file that exists but gave an error or nothing usable."""


def _natural_key(name: str) -> list[object]:
    # mlx5_2 before mlx5_10
    return [int(part) if part.isdigit() else part for part in _NATURAL_RE.split(name)]


def _read(path: str) -> str:
    """The file's text, stripped. Non-blocking open, so a stray FIFO can never hang us."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _Unreadable(e.strerror or str(e)) from None
    try:
        data = os.read(fd, _READ_MAX_BYTES)
    except OSError as e:
        raise _Unreadable(e.strerror or str(e)) from None
    finally:
        os.close(fd)
    return data.decode("ascii", "replace").strip()


def parse_state(text: str) -> tuple[int, str]:
    """ "4: ACTIVE" -> (4, "ACTIVE"); raises ValueError on anything else."""
    m = _STATE_RE.match(text)
    if m is None:
        raise ValueError(f"not a 'N: NAME' state: {text[:40]!r}")
    return int(m.group(1)), m.group(2).strip()


def parse_rate_gbps(text: str) -> float:
    """ "400 Gb/sec (4X NDR)" -> 400.0; raises ValueError on anything else."""
    m = _RATE_RE.match(text)
    if m is None:
        raise ValueError(f"not a rate: {text[:40]!r}")
    return float(m.group(1))


class SysfsIbCollector:
    """Every port of every device under `root` (tests point it at a checked-in tree)."""

    def __init__(self, *, root: str = "/sys/class/infiniband") -> None:
        self.root = root

    def collect(self) -> tuple[IbPortSample, ...]:
        try:
            devices = sorted(os.listdir(self.root), key=_natural_key)
        except OSError:
            return ()  # no IB stack on this node (or not yet): no ports, not an error
        samples: list[IbPortSample] = []
        for device in devices:
            ports_dir = os.path.join(self.root, device, "ports")
            try:
                ports = [p for p in os.listdir(ports_dir) if p.isdigit()]
            except OSError:
                continue
            for port in sorted(ports, key=int):
                samples.append(self._port(device, int(port), os.path.join(ports_dir, port)))
        return tuple(samples)

    def _port(self, device: str, port: int, port_dir: str) -> IbPortSample:
        unreadable: list[str] = []

        def text(rel: str) -> str | None:
            path = os.path.join(port_dir, rel)
            if not os.path.lexists(path):
                return None
            try:
                return _read(path)
            except _Unreadable:
                unreadable.append(rel)
                return None

        state_code: int | None = None
        state: str | None = None
        raw = text("state")
        if raw is not None:
            try:
                state_code, state = parse_state(raw)
            except ValueError:
                unreadable.append("state")
        phys_code: int | None = None
        phys: str | None = None
        raw = text("phys_state")
        if raw is not None:
            try:
                phys_code, phys = parse_state(raw)
            except ValueError:
                unreadable.append("phys_state")
        rate: float | None = None
        raw = text("rate")
        if raw is not None:
            try:
                rate = parse_rate_gbps(raw)
            except ValueError:
                unreadable.append("rate")
        link_layer = text("link_layer") or None
        counters = self._counters(port_dir, "counters", unreadable)
        extended = self._counters(port_dir, "counters_ext", unreadable)
        for name, value in extended.items():
            replaces = EXTENDED_COUNTERS.get(name)
            if replaces is not None:
                counters[replaces] = value
        hw_counters = self._counters(port_dir, "hw_counters", unreadable)
        return IbPortSample(
            device=device,
            port=port,
            state=state,
            state_code=state_code,
            phys_state=phys,
            phys_state_code=phys_code,
            rate_gbps=rate,
            link_layer=link_layer,
            counters=counters,
            hw_counters=hw_counters,
            unreadable=tuple(unreadable),
        )

    @staticmethod
    def _counters(port_dir: str, sub: str, unreadable: list[str]) -> dict[str, int]:
        directory = os.path.join(port_dir, sub)
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            return {}  # this port (or driver) has no such counter group: absent
        values: dict[str, int] = {}
        for name in names:
            rel = f"{sub}/{name}"
            try:
                raw = _read(os.path.join(directory, name))
            except _Unreadable:
                unreadable.append(rel)
                continue
            if raw.startswith("N/A"):
                continue  # "N/A (no PMA)": the port has no performance-management agent
            try:
                value = int(raw, 10)
            except ValueError:
                unreadable.append(rel)
                continue
            if not 0 <= value <= INT64_MAX:
                # sysfs counters are unsigned 64-bit; the wire carries int64 (what the
                # controller stores), and one odd counter must not cost the whole report
                unreadable.append(rel)
                continue
            values[name] = value
        return values
