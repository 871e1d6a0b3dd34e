"""API bearer tokens: the tokens file, roles and what each role may do, and the check itself.

The tokens file holds SHA-256 hashes, never plaintext (`agentctl token hash` makes a line).
A presented token is hashed and compared with `hmac.compare_digest` against every stored hash,
so the time taken does not depend on how much of a token matched or which entry it was.
Tokens and Authorization headers are never logged; the audit log sees the token's name only.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from trainguard.controller.config import expand_credentials
from trainguard.strict import ConfigError, Invalid, build, load_yaml

__all__ = [
    "PERMISSIONS",
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

# agent: post reports only; operator: reads and every mutating operator endpoint; viewer: reads
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

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise Invalid("name", "must not be empty")
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
    """Who made a request: the token's name and role."""

    name: str
    role: Role

    def may(self, permission: Permission) -> bool:
        return permission in PERMISSIONS[self.role]


class TokenStore:
    """Hashed tokens; `authenticate` returns the matching Principal or None."""

    def __init__(self, entries: list[tuple[str, Role, str]]) -> None:
        """`entries`: (name, role, sha256 hex) triples."""
        self._entries: list[tuple[bytes, Principal]] = []
        names: set[str] = set()
        digests: set[bytes] = set()
        for name, role, digest_hex in entries:
            if role not in PERMISSIONS:
                raise ValueError(f"token {name!r}: unknown role {role!r}")
            if name in names:
                raise ValueError(f"token {name!r}: duplicate name")
            digest = bytes.fromhex(digest_hex)
            if digest in digests:
                raise ValueError(f"token {name!r}: same token as another entry")
            names.add(name)
            digests.add(digest)
            self._entries.append((digest, Principal(name=name, role=role)))

    @classmethod
    def from_plaintext(cls, tokens: dict[str, tuple[str, Role]]) -> TokenStore:
        """{token: (name, role)}; for tests and tools that mint tokens themselves."""
        return cls([(name, role, hash_token(tok)) for tok, (name, role) in tokens.items()])

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[tuple[str, Role, str]]:
        """(name, role, sha256 hex) of every token, as the constructor takes them: what
        another process needs to check the same tokens (hashes only, never a token)."""
        return [(p.name, p.role, digest.hex()) for digest, p in self._entries]

    def authenticate(self, token: str) -> Principal | None:
        if not token:
            return None
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found: Principal | None = None
        for digest, principal in self._entries:
            # no early exit: every entry is compared whatever matched
            if hmac.compare_digest(presented, digest):
                found = principal
        return found


def load_tokens(path: str | Path) -> TokenStore:
    """Load a tokens file strictly; errors are ConfigError naming file, key and reason."""
    p = Path(path)
    data = load_yaml(p)
    parsed = build(TokensFile, data, source=str(p))
    entries: list[tuple[str, Role, str]] = []
    for i, entry in enumerate(parsed.tokens):
        key = f"tokens[{i}]"
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
        entries.append((entry.name, entry.role, digest))
    try:
        return TokenStore(entries)
    except ValueError as e:
        raise ConfigError(str(p), "tokens", str(e)) from None
