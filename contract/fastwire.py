"""Fast, strict decoding of wire messages (reports above all) and their JSON schemas.

`trainguard.protocol.decode_json` walks type hints in Python for every value; at 2,048 nodes x 1 Hz
that is most of a core. Here each message class is compiled once into a pydantic-core schema
that accepts exactly what `trainguard.protocol.from_wire` accepts (unknown keys fail, no coercion:
no "1" for 1, no true for 1, no 1.0 for an int; non-finite floats travel as "NaN",
"Infinity", "-Infinity") and builds the same frozen dataclasses. The same compiled schema also
yields the JSON schema the API publishes, so the OpenAPI document describes the wire exactly.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import types
import typing
from typing import Any, Generic, TypeVar, Union

from pydantic import ValidationError
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import PydanticCustomError, SchemaValidator
from pydantic_core import core_schema as cs

from trainguard.protocol import PROTOCOL_VERSION, ProtocolError
from trainguard.strict import NONFINITE

__all__ = ["WireDecoder", "decoder", "json_schema", "wire_schema"]

T = TypeVar("T")

_NUMBER_ERROR = "expected a number"


def _nonfinite(value: str) -> float:
    return NONFINITE[value]


def _float_schema() -> cs.CoreSchema:
    # allow_inf_nan: Python's json accepts the bare tokens NaN/Infinity, so from_wire does too
    return cs.union_schema(
        [
            cs.float_schema(strict=True, allow_inf_nan=True),
            cs.no_info_after_validator_function(
                _nonfinite, cs.literal_schema(list(NONFINITE)), ref=None
            ),
        ],
        custom_error_type="wire_number",
        custom_error_message=_NUMBER_ERROR,
    )


def _version(value: int) -> int:
    if value != PROTOCOL_VERSION:
        raise PydanticCustomError(
            "wire_version", "unsupported protocol version {v}", {"v": repr(value)}
        )
    return value


class _Builder:
    """Turns dataclass type hints into one core schema with a definition per dataclass."""

    def __init__(self) -> None:
        self.defs: dict[str, cs.CoreSchema] = {}

    def dataclass(self, cls: type, *, top: bool) -> cs.CoreSchema:
        name = cls.__name__
        if name not in self.defs:
            self.defs[name] = cs.definition_reference_schema(name)  # placeholder: recursion
            self.defs[name] = self._dataclass_schema(cls, ref=name, top=top)
        return cs.definition_reference_schema(name)

    def _dataclass_schema(self, cls: type, *, ref: str, top: bool) -> cs.CoreSchema:
        hints = typing.get_type_hints(cls)
        fields: list[cs.DataclassField] = []
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            inner: cs.CoreSchema
            if top and f.name == "v":
                inner = cs.no_info_after_validator_function(
                    _version,
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
            [f.name for f in dataclasses.fields(cls) if f.init],
            frozen=True,
            ref=ref,
            strict=False,  # a JSON object, not an instance, is what arrives
        )

    def type_schema(self, tp: Any) -> cs.CoreSchema:
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if tp is Any:
            return cs.any_schema()
        if origin is Union or origin is types.UnionType:
            members = [a for a in args if a is not type(None)]
            inner = (
                self.type_schema(members[0])
                if len(members) == 1
                else cs.union_schema([self.type_schema(a) for a in members])
            )
            return cs.nullable_schema(inner) if len(members) < len(args) else inner
        if origin is typing.Literal:
            return cs.literal_schema(list(args))
        if origin in (list, tuple) or tp in (list, tuple):
            item = self.type_schema(args[0] if args else Any)
            if origin is tuple or tp is tuple:
                return cs.no_info_after_validator_function(tuple, cs.list_schema(item, strict=True))
            return cs.list_schema(item, strict=True)
        if origin in (dict, collections.abc.Mapping) or tp is dict:
            val = self.type_schema(args[1] if len(args) == 2 else Any)
            return cs.dict_schema(cs.str_schema(strict=True), val, strict=True)
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            return self.dataclass(tp, top=False)
        if tp is bool:
            return cs.bool_schema(strict=True)
        if tp is int:
            return cs.int_schema(strict=True)
        if tp is float:
            return _float_schema()
        if tp is str:
            return cs.str_schema(strict=True)
        raise TypeError(f"unsupported wire type {tp!r}")


@functools.cache
def wire_schema(cls: type) -> cs.CoreSchema:
    """The core schema of message class `cls` (its `v` field, if any, must equal the
    protocol version, as `from_wire` demands)."""
    b = _Builder()
    root = b.dataclass(cls, top=True)
    return cs.definitions_schema(root, list(b.defs.values()))


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out


def _reason(err: Any) -> str:
    kind = err["type"]
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        return "unknown key"
    if kind == "missing":
        return "required key is missing"
    if kind == "json_invalid":
        return f"invalid JSON: {err['msg']}"
    return str(err["msg"])


class WireDecoder(Generic[T]):
    """Decode JSON bytes into message class `cls`; raises ProtocolError like `from_wire`."""

    def __init__(self, cls: type[T]) -> None:
        self.cls = cls
        self._validator = SchemaValidator(wire_schema(typing.cast(type, cls)))

    def decode_json(self, raw: bytes | str) -> T:
        try:
            out = self._validator.validate_json(raw)
        except ValidationError as e:
            raise self._error(e) from None
        return typing.cast(T, out)

    def from_wire(self, data: Any) -> T:
        """Decode an already-parsed JSON value."""
        try:
            out = self._validator.validate_python(data)
        except ValidationError as e:
            raise self._error(e) from None
        return typing.cast(T, out)

    def _error(self, e: ValidationError) -> ProtocolError:
        errors = e.errors(include_url=False, include_input=False)
        first = errors[0]
        loc = tuple(first["loc"])
        if first["type"] == "dataclass_type" and not loc:
            return ProtocolError("", f"expected a JSON object for {self.cls.__name__}")
        if first["type"] == "json_invalid":
            return ProtocolError("", _reason(first))
        return ProtocolError(_path(loc), _reason(first))


_DECODERS: dict[type, WireDecoder[Any]] = {}


def decoder(cls: type[T]) -> WireDecoder[T]:
    """The (cached) decoder for message class `cls`."""
    found = _DECODERS.get(cls)
    if found is None:
        found = _DECODERS[cls] = WireDecoder(cls)
    return typing.cast(WireDecoder[T], found)


def _nullable(schema: Any) -> bool:
    while schema["type"] == "default":
        schema = schema["schema"]
    return bool(schema["type"] == "nullable")


class _WireJsonSchema(GenerateJsonSchema):
    output = False

    def dataclass_args_schema(self, schema: cs.DataclassArgsSchema) -> dict[str, Any]:
        out = super().dataclass_args_schema(schema)
        out["additionalProperties"] = False  # every message forbids unknown keys
        if self.output:
            # to_wire drops None fields and writes every other one, defaults included
            required = [f["name"] for f in schema["fields"] if not _nullable(f["schema"])]
            out.pop("required", None)
            if required:
                out["required"] = required
        return out


class _WireOutputJsonSchema(_WireJsonSchema):
    output = True


def json_schema(
    cls: type, *, ref_template: str = "#/components/schemas/{model}", output: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema, definitions) of `cls` as published in OpenAPI; definitions are keyed by
    class name and referenced through `ref_template`. `output`: describe what `to_wire`
    writes (None fields absent, all others present) instead of what `from_wire` accepts."""
    gen_cls = _WireOutputJsonSchema if output else _WireJsonSchema
    gen = gen_cls(ref_template=ref_template)
    schema = gen.generate(wire_schema(cls), mode="validation")
    defs = schema.pop("$defs", {})
    version = schema.get("properties", {}).get("v")
    if version is not None:
        version["const"] = PROTOCOL_VERSION
    return schema, defs
