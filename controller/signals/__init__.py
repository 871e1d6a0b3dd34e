"""Per-target signal values and bounded history, fed by agent reports; read by the rules engine.

The signal catalogue is in `catalogue`, one signal's history in `series`, the held per-target
records in `records`, the ingest state in `state` and the compiled getters in `getters`; the
names the rest of the controller uses are re-exported here.
"""

from trainguard.controller.signals.catalogue import (
    DEFAULT_TRACKED,
    IB_COUNTERS,
    IB_HW_COUNTERS,
    SCOPES,
    SIGNALS,
    SignalSpec,
)
from trainguard.controller.signals.getters import (
    EvalContext,
    Getter,
    getter,
    series_getter,
    target_of,
)
from trainguard.controller.signals.series import Series
from trainguard.controller.signals.state import SIGNAL_EVENT_KINDS, SignalState, XidCatalog

__all__ = [
    "DEFAULT_TRACKED",
    "IB_COUNTERS",
    "IB_HW_COUNTERS",
    "SCOPES",
    "SIGNALS",
    "SIGNAL_EVENT_KINDS",
    "EvalContext",
    "Getter",
    "Series",
    "SignalSpec",
    "SignalState",
    "XidCatalog",
    "getter",
    "series_getter",
    "target_of",
]
