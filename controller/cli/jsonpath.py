"""`-o jsonpath=TEMPLATE`: a small subset of kubectl's JSONPath, evaluated without a library.

A template is text with `{...}` expressions in it. An expression is a path from the printed
object: `.key` (a field), `[N]` (the Nth item, from 0; negative counts from the end), `[*]`
(every item, or every value of a mapping), chained: `{.items[*].name}`, `{.items[0].state}`,
`{.labels.rack}`, `{.}` (the whole object); or a quoted literal, `{"\\n"}`, `{"\\t"}`. A list
printed by `get` is the object `{"items": [...]}`. An expression with several results prints
them separated by spaces; a string prints as it is, anything else as JSON; a missing field
prints nothing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["Template", "TemplateError", "parse_template"]


class TemplateError(ValueError):
    pass


@dataclass(frozen=True)
class _Field:
    name: str


@dataclass(frozen=True)
class _Index:
    n: int


@dataclass(frozen=True)
class _All:
    pass


_Step = _Field | _Index | _All
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_-]*)|\[(-?\d+)\]|\[\*\]|\.\*")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\"}


def _parse_path(expr: str) -> tuple[_Step, ...]:
    if expr == ".":
        return ()
    if not expr.startswith((".", "[")):
        raise TemplateError(f"{{{expr}}}: a path starts with '.' (e.g. {{.items[*].name}})")
    steps: list[_Step] = []
    pos = 0
    while pos < len(expr):
        m = _STEP.match(expr, pos)
        if m is None:
            raise TemplateError(
                f"{{{expr}}}: cannot read {expr[pos:]!r} (supported: .field, [N], [*])"
            )
        if m.group(1) is not None:
            steps.append(_Field(m.group(1)))
        elif m.group(2) is not None:
            steps.append(_Index(int(m.group(2))))
        else:
            steps.append(_All())
        pos = m.end()
    return tuple(steps)


def _literal(expr: str) -> str:
    body = expr[1:-1]
    out: list[str] = []
    i = 0
    while i < len(body):
        c = body[i]
        if c == "\\" and i + 1 < len(body):
            nxt = body[i + 1]
            if nxt not in _ESCAPES:
                raise TemplateError(f"{{{expr}}}: unknown escape \\{nxt}")
            out.append(_ESCAPES[nxt])
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class Template:
    """A parsed template: literal text (str) and paths, in order."""

    parts: tuple[str | tuple[_Step, ...], ...]

    def render(self, root: Any) -> str:
        out: list[str] = []
        for part in self.parts:
            if isinstance(part, str):
                out.append(part)
            else:
                out.append(" ".join(_text(v) for v in _follow([root], part)))
        return "".join(out)


def parse_template(text: str) -> Template:
    """Parse a jsonpath template; TemplateError says what is wrong."""
    parts: list[str | tuple[_Step, ...]] = []
    pos = 0
    while pos < len(text):
        start = text.find("{", pos)
        if start < 0:
            parts.append(text[pos:])
            break
        if start > pos:
            parts.append(text[pos:start])
        end = text.find("}", start)
        if end < 0:
            raise TemplateError(f"unclosed '{{' at {start}")
        expr = text[start + 1 : end].strip()
        if not expr:
            raise TemplateError(f"empty expression at {start}")
        if len(expr) >= 2 and expr[0] == expr[-1] == '"':
            parts.append(_literal(expr))
        else:
            parts.append(_parse_path(expr))
        pos = end + 1
    if not parts:
        raise TemplateError("empty template")
    return Template(tuple(parts))


def _follow(values: list[Any], steps: tuple[_Step, ...]) -> list[Any]:
    for step in steps:
        nxt: list[Any] = []
        for v in values:
            if isinstance(step, _Field):
                if isinstance(v, dict) and step.name in v:
                    nxt.append(v[step.name])
            elif isinstance(step, _Index):
                if isinstance(v, list) and -len(v) <= step.n < len(v):
                    nxt.append(v[step.n])
            elif isinstance(v, list):
                nxt.extend(v)
            elif isinstance(v, dict):
                nxt.extend(v.values())
        values = nxt
    return values


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), sort_keys=True)
