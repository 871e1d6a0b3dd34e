"""Issuing an agent token bound to one node: a new random token, its tokens-file line, the
token written to a 0600 file, and the line appended to a tokens file atomically.

The controller reads its tokens file at start and again on SIGHUP (`systemctl reload
trainguard-controller`): a token added here is accepted after that reload. Nothing here
logs or prints a token except where asked to.
"""

from __future__ import annotations

import os
import re
import secrets
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from trainguard.controller.auth import hash_token

__all__ = [
    "NODE_NAME",
    "TokenIssueError",
    "append_line",
    "append_lines",
    "new_token",
    "tokens_line",
    "write_new",
]

# node and token names written into the tokens file without quoting
NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")
_ITEM_INDENT = re.compile(r"^([ \t]*)- ", re.MULTILINE)


class TokenIssueError(Exception):
    """Why a token could not be issued or a line not appended (nothing was written)."""


def new_token() -> str:
    """A new random token: 32 bytes from the OS, URL-safe (43 characters)."""
    return secrets.token_urlsafe(32)


def tokens_line(*, name: str, node: str, token: str) -> str:
    """The tokens-file entry (a YAML flow mapping, no indent) of an agent token for `node`."""
    for what, value in (("node", node), ("name", name)):
        if not NODE_NAME.fullmatch(value):
            raise TokenIssueError(
                f"{what} {value!r}: use letters, digits, '.', '_' and '-' (a letter or digit first)"
            )
    return f'- {{name: {name}, role: agent, node: {node}, sha256: "{hash_token(token)}"}}'


def write_new(path: Path, text: str) -> None:
    """Write `text` to a new file `path`, mode 0600 from the start; an existing file is
    refused (a token file is never overwritten by accident)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise TokenIssueError(f"{path} exists: choose another --out file") from None
    except OSError as e:
        raise TokenIssueError(f"cannot create {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def append_line(path: Path, line: str) -> None:
    """Append `line` (from `tokens_line`) to the `tokens:` list of the tokens file `path`
    (see `append_lines`)."""
    append_lines(path, [line])


def append_lines(path: Path, lines: Sequence[str]) -> None:
    """Append `lines` (from `tokens_line`) to the `tokens:` list of the tokens file `path`,
    all or none: written to a temporary file beside it (same mode), fsynced, renamed over it.
    Refused, with nothing written, when the file is not a tokens list that the lines extend
    by exactly those entries, or when a name or node among them already has an entry."""
    try:
        text = path.read_text(encoding="utf-8")
        mode = os.stat(path).st_mode & 0o777
    except OSError as e:
        raise TokenIssueError(f"cannot read {path}: {e.strerror or e}") from None
    entries = [yaml.safe_load(line)[0] for line in lines]
    if not text.strip():
        text = "tokens:\n"  # an empty file: the list starts here
    before = _tokens(path, text)
    known = [k for k in before if isinstance(k, dict)]
    for i, entry in enumerate(entries):
        for k in [*known, *entries[:i]]:
            if k.get("name") == entry["name"]:
                raise TokenIssueError(f"{path}: a token named {entry['name']} exists already")
            if k.get("role") == "agent" and k.get("node") == entry["node"]:
                raise TokenIssueError(
                    f"{path}: node {entry['node']} has a token already ({k.get('name')}); "
                    "to rotate it, replace that entry (docs/security.md)"
                )
    indents = _ITEM_INDENT.findall(text)
    indent = indents[-1] if indents else "  "
    added = "".join(f"{indent}{line}\n" for line in lines)
    new_text = text + ("" if text.endswith("\n") or not text else "\n") + added
    try:
        appended = _tokens(path, new_text) == [*before, *entries]
    except TokenIssueError:
        appended = False
    if not appended:
        raise TokenIssueError(
            f"{path}: cannot append to its tokens list safely (flow style or another section "
            f"after it); add these lines under tokens: yourself:\n{added}"
        )
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            os.fchmod(f.fileno(), mode)
            f.write(new_text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _tokens(path: Path, text: str) -> list[object]:
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TokenIssueError(f"{path}: not YAML ({e})") from None
    tokens = doc.get("tokens") if isinstance(doc, dict) else None
    if isinstance(doc, dict) and "tokens" in doc and tokens is None:
        tokens = []  # `tokens:` with nothing under it yet
    if not isinstance(tokens, list):
        raise TokenIssueError(f"{path}: no `tokens:` list")
    return tokens
