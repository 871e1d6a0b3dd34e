"""The URL of a PostgreSQL store (`store.url`): its schemes, the password check and the redaction
for messages. Below the store: the config checks `store.url` with it, and the config is below the
store (tests/unit/test_layers.py).
"""

from __future__ import annotations

from urllib.parse import SplitResult, parse_qsl, urlsplit, urlunsplit

__all__ = ["POSTGRES_SCHEMES", "is_postgres_url", "redact_url", "url_password_problem"]

POSTGRES_SCHEMES = ("postgresql", "postgres")


def is_postgres_url(location: str) -> bool:
    return urlsplit(location).scheme in POSTGRES_SCHEMES


def url_password_problem(url: str) -> str | None:
    """Why `url` must not be used as it is (it carries a password), or None."""
    parts = urlsplit(url)
    if parts.password is not None:
        return "carries a password"
    if any(k == "password" for k, _ in parse_qsl(parts.query)):
        return "carries a password= parameter"
    return None


def redact_url(url: str) -> str:
    """`url` with any password replaced by `***` (for messages and logs)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        userinfo, _, hostport = netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}"
    query = "&".join(
        f"{k}=***" if k == "password" else f"{k}={v}"
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
    )
    return urlunsplit(SplitResult(parts.scheme, netloc, parts.path, query, parts.fragment))
