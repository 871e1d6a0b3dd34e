"""Strict configuration loading: YAML/dicts into nested frozen dataclasses.

Unknown keys, wrong types and broken invariants fail at load with the file, the dotted key and
the reason; a typo is never silently defaulted. Shared by agent and controller config; the
decoding itself is the one decoder's (`trainguard.decode`), the same that reads the wire.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, TypeVar

import yaml

from trainguard.decode import DecodeError, Invalid, decoder, type_name

__all__ = [
    "ConfigError",
    "Invalid",
    "apply_overrides",
    "build",
    "load_file",
    "load_yaml",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, naming where (file), what (dotted key) and why."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        self.source = source
        self.key = key
        self.reason = reason
        where = f"{source}: " if source else ""
        what = f"{key}: " if key else ""
        super().__init__(f"{where}{what}{reason}")


def load_yaml(path: str | Path) -> Any:
    """Read a YAML file; errors name the file (and line, where YAML says)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(str(p), "", "file not found") from None
    except OSError as e:
        raise ConfigError(str(p), "", f"cannot read: {e.strerror or e}") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(str(p), "", f"invalid YAML: {e}") from None


def load_file(cls: type[T], path: str | Path, *, overrides: dict[str, Any] | None = None) -> T:
    """Load dataclass `cls` from a YAML file, then apply dotted-key `overrides` (from flags)."""
    data = load_yaml(path)
    if data is None:
        data = {}
    return build(cls, apply_overrides(data, overrides or {}, source=str(path)), source=str(path))


def apply_overrides(data: Any, overrides: dict[str, Any], *, source: str) -> dict[str, Any]:
    """Return a copy of `data` with {"a.b": v} overrides set (None values are ignored)."""
    if not isinstance(data, dict):
        raise ConfigError(source, "", f"expected a mapping at the top level, got {type_name(data)}")
    out: dict[str, Any] = _deepcopy(data)
    for dotted, value in overrides.items():
        if value is None:
            continue
        cur = out
        parts = dotted.split(".")
        for part in parts[:-1]:
            nxt = cur.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ConfigError(source, dotted, f"{part} is not a mapping")
            cur = nxt
        cur[parts[-1]] = value
    return out


def _deepcopy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in d.items()}


def build(cls: type[T], data: Any, *, source: str = "", prefix: str = "") -> T:
    """Construct dataclass `cls` from plain data, strictly; errors name `source` and the
    dotted key under `prefix`."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, prefix or "(top)", f"expected a mapping, got {type_name(data)}")
    try:
        return decoder(cls, lenient=True).decode(data)
    except DecodeError as e:
        raise ConfigError(source, _join(prefix, e.path), e.reason) from None


def _join(prefix: str, key: str) -> str:
    if not key:
        return prefix
    return f"{prefix}.{key}" if prefix else key
