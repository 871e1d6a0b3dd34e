"""The one decoder: plain data (parsed JSON or YAML, or JSON bytes) into frozen dataclasses.

Each class is compiled once, with the classes it nests, into a pydantic-core schema that
accepts exactly the declared types: unknown keys fail, nothing is coerced (no "1" for 1, no
true for 1, no 1.0 for an int; an int is a valid float; non-finite floats travel as "NaN",
"Infinity", "-Infinity"), every `__post_init__` runs, and the dataclasses come out as if
constructed. The first problem, in the order the input reads, becomes one DecodeError with
its dotted path and a reason in words; an `Invalid(key, reason)` from `__post_init__` names
its key under the object's path. Bounds are part of the schema: every integer fits int64
(what SQLite stores and a float exports), every `Any` value too, and a field annotated
`Annotated[T, Bound(...)]` is also held to its range, finiteness, pattern, length or count
(the named bounds live in `trainguard.bounds`); a value outside one is an error whose
`out_of_bounds` is true. Config (`lenient=True`) also takes what YAML and Python
callers hand over: a tuple for a list, and any mapping key, made a string.
`trainguard.strict.build` (config files) and `trainguard.protocol` (the wire) are its edges.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import enum
import functools
import types
import typing
from typing import Any, Generic, TypeVar, Union

from pydantic_core import PydanticCustomError, SchemaValidator, ValidationError
from pydantic_core import core_schema as cs

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "NONFINITE",
    "Bound",
    "DecodeError",
    "Decoder",
    "Invalid",
    "core_schema",
    "decoder",
    "type_name",
]

T = TypeVar("T")

# How non-finite floats travel in JSON (which has no NaN): as these strings.
NONFINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Bound:
    """What a field may hold beyond its type, as `Annotated[T, Bound(...)]` metadata.

    ge/le: numbers (an int's always lie within int64); finite: a float that is neither NaN
    nor infinite; pattern: a string matching it whole (a regular expression without anchors);
    max_length: characters of a string; max_items: entries of a list or mapping."""

    ge: float | None = None
    le: float | None = None
    finite: bool = False
    pattern: str | None = None
    max_length: int | None = None
    max_items: int | None = None


class Invalid(ValueError):
    """Raised by a dataclass's `__post_init__` to reject a value; `key` is relative to it."""

    def __init__(self, key: str, reason: str) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{key}: {reason}")


class DecodeError(ValueError):
    """Data that does not fit the class: `path` is the dotted key ("" for the whole);
    `out_of_bounds`: the value had the right type but lay outside a bound."""

    def __init__(self, path: str, reason: str, *, out_of_bounds: bool = False) -> None:
        self.path = path
        self.reason = reason
        self.out_of_bounds = out_of_bounds
        super().__init__(f"{path}: {reason}" if path else reason)


def type_name(value: Any) -> str:
    """A value's type in the words of a JSON/YAML reader."""
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list"}.get(
        type(value), type(value).__name__
    )


# --- compiling -------------------------------------------------------------------------------


def _nonfinite(value: str) -> float:
    return NONFINITE[value]


def _float_schema() -> cs.CoreSchema:
    # allow_inf_nan: Python's json writes and reads the bare tokens NaN/Infinity
    return cs.union_schema(
        [
            cs.float_schema(strict=True, allow_inf_nan=True),
            cs.no_info_after_validator_function(_nonfinite, cs.literal_schema(list(NONFINITE))),
        ],
        custom_error_type="number_type",
        custom_error_message="expected a number",
    )


def _bounded_float_schema(bound: Bound) -> cs.CoreSchema:
    if bound.finite:
        return cs.float_schema(strict=True, allow_inf_nan=False, ge=bound.ge, le=bound.le)
    if bound.ge is None and bound.le is None:
        return _float_schema()
    return cs.no_info_after_validator_function(
        functools.partial(_float_range, ge=bound.ge, le=bound.le), _float_schema()
    )


def _float_range(value: float, *, ge: float | None, le: float | None) -> float:
    # NaN compares false both ways, so a NaN passes a range that is not also `finite`
    if ge is not None and value < ge:
        raise PydanticCustomError("greater_than_equal", "too small", {"ge": ge})
    if le is not None and value > le:
        raise PydanticCustomError("less_than_equal", "too large", {"le": le})
    return value


def _int64_any(value: Any) -> Any:
    """An `Any` value whose integers, however deep, fit int64 (SQLite's and a float's)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is int:
            if not INT64_MIN <= v <= INT64_MAX:
                raise PydanticCustomError(
                    "int64_range", "integer out of range", {"ge": INT64_MIN, "le": INT64_MAX}
                )
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)
    return value


def _list_of_tuple(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


class _Builder:
    """Turns dataclass type hints into one core schema with a definition per dataclass."""

    def __init__(self, *, lenient: bool, version: int | None) -> None:
        self.lenient = lenient
        self.version = version
        self.refs: dict[type, str] = {}
        self.defs: list[cs.CoreSchema] = []

    def dataclass(self, cls: type, *, top: bool = False) -> cs.CoreSchema:
        ref = self.refs.get(cls)
        if ref is None:
            # the class name, as the published JSON schemas call it, unless another class has it
            taken = cls.__name__ in self.refs.values()
            ref = f"{cls.__module__}.{cls.__qualname__}" if taken else cls.__name__
            self.refs[cls] = ref  # before the fields: a class may nest itself
            place = len(self.defs)  # outer classes first, as they were met
            self.defs.append(cs.definition_reference_schema(ref))
            self.defs[place] = self._dataclass_schema(cls, ref=ref, top=top)
        return cs.definition_reference_schema(ref)

    def _dataclass_schema(self, cls: type, *, ref: str, top: bool) -> cs.CoreSchema:
        hints = _hints(cls)
        fields: list[cs.DataclassField] = []
        for f in _init_fields(cls):
            inner: cs.CoreSchema
            if top and f.name == "v" and self.version is not None:
                inner = cs.no_info_after_validator_function(
                    functools.partial(_check_version, expected=self.version),
                    cs.int_schema(strict=True),
                )
            else:
                inner = self.type_schema(hints[f.name])
            if f.default is not dataclasses.MISSING:
                inner = cs.with_default_schema(inner, default=f.default)
            elif f.default_factory is not dataclasses.MISSING:
                inner = cs.with_default_schema(inner, default_factory=f.default_factory)
            fields.append(cs.dataclass_field(f.name, inner))
        args = cs.dataclass_args_schema(cls.__name__, fields, extra_behavior="forbid")
        return cs.dataclass_schema(
            cls,
            args,
            [f.name for f in _init_fields(cls)],
            frozen=cls.__dataclass_params__.frozen,  # type: ignore[attr-defined]
            post_init=hasattr(cls, "__post_init__"),
            ref=ref,
            strict=False,  # a mapping, not an instance, is what arrives
        )

    def type_schema(self, tp: Any) -> cs.CoreSchema:
        bound = Bound()
        if typing.get_origin(tp) is typing.Annotated:
            tp, *meta = typing.get_args(tp)
            found = [m for m in meta if isinstance(m, Bound)]
            if len(found) == 1:
                bound = found[0]
            elif found:
                raise TypeError(f"one Bound per field, got {len(found)}")
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if tp is Any:
            return cs.no_info_after_validator_function(_int64_any, cs.any_schema())
        if origin is Union or origin is types.UnionType:
            members = [a for a in args if a is not type(None)]
            if len(members) != 1:
                raise TypeError(f"unsupported type {tp!r}: only X | None unions decode")
            return cs.nullable_schema(self.type_schema(members[0]))
        if origin is typing.Literal:
            return cs.literal_schema(list(args))
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            # a kind table: its values on the wire, its member once decoded
            return cs.no_info_after_validator_function(tp, cs.literal_schema([m.value for m in tp]))
        if origin in (list, tuple) or tp in (list, tuple):
            items: cs.CoreSchema = cs.list_schema(
                self.type_schema(args[0] if args else Any),
                strict=True,
                max_length=bound.max_items,
            )
            if self.lenient:
                items = cs.no_info_before_validator_function(_list_of_tuple, items)
            if origin is tuple or tp is tuple:
                return cs.no_info_after_validator_function(tuple, items)
            return items
        if origin in (dict, collections.abc.Mapping) or tp is dict:
            keys = (
                cs.no_info_plain_validator_function(str)
                if self.lenient
                else cs.str_schema(strict=True)
            )
            values = self.type_schema(args[1] if len(args) == 2 else Any)
            return cs.dict_schema(keys, values, strict=True, max_length=bound.max_items)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.dataclass(tp)
        if tp is bool:
            return cs.bool_schema(strict=True)
        if tp is int:
            ge = INT64_MIN if bound.ge is None else max(INT64_MIN, int(bound.ge))
            le = INT64_MAX if bound.le is None else min(INT64_MAX, int(bound.le))
            return cs.int_schema(strict=True, ge=ge, le=le)
        if tp is float:
            return _bounded_float_schema(bound)
        if tp is str:
            pattern = None if bound.pattern is None else f"^(?:{bound.pattern})$"
            return cs.str_schema(strict=True, pattern=pattern, max_length=bound.max_length)
        raise TypeError(f"unsupported type {tp!r}")


def _check_version(value: int, *, expected: int) -> int:
    if value != expected:
        raise PydanticCustomError("version", "unsupported protocol version")
    return value


@functools.cache
def core_schema(cls: type, *, lenient: bool = False, version: int | None = None) -> cs.CoreSchema:
    """The compiled schema of dataclass `cls`. `version`: its top-level `v` field must equal
    it (the wire's protocol version). `lenient`: config's tuple-for-list and any-key leniency."""
    b = _Builder(lenient=lenient, version=version)
    root = b.dataclass(cls, top=True)
    return cs.definitions_schema(root, b.defs)


class Decoder(Generic[T]):
    """Decodes into dataclass `cls`: `decode()` for parsed data, `decode_json()` for bytes.

    Failures raise what `error()` makes of them (a DecodeError here; the wire makes its own).
    """

    def __init__(self, cls: type[T], *, lenient: bool = False, version: int | None = None) -> None:
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            raise TypeError(f"{cls!r} is not a dataclass")
        self.cls = cls
        self.version = version
        self._validator = SchemaValidator(
            core_schema(typing.cast(type, cls), lenient=lenient, version=version)
        )

    def decode(self, data: Any) -> T:
        try:
            out = self._validator.validate_python(data)
        except ValidationError as e:
            raise self._failed(e) from None
        return typing.cast(T, out)

    def decode_json(self, raw: bytes | str) -> T:
        try:
            out = self._validator.validate_json(raw)
        except ValidationError as e:
            raise self._failed(e) from None
        return typing.cast(T, out)

    def _failed(self, e: ValidationError) -> Exception:
        path, reason, out_of_bounds = _explain(self.cls, e, version=self.version)
        err = self.error(path, reason)
        if out_of_bounds:
            err.out_of_bounds = True  # type: ignore[attr-defined]
        return err

    def error(self, path: str, reason: str) -> Exception:
        return DecodeError(path, reason)


_DECODERS: dict[tuple[type, bool], Decoder[Any]] = {}


def decoder(cls: type[T], *, lenient: bool = False) -> Decoder[T]:
    """The (cached) decoder for dataclass `cls`, raising DecodeError."""
    found = _DECODERS.get((cls, lenient))
    if found is None:
        found = _DECODERS[(cls, lenient)] = Decoder(cls, lenient=lenient)
    return typing.cast("Decoder[T]", found)  # a string: no generic alias built per call


# --- explaining a failure --------------------------------------------------------------------


def explain(cls: type, e: ValidationError, *, version: int | None = None) -> tuple[str, str]:
    """(dotted path, reason) of the first problem in `e`, in the order the input reads: at
    each object its unknown keys, then its fields in declared order (and, on the wire, the
    protocol version before anything). Anything but `Invalid` that a `__post_init__` raised
    is raised again as it was."""
    path, reason, _ = _explain(cls, e, version=version)
    return path, reason


def _explain(cls: type, e: ValidationError, *, version: int | None = None) -> tuple[str, str, bool]:
    errors = e.errors(include_url=False)
    first_seen: dict[tuple[Any, ...], int] = {}
    for i, err in enumerate(errors):
        loc = tuple(err["loc"])
        for n in range(len(loc) + 1):
            first_seen.setdefault(loc[:n], i)
    walked = [_walk(cls, tuple(err["loc"]), first_seen) for err in errors]

    def order(i: int) -> tuple[int, tuple[tuple[int, int], ...]]:
        on_version = version is not None and tuple(errors[i]["loc"]) == ("v",)
        return (0 if on_version else 1, walked[i].rank)

    i = min(range(len(errors)), key=order)
    bounded = _bound_reason(errors[i])
    if bounded is not None:
        return walked[i].path, bounded, True
    path, reason = _reason(cls, errors[i], walked[i], version=version)
    return path, reason, False


def _bound_reason(err: Any) -> str | None:
    """The reason for a value of the right type outside a bound, or None for any other
    error. The offending value is quoted only when short: it may be 10**400 or 4 MB."""
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind in ("greater_than_equal", "less_than_equal", "int64_range"):
        low, high = ctx.get("ge"), ctx.get("le")
        if kind == "int64_range":
            return f"out of range: integers must lie in [{low}, {high}]"
        if kind == "greater_than_equal":
            return f"out of range: at least {_num(low)}, got {_short(err.get('input'))}"
        return f"out of range: at most {_num(high)}, got {_short(err.get('input'))}"
    value = err.get("input")
    if kind == "finite_number" or (
        kind == "float_type" and isinstance(value, str) and value in NONFINITE
    ):
        # the strings "NaN"/"Infinity" are a float type error only where a bound is finite
        return f"must be a finite number, got {_short(err.get('input'))}"
    if kind in ("number_type", "float_type") and type(value) is int:
        # an int is a valid float unless it is beyond a float's range (10**400)
        return f"out of range: beyond a float's range, got {_short(value)}"
    if kind == "string_too_long":
        return f"too long: at most {ctx.get('max_length')} characters"
    if kind == "string_pattern_mismatch":
        pattern = str(ctx.get("pattern", ""))
        if pattern.startswith("^(?:") and pattern.endswith(")$"):
            pattern = pattern[4:-2]
        return f"must match {pattern}, got {_short(err.get('input'))}"
    if kind == "too_long":
        return f"too many entries: at most {ctx.get('max_length')}"
    return None


def _num(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}... ({len(text)} characters)"


@dataclasses.dataclass(frozen=True)
class _Spot:
    path: str
    tp: Any  # the declared type at the error
    parent: type | None  # the dataclass holding an unknown key, when the error is one
    key: str  # that unknown key
    rank: tuple[tuple[int, int], ...]


def _walk(cls: type, loc: tuple[Any, ...], first_seen: dict[tuple[Any, ...], int]) -> _Spot:
    tp: Any = cls
    path = ""
    rank: list[tuple[int, int]] = []
    for n, part in enumerate(loc):
        tp = _unoptional(tp)
        origin = typing.get_origin(tp)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            names = [f.name for f in _init_fields(tp)]
            if part not in names:
                # an unknown key: reported before the object's fields, like a reader sees it
                rank.append((0, first_seen[loc[: n + 1]]))
                return _Spot(_join(path, str(part)), Any, tp, str(part), tuple(rank))
            rank.append((1, names.index(part)))
            tp = _hints(tp)[part]
            path = _join(path, part)
        elif part == "[key]":
            tp = str  # a mapping's key itself
        else:
            rank.append((2, first_seen[loc[: n + 1]]))
            args = typing.get_args(tp)
            if origin in (list, tuple) or tp in (list, tuple):
                tp = args[0] if args else Any
                path = f"{path}[{part}]"
            else:
                tp = args[1] if len(args) == 2 else Any
                path = _join(path, str(part))
    return _Spot(path, tp, None, "", tuple(rank))


def _reason(cls: type, err: Any, spot: _Spot, *, version: int | None) -> tuple[str, str]:
    kind = err["type"]
    value = err.get("input")
    if spot.parent is not None:
        names = [f.name for f in _init_fields(spot.parent)]
        close = difflib.get_close_matches(spot.key, names, n=1)
        return spot.path, "unknown key" + (f" (did you mean {close[0]!r}?)" if close else "")
    if kind in ("missing", "missing_keyword_argument"):
        return spot.path, "required key is missing"
    if kind == "json_invalid":
        return "", f"invalid JSON: {err.get('ctx', {}).get('error', err['msg'])}"
    if kind == "value_error":
        cause = err.get("ctx", {}).get("error")
        if isinstance(cause, Invalid):
            return _join(spot.path, cause.key), cause.reason
        if isinstance(cause, BaseException):
            raise cause  # not the decoder's to explain: it fails as the constructor would
    if kind == "dataclass_type" and not spot.path:
        return "", f"expected a JSON object for {cls.__name__}"
    if version is not None and spot.path == "v" and value != version:
        return "v", f"unsupported protocol version {value!r}"
    return spot.path, _expected(spot.tp, value) or str(err["msg"])


def _expected(tp: Any, value: Any) -> str | None:
    tp = _unoptional(tp)
    origin = typing.get_origin(tp)
    got = type_name(value)
    if origin is typing.Literal:
        allowed = ", ".join(repr(a) for a in typing.get_args(tp))
        return f"must be one of {allowed}, got {value!r}"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        allowed = ", ".join(repr(m.value) for m in tp)
        return f"must be one of {allowed}, got {value!r}"
    if origin in (list, tuple) or tp in (list, tuple):
        return f"expected a list, got {got}"
    if origin in (dict, collections.abc.Mapping) or tp is dict:
        return f"expected a mapping, got {got}"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"expected a mapping, got {got}"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return f"expected {words[tp]}, got {got}" if tp in words else None


def _unoptional(tp: Any) -> Any:
    """The type under `X | None` and `Annotated[X, ...]` (in any nesting)."""
    while True:
        if typing.get_origin(tp) is typing.Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if typing.get_origin(tp) in (Union, types.UnionType):
            members = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(members) == 1:
                tp = members[0]
                continue
        return tp


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True)


@functools.cache
def _init_fields(cls: type) -> tuple[dataclasses.Field[Any], ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init)


def _join(prefix: str, key: str) -> str:
    if not key:
        return prefix
    return f"{prefix}.{key}" if prefix else key
