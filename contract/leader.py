"""Following the leader among several controllers: the controller URL list an agent or
agentctl is given, and the header in which a standby names the leader.

A standby controller answers every write with 503, `X-Trainguard-Leader: <the leader's
advertise URL>` (empty or absent while it knows no leader) and `Retry-After`; reads are
served by any controller. A client follows that header only to a URL of its own list
(`follow`): a node or an operator speaks only to controllers its operator named, so a
compromised or misconfigured standby cannot steer them to another host.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

__all__ = [
    "CONTROLLER_URL_MAX_CHARS",
    "LEADER_HEADER",
    "MAX_CONTROLLER_URLS",
    "follow",
    "leader_named",
    "split_urls",
    "url_key",
    "url_list_problem",
    "url_problem",
]

LEADER_HEADER = "X-Trainguard-Leader"
# An HA control plane runs two or three controllers. The bound keeps what one report may
# spend trying them all (each at most controller.timeout_s) short, and the agent's
# per-controller metric series few.
MAX_CONTROLLER_URLS = 8
# A base URL longer than this is a mistake (or a payload), not a controller.
CONTROLLER_URL_MAX_CHARS = 512
_DEFAULT_PORTS = {"http": 80, "https": 443}


def url_problem(url: str) -> str | None:
    """Why `url` is not a controller base URL (http(s)://host[:port][/path]), or None."""
    if not url.startswith(("http://", "https://")):
        return f"must start with http:// or https://, got {url[:80]!r}"
    if len(url) > CONTROLLER_URL_MAX_CHARS:
        return f"too long: at most {CONTROLLER_URL_MAX_CHARS} characters"
    if any(c.isspace() or not c.isprintable() for c in url):
        return f"must not contain spaces or control characters, got {url!r}"
    parts = urlsplit(url)
    if parts.username is not None or parts.password is not None:
        # the token comes from a file, and a URL is logged and exported as a metric label
        return "must not hold credentials (user:password@); the token comes from a file"
    if not parts.hostname:
        return f"has no host, got {url!r}"
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        return f"must be a base URL without ?query or #fragment, got {url!r}"
    try:
        parts.port  # noqa: B018 (parsing the port is the check)
    except ValueError:
        return f"has an invalid port, got {url!r}"
    return None


def url_key(url: str) -> str:
    """`url` in a form two spellings of one controller share: scheme and host lower case,
    the default port written out, no trailing slash."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = _DEFAULT_PORTS.get(scheme)
    host = (parts.hostname or "").lower()
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def url_list_problem(urls: Sequence[str]) -> tuple[int | None, str] | None:
    """The first problem of a controller URL list: (index of the bad entry, or None when the
    list itself is wrong; reason), or None when every entry is a distinct base URL."""
    if not urls:
        return None, "must list at least one URL"
    if len(urls) > MAX_CONTROLLER_URLS:
        return None, f"too many URLs: at most {MAX_CONTROLLER_URLS}, got {len(urls)}"
    seen: dict[str, int] = {}
    for i, url in enumerate(urls):
        bad = url_problem(url)
        if bad is not None:
            return i, bad
        key = url_key(url)
        if key in seen:
            return i, f"names the same controller as entry {seen[key]} ({urls[seen[key]]!r})"
        seen[key] = i
    return None


def split_urls(text: str) -> list[str]:
    """A comma-separated URL list (a flag or an environment variable) as its entries, each
    stripped; an empty entry stays, so a stray comma is reported rather than ignored."""
    return [part.strip() for part in text.split(",")]


def leader_named(header: str | None) -> str | None:
    """The leader a standby's header names, or None when it names none (empty or absent)."""
    if header is None:
        return None
    value = header.strip()
    return value or None


def follow(header: str | None, urls: Sequence[str]) -> str | None:
    """The URL of `urls` (as the list spells it) that the leader header names, or None when
    it names no leader or one outside the list (never followed)."""
    leader = leader_named(header)
    if leader is None or url_problem(leader) is not None:
        return None
    key = url_key(leader)
    for url in urls:
        if url_key(url) == key:
            return url
    return None
