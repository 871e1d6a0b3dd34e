"""API credentials: the tokens file, roles and what each role may do, and the token check.

The tokens file holds SHA-256 hashes, never plaintext (`agentctl token issue NODE` or
`agentctl token hash` makes a line). An agent token is bound to one node (`node:`): it speaks
for that node only (the API refuses a report for any other). A token without `node:` for the
agent role (a token shared by many nodes) is refused at load unless the config says
`api.allow_shared_agent_tokens: true` (a migration aid, see docs/security.md).
A presented token is hashed once and looked up by its SHA-256 digest: the time taken depends
only on that digest (which its sender can compute anyway), never on how much of a stored
token matched, and it stays the same with thousands of node tokens. Tokens and Authorization
headers are never logged; the audit log sees the token's name only.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from trainguard.controller.config import expand_credentials
from trainguard.strict import ConfigError, Invalid, build, load_yaml

__all__ = [
    "PERMISSIONS",
    "Entry",
    "Permission",
    "Principal",
    "Role",
    "TokenEntry",
    "TokenStore",
    "TokensFile",
    "hash_token",
    "load_tokens",
]

Role = Literal["agent", "operator", "viewer"]
Permission = Literal["report", "read", "write"]

# agent: post reports (for its own node) only; operator: reads and every mutating operator
# endpoint; viewer: reads
PERMISSIONS: dict[str, frozenset[str]] = {
    "agent": frozenset({"report"}),
    "operator": frozenset({"read", "write"}),
    "viewer": frozenset({"read"}),
}

_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")


def hash_token(token: str) -> str:
    """The lower-case hex SHA-256 of a token, as stored in the tokens file."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TokenEntry:
    """One token: `sha256` of the token, or `token_file` holding the token itself (its hash
    is taken at load; a relative path is relative to the tokens file, and a path may start
    with ${CREDENTIALS_DIRECTORY}, as in the controller config)."""

    name: str  # the audit actor
    role: Role
    sha256: str | None = None
    token_file: str | None = None
    # agent tokens: the one node this token speaks for (reports, commands, command results)
    node: str | None = None

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise Invalid("name", "must not be empty")
        if self.node is not None:
            if self.role != "agent":
                raise Invalid("node", f"only an agent token is bound to a node, not a {self.role}")
            if not self.node.strip() or self.node != self.node.strip():
                raise Invalid("node", f"must be a node name, got {self.node!r}")
        if (self.sha256 is None) == (self.token_file is None):
            raise Invalid("sha256", "give exactly one of sha256 or token_file")
        if self.sha256 is not None and not _HEX64.match(self.sha256):
            raise Invalid("sha256", "must be 64 hexadecimal digits (see `agentctl token hash`)")
        if self.token_file is not None:
            expanded = expand_credentials(self.token_file, key="token_file")
            object.__setattr__(self, "token_file", expanded)


@dataclass(frozen=True)
class TokensFile:
    tokens: tuple[TokenEntry, ...] = ()


@dataclass(frozen=True)
class Principal:
    """Who made a request: the credential's name and role and, for an agent, the node it
    speaks for (None: a shared agent token, allowed only by api.allow_shared_agent_tokens)."""

    name: str
    role: Role
    node: str | None = None

    def may(self, permission: Permission) -> bool:
        return permission in PERMISSIONS[self.role]


# (name, role, sha256 hex, bound node or None): a token as the store and the ingest workers
# take it
Entry = tuple[str, Role, str, str | None]


class TokenStore:
    """Hashed tokens; `authenticate` returns the matching Principal or None."""

    def __init__(self, entries: Iterable[Sequence[Any]]) -> None:
        """`entries`: (name, role, sha256 hex[, node]) tuples; no node: not bound to one."""
        self._by_digest: dict[bytes, Principal] = {}
        names: set[str] = set()
        for entry in entries:
            name, role, digest_hex = entry[0], entry[1], entry[2]
            node = entry[3] if len(entry) > 3 else None
            if role not in PERMISSIONS:
                raise ValueError(f"token {name!r}: unknown role {role!r}")
            if node is not None and role != "agent":
                raise ValueError(f"token {name!r}: only an agent token is bound to a node")
            if name in names:
                raise ValueError(f"token {name!r}: duplicate name")
            digest = bytes.fromhex(digest_hex)
            if digest in self._by_digest:
                raise ValueError(f"token {name!r}: same token as another entry")
            names.add(name)
            self._by_digest[digest] = Principal(name=name, role=role, node=node)

    @classmethod
    def from_plaintext(cls, tokens: Mapping[str, Sequence[str | None]]) -> TokenStore:
        """{token: (name, role[, node])}; for tests and tools that mint tokens themselves."""
        return cls([(v[0], v[1], hash_token(tok), *v[2:]) for tok, v in tokens.items()])

    def __len__(self) -> int:
        return len(self._by_digest)

    def replace_with(self, other: TokenStore) -> None:
        """Take `other`'s tokens from now on (a tokens file reloaded on SIGHUP): one
        assignment, so a request is checked against the old set or the new, never a mix."""
        self._by_digest = dict(other._by_digest)

    def entries(self) -> list[Entry]:
        """(name, role, sha256 hex, node) of every token, as the constructor takes them: what
        another process needs to check the same tokens (hashes only, never a token)."""
        return [(p.name, p.role, digest.hex(), p.node) for digest, p in self._by_digest.items()]

    def shared_agent_tokens(self) -> list[str]:
        """Names of the agent tokens bound to no node (each may speak for any node)."""
        return sorted(p.name for p in self._by_digest.values() if p.role == "agent" and not p.node)

    def authenticate(self, token: str) -> Principal | None:
        if not token:
            return None
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        # a lookup by digest: what it takes depends on the digest of the presented token,
        # which its sender knows anyway, never on a stored token
        return self._by_digest.get(presented)


def load_tokens(path: str | Path, *, allow_shared_agent_tokens: bool = False) -> TokenStore:
    """Load a tokens file strictly; errors are ConfigError naming file, key and reason.

    An agent token without `node:` is an error unless `allow_shared_agent_tokens`."""
    p = Path(path)
    data = load_yaml(p)
    parsed = build(TokensFile, data, source=str(p))
    entries: list[Entry] = []
    for i, entry in enumerate(parsed.tokens):
        key = f"tokens[{i}]"
        if entry.role == "agent" and entry.node is None and not allow_shared_agent_tokens:
            raise ConfigError(
                str(p),
                f"{key}.node",
                f"agent token {entry.name!r} is bound to no node: a shared agent token lets "
                "any node speak for every other. Give each node its own token "
                "(`agentctl token issue NODE` prints the line with `node:`), or, while "
                "migrating, set api.allow_shared_agent_tokens: true (see docs/security.md)",
            )
        if entry.token_file is not None:
            tf = Path(entry.token_file)
            if not tf.is_absolute():
                tf = p.parent / tf
            try:
                token = tf.read_text(encoding="utf-8").strip()
            except OSError as e:
                raise ConfigError(
                    str(p), f"{key}.token_file", f"cannot read {tf}: {e.strerror or e}"
                ) from None
            if not token:
                raise ConfigError(str(p), f"{key}.token_file", f"{tf} is empty")
            digest = hash_token(token)
        else:
            digest = str(entry.sha256).lower()
        entries.append((entry.name, entry.role, digest, entry.node))
    try:
        return TokenStore(entries)
    except ValueError as e:
        raise ConfigError(str(p), "tokens", str(e)) from None
