"""The bounds of what crosses an entry point: the one name pattern nodes and jobs share, the
ranges of times and counts, and how many entries one message may carry.

Every wire message, config file and job spec is decoded by the one decoder
(`trainguard.decode`), which holds each field to the `Bound` its annotation names here, so a
bad value fails the same way (dotted key and reason) whether it came as a datagram, a REST
body or a YAML file. Beyond these, every integer anywhere fits int64: SQLite stores it and a
Prometheus sample (a float) exports it finitely. docs/api.md has the table.
"""

from __future__ import annotations

import re
from typing import Annotated

from trainguard.decode import INT64_MAX, INT64_MIN, Bound

__all__ = [
    "DRAIN_REASON_MAX_CHARS",
    "DURATION_MAX_S",
    "IDENT_PATTERN",
    "IDENT_RE",
    "INT64_MAX",
    "INT64_MIN",
    "LABEL_VALUE_MAX_CHARS",
    "MAX_EVENTS_PER_REPORT",
    "MAX_GPUS_PER_REPORT",
    "MAX_IB_COUNTERS",
    "MAX_IB_PORTS_PER_REPORT",
    "MAX_JOBS_PER_REPORT",
    "MAX_MAP_ENTRIES",
    "MAX_NVLINKS_PER_GPU",
    "MAX_RANKS_PER_REPORT",
    "NAME_MAX_CHARS",
    "NAME_PATTERN",
    "NAME_RE",
    "TEXT_MAX_CHARS",
    "UNIX_TIME_MAX_S",
    "Count",
    "DrainReason",
    "Duration",
    "FiniteFloat",
    "Ident",
    "LabelValue",
    "Name",
    "NameOrEmpty",
    "Text",
    "UnixTime",
    "bad_drain_reason",
    "bad_name_reason",
    "clip_drain_reason",
    "metric_value",
]

# Node and job names, one pattern: a host name or a job name as schedulers write them. No
# spaces or control characters (a name goes into key=value log lines and metric labels), at
# most 128 characters (room for a fully qualified host name).
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
NAME_MAX_CHARS = 128
NAME_RE = re.compile(NAME_PATTERN)
# Kinds, phases, instance, command and request ids: printable ASCII without spaces, bounded.
IDENT_PATTERN = r"[!-~]{1,128}"
IDENT_RE = re.compile(IDENT_PATTERN)

# Unix times: finite, not before the epoch and before 2100-01-01T00:00:00Z. Not later than
# 2000: test and simulated clocks start near zero, and what the store and the exposition need
# is a finite value of a sane size.
UNIX_TIME_MAX_S = 4_102_444_800.0
# Durations and ages, seconds: finite, non-negative, under ~31 years.
DURATION_MAX_S = 1e9
TEXT_MAX_CHARS = 65_536  # free text (messages, output tails): stored, never a label
LABEL_VALUE_MAX_CHARS = 256
# A drain reason, characters: what an operator types or a rule's summary names, recorded in
# the node table and handed to the scheduler (Slurm's `scontrol ... reason=` is one argv
# string: past the kernel's 128 KiB per argument it fails with "Argument list too long").
# One bound for every entry point: REST (422), agentctl, rule- and incident-made reasons and
# the Slurm call (clipped where composed).
DRAIN_REASON_MAX_CHARS = 1024

# Entries one report may carry. A GPU node has 8 GPUs (16 at most today) with 18 NVLinks each
# and up to 16 IB ports; an agent sends at most 500 events a report by default and tracks at
# most 1,024 ranks. Each cap is several times what hardware has, and keeps the cost of one
# report (memory, decode time) bounded whatever a caller sends.
MAX_GPUS_PER_REPORT = 64
MAX_NVLINKS_PER_GPU = 64
MAX_IB_PORTS_PER_REPORT = 256
MAX_IB_COUNTERS = 256  # counters (and hw_counters) per port
MAX_RANKS_PER_REPORT = 1024
MAX_JOBS_PER_REPORT = 256
MAX_EVENTS_PER_REPORT = 1000
MAX_MAP_ENTRIES = 64  # labels, health figures, event data, command args at the top level

Name = Annotated[str, Bound(pattern=NAME_PATTERN)]
NameOrEmpty = Annotated[str, Bound(pattern=f"(?:{NAME_PATTERN})?")]
Ident = Annotated[str, Bound(pattern=IDENT_PATTERN)]
Text = Annotated[str, Bound(max_length=TEXT_MAX_CHARS)]
LabelValue = Annotated[str, Bound(max_length=LABEL_VALUE_MAX_CHARS)]
DrainReason = Annotated[str, Bound(max_length=DRAIN_REASON_MAX_CHARS)]
UnixTime = Annotated[float, Bound(ge=0.0, le=UNIX_TIME_MAX_S, finite=True)]
Duration = Annotated[float, Bound(ge=0.0, le=DURATION_MAX_S, finite=True)]
FiniteFloat = Annotated[float, Bound(finite=True)]
Count = Annotated[int, Bound(ge=0)]


def bad_name_reason(name: str) -> str | None:
    """Why `name` is not a valid node or job name, or None when it is (for names that do not
    arrive through the decoder: path parameters, command-line arguments)."""
    if NAME_RE.fullmatch(name):
        return None
    shown = repr(name) if len(name) <= 40 else f"{name[:20]!r}... ({len(name)} characters)"
    return f"must match {NAME_PATTERN}, got {shown}"


def bad_drain_reason(reason: str) -> str | None:
    """Why `reason` cannot be a drain reason as given (too long), or None when it can; for
    reasons that do not arrive through the decoder (command-line arguments)."""
    if len(reason) <= DRAIN_REASON_MAX_CHARS:
        return None
    return f"at most {DRAIN_REASON_MAX_CHARS} characters, got {len(reason)}"


def clip_drain_reason(reason: str) -> str:
    """`reason` cut to DRAIN_REASON_MAX_CHARS, marked as cut: for reasons trainguard composes
    (an incident's summary, a scheduler's reason string), which must never fail the drain."""
    if len(reason) <= DRAIN_REASON_MAX_CHARS:
        return reason
    marker = "... (cut)"
    return reason[: DRAIN_REASON_MAX_CHARS - len(marker)] + marker


def metric_value(value: object) -> float | None:
    """`value` as a Prometheus sample value, or None when it has none: an integer beyond a
    float's range (10**400), or not a number at all. NaN and infinities are valid samples.
    The exporters skip (and count) a None, so one bad value never breaks /metrics."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if not isinstance(value, int | float):
        return None
    try:
        return float(value)
    except OverflowError:
        return None
