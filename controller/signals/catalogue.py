"""The signal catalogue: every signal name per scope, with its kind, whether it is a counter, and
its documentation (`SIGNALS`, built from the contract's signal table `trainguard.signals`),
plus the signals whose history is kept by default.

The rule loader checks names against `SIGNALS` and docs/rules.md documents it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from trainguard.signals import IB_COUNTERS, IB_HW_COUNTERS, SCOPES, Signal
from trainguard.signals import SIGNALS as TABLE

__all__ = [
    "DEFAULT_TRACKED",
    "IB_COUNTERS",
    "IB_HW_COUNTERS",
    "RANK_FIELDS",
    "SCOPES",
    "SIGNALS",
    "SignalSpec",
    "build_catalogue",
]


@dataclass(frozen=True)
class SignalSpec:
    """One signal: its value type ("number" or "string"), whether it is a counter (only ever
    increases, except on a reset), and a line of documentation."""

    kind: str
    counter: bool
    doc: str


# Counters whose values move on every healthy second (traffic): never tracked by default.
_IB_TRAFFIC = frozenset(
    {
        "port_xmit_data",
        "port_rcv_data",
        "port_xmit_packets",
        "port_rcv_packets",
        "unicast_xmit_packets",
        "unicast_rcv_packets",
        "multicast_xmit_packets",
        "multicast_rcv_packets",
        "port_xmit_wait",
        "rx_atomic_requests",
        "rx_read_requests",
        "rx_write_requests",
        "lifespan",
    }
)


def build_catalogue(signals: Iterable[Signal] = TABLE) -> dict[str, dict[str, SignalSpec]]:
    """The catalogue of the signal table's rows, per scope."""
    out: dict[str, dict[str, SignalSpec]] = {scope: {} for scope in SCOPES}
    for s in signals:
        out[s.scope][s.name] = SignalSpec(s.value, s.type == "counter", s.doc)
    return out


SIGNALS: Mapping[str, Mapping[str, SignalSpec]] = build_catalogue()
# The numeric rank signals that are RankState fields of the same name, in table order
RANK_FIELDS: tuple[str, ...] = tuple(
    s.name for s in TABLE if s.scope == "rank" and s.field and s.value == "number"
)

# Signals whose history is kept without being asked: counters, booleans and link states (they
# change rarely, so store-on-change keeps them cheap), plus job throughput for the default
# throughput-drop rule. Gauges that move every second (temperatures, per-rank step, traffic)
# are kept only when a loaded rule needs them: see `SignalState.track`.
DEFAULT_TRACKED: Mapping[str, frozenset[str]] = {
    "gpu": frozenset(
        n
        for n in SIGNALS["gpu"]
        if n.endswith("_total")
        or n.startswith(("remapped_rows", "retired_pages", "throttle_"))
        or n in ("lost", "xid_last_code")
    ),
    "nvlink": frozenset(SIGNALS["nvlink"]),
    "ib_port": frozenset(n for n in SIGNALS["ib_port"] if n not in _IB_TRAFFIC),
    "node": frozenset(
        {
            "gpus",
            "gpus_lost",
            "ib_ports",
            "ib_ports_down",
            "xid_total",
            "xid_fatal_total",
            "preemption_total",
        }
    ),
    "rank": frozenset({"nan_total", "ckpt_step"}),
    "job": frozenset({"ranks", "ranks_reporting", "step", "samples_per_s", "nan_total"}),
}
