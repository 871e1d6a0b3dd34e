"""The XID classification table (rules/xid_catalog.yaml): which XIDs are fatal, caused by the
application, or informational, and what to do about each.

The table is data so operators can reclassify a code without a release; this module loads it
strictly (unknown keys, bad severities and duplicate codes fail naming file, code and reason)
and answers `classify(code, message)` for the agent and the controller: for most codes the
entry decides, for NVLink5 (144-150) and XID 154 the driver's own words in the line do.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from trainguard.rules import shipped_dir
from trainguard.strict import ConfigError, Invalid, build

__all__ = [
    "ACTIONS",
    "DECIDERS",
    "MAX_XID_CODE",
    "SEVERITIES",
    "XidCatalog",
    "XidInfo",
    "default_catalog_path",
    "recovery_action",
]

Severity = Literal["fatal", "application", "informational"]
Action = Literal["none", "restart_job", "reset_gpu", "reboot_node", "drain"]
SEVERITIES: tuple[str, ...] = ("fatal", "application", "informational")
ACTIONS: tuple[str, ...] = ("none", "restart_job", "reset_gpu", "reboot_node", "drain")
Decider = Literal["fatal_word", "recovery_action"]
DECIDERS: tuple[str, ...] = ("fatal_word", "recovery_action")
CATALOG_VERSION = 1
MAX_XID_CODE = 1023  # NVIDIA's codes are small; a larger one is a typo or garbage, not an XID


@dataclass(frozen=True)
class XidInfo:
    code: int
    name: str
    severity: Severity
    action: str  # one of ACTIONS: "none", "restart_job", "reset_gpu", "reboot_node", "drain"
    description: str
    decided_by: str | None = None  # one of DECIDERS: the line's own words decide
    source: str = ""  # where the classification comes from
    differs: str = ""  # why trainguard departs from the source, where it does

    @property
    def known(self) -> bool:
        return self.name != _UNKNOWN_NAME


_UNKNOWN_NAME = "Unknown XID"


@dataclass(frozen=True)
class _EntrySpec:
    """One `xids.<code>` mapping in the YAML file."""

    name: str
    severity: Severity
    action: Action
    description: str = ""
    decided_by: Decider | None = None
    source: str = ""
    differs: str = ""

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise Invalid("name", "must not be empty")


class _UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a mapping key given twice (YAML would keep the last silently,
    and a pasted duplicate XID would quietly reclassify a code)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def default_catalog_path() -> Path:
    """The shipped table: package data of `trainguard.rules`, wherever it is installed."""
    return shipped_dir() / "xid_catalog.yaml"


class XidCatalog:
    """The loaded table; immutable once built."""

    def __init__(self, entries: dict[int, XidInfo], *, source: str = "") -> None:
        self._entries = dict(entries)
        self.source = source
        self._fatal = frozenset(c for c, e in self._entries.items() if e.severity == "fatal")

    @classmethod
    def load(cls, path: str | Path | None = None) -> XidCatalog:
        """Load and validate the table; `path=None` means the shipped `rules/xid_catalog.yaml`."""
        p = Path(path) if path is not None else default_catalog_path()
        source = str(p)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(source, "", "file not found") from None
        except OSError as e:
            raise ConfigError(source, "", f"cannot read: {e.strerror or e}") from None
        try:
            data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as e:
            raise ConfigError(source, "", f"invalid YAML: {e}") from None
        return cls.from_data(data, source=source)

    @classmethod
    def from_data(cls, data: Any, *, source: str = "") -> XidCatalog:
        """Build from already-parsed YAML (a mapping with `version` and `xids`)."""
        if not isinstance(data, dict):
            raise ConfigError(source, "", "expected a mapping with 'version' and 'xids'")
        for key in data:
            if key not in ("version", "xids"):
                raise ConfigError(source, str(key), "unknown key (expected 'version' or 'xids')")
        version = data.get("version")
        if version != CATALOG_VERSION:
            raise ConfigError(
                source, "version", f"unsupported catalog version {version!r}, expected 1"
            )
        xids = data.get("xids")
        if not isinstance(xids, dict) or not xids:
            raise ConfigError(source, "xids", "expected a non-empty mapping of XID code to entry")
        entries: dict[int, XidInfo] = {}
        for raw_code, raw_entry in xids.items():
            if isinstance(raw_code, bool) or not isinstance(raw_code, int):
                raise ConfigError(source, f"xids.{raw_code}", "XID code must be an integer")
            if not 0 < raw_code <= MAX_XID_CODE:
                raise ConfigError(source, f"xids.{raw_code}", f"XID code must be 1..{MAX_XID_CODE}")
            spec = build(_EntrySpec, raw_entry, source=source, prefix=f"xids.{raw_code}")
            entries[raw_code] = XidInfo(
                code=raw_code,
                name=spec.name.strip(),
                severity=spec.severity,
                action=spec.action,
                description=" ".join(spec.description.split()),
                decided_by=spec.decided_by,
                source=" ".join(spec.source.split()),
                differs=" ".join(spec.differs.split()),
            )
        return cls(entries, source=source)

    def get(self, code: int) -> XidInfo:
        """The entry for `code`; an unlisted code gets an informational "unknown" entry."""
        entry = self._entries.get(code)
        if entry is not None:
            return entry
        return XidInfo(
            code=code,
            name=_UNKNOWN_NAME,
            severity="informational",
            action="none",
            description=f"XID {code} is not in the catalog ({self.source or 'built-in'}).",
        )

    def classify(self, code: int, message: str = "") -> XidInfo:
        """The entry for one reported line: `get(code)`, with severity and action decided by
        the line where the entry says so (`decided_by`). `message` is the text after the code
        (`HardwareEvent.message`)."""
        entry = self.get(code)
        if entry.decided_by == "fatal_word":
            m = _FATAL_WORD_RE.search(message)
            if m is not None and m.group(1).lower().startswith("non"):
                return dataclasses.replace(entry, severity="informational", action="none")
        elif entry.decided_by == "recovery_action":
            decided = recovery_action(message)
            if decided is not None:
                severity, action = decided
                return dataclasses.replace(entry, severity=severity, action=action)
        return entry

    def fatal_codes(self) -> frozenset[int]:
        """Codes whose entry is fatal; a line of a `decided_by` code may still be classified
        otherwise by `classify`."""
        return self._fatal

    def codes(self) -> tuple[int, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, code: object) -> bool:
        return code in self._entries

    def __len__(self) -> int:
        return len(self._entries)


# "..., RLW_SRC_TRACK Nonfatal XC1 i0 Link 03 (...)", "..., RLW, nonfatal, cross-contain=0, ..."
_FATAL_WORD_RE = re.compile(r"\b(non-?fatal|fatal)\b", re.IGNORECASE)
# "GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"
_RECOVERY_RE = re.compile(
    r"recovery action changed from 0x[0-9a-fA-F]+ \([^)]*\) to 0x(?P<code>[0-9a-fA-F]+)"
    r"(?: \((?P<name>[^)]*)\))?",
    re.IGNORECASE,
)
# nvmlDeviceGpuRecoveryAction_t: the new action's number, with the words drivers print for it
_RECOVERY_ACTIONS: dict[int, tuple[Severity, str]] = {
    0: ("informational", "none"),  # NONE
    1: ("fatal", "reset_gpu"),  # GPU_RESET ("GPU Reset Required", "PF FLR")
    2: ("fatal", "reboot_node"),  # NODE_REBOOT ("Node Reboot Required", "OS Reboot")
    3: ("fatal", "drain"),  # DRAIN_P2P
    4: ("fatal", "reset_gpu"),  # DRAIN_AND_RESET
    5: ("fatal", "drain"),  # RECOVER_IMEX_DOMAIN
    6: ("fatal", "reset_gpu"),  # BUS_RESET
    7: ("fatal", "reboot_node"),  # SYSTEM_REBOOT
}


def recovery_action(message: str) -> tuple[Severity, str] | None:
    """(severity, action) for an XID 154 line's new recovery action; None if unreadable."""
    m = _RECOVERY_RE.search(message)
    if m is None:
        return None
    return _RECOVERY_ACTIONS.get(int(m.group("code"), 16))
