"""The wire messages' published JSON schemas, and the decoder the controller API uses.

Both come from one compiled schema per message (`trainguard.decode`): the JSON schema in the
OpenAPI document is generated from exactly the schema that validates requests, so it
describes the wire as decoded. `decoder` is `trainguard.protocol.decoder`, the one decoder.
(The full pydantic package, for the JSON schema generator, is imported here only.)
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import core_schema as cs

from trainguard.decode import core_schema
from trainguard.protocol import PROTOCOL_VERSION, WireDecoder, decoder

__all__ = ["WireDecoder", "decoder", "json_schema", "wire_schema"]


def wire_schema(cls: type) -> cs.CoreSchema:
    """The core schema of message class `cls` (its `v` field, if any, must equal the
    protocol version)."""
    return core_schema(cls, version=PROTOCOL_VERSION)


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
