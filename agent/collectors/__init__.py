"""Hardware collectors for the agent: NVML GPUs and NVLink, XIDs from the kernel log, InfiniBand.

Each collector returns the frozen dataclasses of `trainguard.model`; none imports a heavy library at
module level (pynvml is imported inside `NvmlGpuCollector` only when no module is injected).
This package also owns the one PCI bus id normal form that NVML and the kernel log are mapped to.
"""

from __future__ import annotations

import re

__all__ = ["bus_id_device_prefix", "normalize_bus_id"]

# domain:bus:device[.function]; NVML writes an 8-digit domain ("00000000:18:00.0"), the
# kernel a 4-digit one ("0000:18:00"), some tools omit the domain ("18:00.0").
_BUS_ID_RE = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]{1,8}):)?(?P<bus>[0-9a-fA-F]{1,2}):(?P<device>[0-9a-fA-F]{1,2})"
    r"(?:\.(?P<function>[0-7]))?$"
)


def normalize_bus_id(raw: str | bytes, *, default_function: int = 0) -> str:
    """The normal form of a PCI bus id: "0000:18:00.0" (lower-case hex, 4-digit domain).

    A missing function becomes `default_function` (a GPU is function 0; the kernel's
    "PCI:0000:18:00" names domain, bus and device only). Raises ValueError on anything else.
    """
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    text = text.strip().rstrip("\x00")
    if text.upper().startswith("PCI:"):
        text = text[4:]
    m = _BUS_ID_RE.match(text)
    if m is None:
        raise ValueError(f"not a PCI bus id: {text[:40]!r}")
    domain = int(m.group("domain") or "0", 16)
    function = int(m.group("function")) if m.group("function") is not None else default_function
    return f"{domain:04x}:{int(m.group('bus'), 16):02x}:{int(m.group('device'), 16):02x}.{function}"


def bus_id_device_prefix(normalized: str) -> str:
    """ "0000:18:00.0" -> "0000:18:00": the part the kernel log prints, for prefix matching."""
    return normalized.rsplit(".", 1)[0]
