"""The XID classification table (rules/xid_catalog.yaml): which XIDs are fatal, caused by the
application, or informational, and what to do about each.

The table is data so operators can reclassify a code without a release; this module only loads
it strictly (unknown keys, bad severities and duplicate codes fail naming file, code and reason)
and answers `get(code)` / `fatal_codes()` for the agent and the controller's rules engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from trainguard.rules import shipped_dir
from trainguard.strict import ConfigError, Invalid, build

__all__ = ["ACTIONS", "SEVERITIES", "XidCatalog", "XidInfo", "default_catalog_path"]

Severity = Literal["fatal", "application", "informational"]
Action = Literal["none", "restart_job", "reset_gpu", "reboot_node", "drain"]
SEVERITIES: tuple[str, ...] = ("fatal", "application", "informational")
ACTIONS: tuple[str, ...] = ("none", "restart_job", "reset_gpu", "reboot_node", "drain")
CATALOG_VERSION = 1
_MAX_XID = 1023  # NVIDIA's codes are small; a larger key is a typo, not a new XID


@dataclass(frozen=True)
class XidInfo:
    code: int
    name: str
    severity: Severity
    action: str  # one of ACTIONS: "none", "restart_job", "reset_gpu", "reboot_node", "drain"
    description: str

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
            if not 0 < raw_code <= _MAX_XID:
                raise ConfigError(source, f"xids.{raw_code}", f"XID code must be 1..{_MAX_XID}")
            spec = build(_EntrySpec, raw_entry, source=source, prefix=f"xids.{raw_code}")
            entries[raw_code] = XidInfo(
                code=raw_code,
                name=spec.name.strip(),
                severity=spec.severity,
                action=spec.action,
                description=" ".join(spec.description.split()),
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

    def fatal_codes(self) -> frozenset[int]:
        return self._fatal

    def codes(self) -> tuple[int, ...]:
        return tuple(sorted(self._entries))

    def __contains__(self, code: object) -> bool:
        return code in self._entries

    def __len__(self) -> int:
        return len(self._entries)
