"""Strict configuration loading: YAML/dicts into nested frozen dataclasses.

Unknown keys, wrong types and broken invariants fail at load with the file, the dotted key and
the reason; a typo is never silently defaulted. Shared by agent and controller config.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union

import yaml

T = TypeVar("T")

# How non-finite floats travel in JSON (which has no NaN): as these strings.
NONFINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


class ConfigError(ValueError):
    """A configuration problem, naming where (file), what (dotted key) and why."""

    def __init__(self, source: str, key: str, reason: str) -> None:
        self.source = source
        self.key = key
        self.reason = reason
        where = f"{source}: " if source else ""
        what = f"{key}: " if key else ""
        super().__init__(f"{where}{what}{reason}")


class Invalid(ValueError):
    """Raised by a dataclass's `__post_init__` to reject a value; `key` is relative to it."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


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
        raise ConfigError(source, "", f"expected a mapping at the top level, got {_tname(data)}")
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
    """Construct dataclass `cls` from plain data, strictly."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{cls!r} is not a dataclass")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(source, prefix or "(top)", f"expected a mapping, got {_tname(data)}")
    hints, fields = _schema(cls)
    for key in data:
        if not isinstance(key, str) or key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(source, _join(prefix, str(key)), f"unknown key{hint}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], source, _join(prefix, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(source, _join(prefix, name), "required key is missing")
    try:
        return cls(**kwargs)
    except Invalid as e:
        raise ConfigError(source, _join(prefix, e.key), e.reason) from None


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field[Any]]]:
    # get_type_hints is costly; decoding reports on the hot path needs it once per class
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    return hints, fields


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _tname(v: Any) -> str:
    if v is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list"}.get(
        type(v), type(v).__name__
    )


def _convert(tp: Any, value: Any, source: str, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            # Optional[X]: X's own error keeps its full dotted key (e.g. a.b.c, not a)
            return _convert(options[0], value, source, key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, source, key)
            except ConfigError as e:
                errors.append(e.reason)
        raise ConfigError(source, key, "; ".join(errors) or f"unexpected {_tname(value)}")
    if origin is typing.Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(source, key, f"must be one of {allowed}, got {value!r}")
        return value
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(source, key, f"expected a list, got {_tname(value)}")
        item_t = args[0] if args else Any
        items = [_convert(item_t, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin in (dict, collections.abc.Mapping) or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(source, key, f"expected a mapping, got {_tname(value)}")
        val_t = args[1] if len(args) == 2 else Any
        return {str(k): _convert(val_t, v, source, f"{key}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, value, source=source, prefix=key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(source, key, f"expected true or false, got {_tname(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(source, key, f"expected an integer, got {_tname(value)}")
        return value
    if tp is float:
        if isinstance(value, str) and value in NONFINITE:
            return NONFINITE[value]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(source, key, f"expected a number, got {_tname(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(source, key, f"expected a string, got {_tname(value)}")
        return value
    raise ConfigError(source, key, f"unsupported type {tp!r}")
