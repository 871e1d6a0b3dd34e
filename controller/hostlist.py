"""Slurm hostlist expressions: `node-[01-64]`, `n[1,3-4],gpu07` expanded into node names,
as the Slurm backend reads them from squeue/sinfo and the deployment tools take them."""

from __future__ import annotations

import re

__all__ = ["HostlistError", "expand_hostlist"]

_BRACKETED = re.compile(r"([^\[\]]*)\[([^\]]+)\]([^\[\]]*)")


class HostlistError(ValueError):
    """A hostlist expression that names no node list (unbalanced brackets, a bad range)."""


def expand_hostlist(text: str) -> list[str]:
    """`n[1,3-4],gpu07` -> ['n1', 'n3', 'n4', 'gpu07']; ranges keep their zero padding.
    Raises HostlistError on an expression it cannot read (`n[3-1]`, `n[a-b]`, `n[1`)."""
    out: list[str] = []
    for item in _split_top(text.strip()):
        m = _BRACKETED.fullmatch(item)
        if m is None:
            if "[" in item or "]" in item:
                raise HostlistError(f"{item!r}: brackets do not pair")
            out.append(item)
            continue
        prefix, body, suffix = m.groups()
        for part in body.split(","):
            lo, sep, hi = part.partition("-")
            if not sep:
                out.append(f"{prefix}{lo}{suffix}")
                continue
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise HostlistError(f"{item!r}: {part!r} is not a range LOW-HIGH")
            width = len(lo) if lo.startswith("0") else 0
            for i in range(int(lo), int(hi) + 1):
                out.append(f"{prefix}{i:0{width}d}{suffix}")
    return out


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
            continue
        depth += ch == "["
        depth -= ch == "]"
        cur.append(ch)
    items.append("".join(cur))
    return [i for i in items if i]
