"""How every route is registered and documented: `Routes` adds a route to the app with raw
`Response` answers and its documented responses, and `Schemas` generates the OpenAPI component
schemas from the wire dataclasses; `install_openapi` serves the document built from them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response

from trainguard.controller.api.errors import json_bytes
from trainguard.protocol import to_wire
from trainguard.wire_schemas import json_schema

__all__ = [
    "CONTINUE_HEADER",
    "Routes",
    "Schemas",
    "content",
    "error_answers",
    "install_openapi",
    "ok",
    "page",
    "wire_form",
]

# On a full page of a list (GET /v1/jobs, /v1/incidents, /v1/audit, /v1/silences): the
# `continue` value that fetches the next page.
CONTINUE_HEADER = "X-Trainguard-Continue"

H = TypeVar("H", bound=Callable[..., Any])

_REF = "#/components/schemas/{model}"
_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"error": {"type": "string"}, "detail": {}},
    "required": ["error"],
    "title": "Error",
}
_ERROR_TEXT = {
    400: "Bad request",
    401: "Missing or unknown token",
    403: "The token's role may not do this",
    404: "Not found",
    409: "Conflict with the current state",
    413: "Body too large",
    422: "Invalid input (field path and reason in detail)",
}


def wire_form(value: Any) -> Any:
    """A service answer as JSON-ready values: `to_wire` of one message, or of each in a list."""
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    return to_wire(value)


def ok(value: Any, status: int = 200) -> Response:
    """A route's success: the service's answer in its wire form."""
    return Response(json_bytes(wire_form(value)), status_code=status, media_type="application/json")


def page(items: Sequence[Any], *, limit: int, key: Callable[[Any], object]) -> Response:
    """One page of a list route: the first `limit` of `items` (the route asked for one more,
    so that a full page is told from the last); a full page carries CONTINUE_HEADER, the
    `key` of its last item, where the next page starts."""
    reply = ok(list(items[:limit]))
    if len(items) > limit:
        reply.headers[CONTINUE_HEADER] = str(key(items[limit - 1]))
    return reply


class Schemas:
    """Component schemas for the OpenAPI document, generated from the wire dataclasses."""

    def __init__(self) -> None:
        self.components: dict[str, Any] = {"Error": _ERROR_SCHEMA}

    def ref(self, cls: type, *, output: bool = True) -> dict[str, Any]:
        """A $ref to `cls`: as a response (`output`, what to_wire writes) or a request body."""
        schema, defs = json_schema(cls, ref_template=_REF, output=output)
        for name, value in [*defs.items(), (cls.__name__, schema)]:
            known = self.components.setdefault(name, value)
            if known != value:
                raise ValueError(f"schema {name} is both a request and a response shape")
        return {"$ref": _REF.format(model=cls.__name__)}

    def array(self, cls: type) -> dict[str, Any]:
        return {"type": "array", "items": self.ref(cls)}


def content(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def error_answers(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The documented error answers for `codes`, each in the one error shape."""
    err = content({"$ref": _REF.format(model="Error")})
    return {c: {"description": _ERROR_TEXT[c], "content": err} for c in codes}


class Routes:
    """Registers routes on `app` the way every route here is, documenting them in `schemas`."""

    def __init__(self, app: FastAPI, schemas: Schemas) -> None:
        self.app = app
        self.schemas = schemas

    def add(
        self,
        method: str,
        path: str,
        tag: str,
        responses: dict[int | str, dict[str, Any]],
        **options: Any,
    ) -> Callable[[H], H]:
        """Register a route: raw `Response` answers (encoded by `ok`) and the documented
        `responses`."""
        return self.app.api_route(
            path,
            methods=[method],
            tags=[tag],
            response_class=Response,
            responses=responses,
            **options,
        )

    def answer(
        self,
        description: str,
        schema: dict[str, Any],
        errors: tuple[int, ...],
        *,
        status: int = 200,
        paged: bool = False,
    ) -> dict[int | str, dict[str, Any]]:
        """A route's documented answers: its success (`status`; `paged`: a page of a list,
        with CONTINUE_HEADER on a full one), then the error codes it gives."""
        success: dict[str, Any] = {"description": description, "content": content(schema)}
        if paged:
            success["headers"] = {
                CONTINUE_HEADER: {
                    "description": "On a full page: the `continue` value of the next page",
                    "schema": {"type": "string"},
                }
            }
        return {status: success, **error_answers(*errors)}

    def request_body(self, cls: type, *, required: bool = True) -> dict[str, Any]:
        return {
            "requestBody": {
                "required": required,
                "content": content(self.schemas.ref(cls, output=False)),
            }
        }


def install_openapi(app: FastAPI, schemas: Schemas) -> None:
    """Serve the OpenAPI document with the wire schemas in it, built once on first ask."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title,
            version=app.version,
            description="trainguard controller API. Errors are JSON {error, detail}.",
            routes=app.routes,
        )
        _fix_openapi(doc, schemas.components)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]


def _fix_openapi(doc: dict[str, Any], components: dict[str, Any]) -> None:
    """Put the wire schemas in, and make FastAPI's own 422 entries describe our error shape."""
    comps = doc.setdefault("components", {}).setdefault("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    comps.update(components)
    error_content = content({"$ref": _REF.format(model="Error")})
    for path_item in doc.get("paths", {}).values():
        for op in path_item.values():
            responses = op.get("responses", {})
            if "422" in responses:
                responses["422"]["content"] = error_content
