"""The controller's REST API as agentctl calls it: one or several URLs (HA), the token and
CA, errors turned into CliError with their exit code, and lists followed page by page."""

from __future__ import annotations

import json
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import httpx

from trainguard import __version__
from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.leader import LEADER_HEADER, follow, leader_named

__all__ = [
    "CLIENT_HEADER",
    "CONTINUE_HEADER",
    "LIST_MOST",
    "REQUEST_TIMEOUT_S",
    "Api",
    "quote_name",
]

# the header the API reads to name the client in a drain reason it fills in
# (controller/api/nodes.py; agentctl does not import the API, which needs the controller extra)
CLIENT_HEADER = "X-Trainguard-Client"
# on a full page of a list, where the next starts (controller/api/routing.py)
CONTINUE_HEADER = "X-Trainguard-Continue"
# `get jobs|incidents|audit` follows pages up to this many items (--limit: fewer)
LIST_MOST = 10_000
# a request's timeout without --timeout
REQUEST_TIMEOUT_S = 10.0
_PAGE_SIZE = 1000


class Api:
    """The controller's REST API at one or several URLs (HA): a request goes to the first
    URL that answers; a 503 naming a leader of the list is retried once there."""

    def __init__(
        self,
        urls: Sequence[str],
        token: str | None,
        *,
        timeout_s: float,
        ca_file: str | None = None,
    ) -> None:
        self.urls = tuple(u.rstrip("/") for u in urls)
        # the client header lets the API say "via agentctl" in a reason it fills in
        headers = {CLIENT_HEADER: "agentctl", "User-Agent": f"agentctl/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        verify: ssl.SSLContext | bool = True
        if ca_file is not None:
            try:
                verify = ssl.create_default_context(cafile=ca_file)
            except (OSError, ssl.SSLError) as e:
                raise CliError(
                    f"error: cannot use CA file {ca_file}: {getattr(e, 'strerror', None) or e}",
                    EXIT["usage"],
                ) from None
        # one client for every controller: the same token and CA for each
        self._client = httpx.Client(headers=headers, timeout=timeout_s, verify=verify)

    def request(self, method: str, path: str, **kw: Any) -> Any:
        return _answer(self._send(method, path, **kw))

    def list_all(self, path: str, params: dict[str, Any], *, most: int) -> tuple[list[Any], bool]:
        """GET a paged list, following CONTINUE_HEADER page by page, up to `most` items;
        also whether more were left."""
        items: list[Any] = []
        params = dict(params)
        while True:
            params["limit"] = min(_PAGE_SIZE, most - len(items))
            r = self._send("GET", path, params=params)
            items.extend(_answer(r))
            after = r.headers.get(CONTINUE_HEADER)
            if after is None:
                return items, False
            if len(items) >= most:
                return items[:most], True
            params["continue"] = after

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        todo = list(self.urls)
        missed: list[str] = []  # "URL: why", for each controller that did not take it
        answered = False  # some controller answered (so it is not a connection problem)
        redirected = False
        while todo:
            url = todo.pop(0)
            try:
                r = self._client.request(method, url + path, **kw)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                # not sent: safe to try the next controller, even for a write
                missed.append(f"{url}: {e}")
                continue
            except httpx.HTTPError as e:
                raise CliError(f"error: request to {url} failed: {e}", EXIT["error"]) from None
            if r.status_code != 503 or (len(self.urls) == 1 and LEADER_HEADER not in r.headers):
                return r
            # a standby (or a controller without a leader) refused it before doing anything
            answered = True
            header = r.headers.get(LEADER_HEADER)
            leader = leader_named(header)
            target = follow(header, self.urls)
            if leader is not None and target is None:
                raise CliError(
                    f"error: 503 {url} does not lead; the leader is {leader}, which is not "
                    f"one of the controller URLs ({', '.join(self.urls)}): add it to --url, "
                    "TRAINGUARD_URL or the config file's url",
                    EXIT["error"],
                )
            if target is not None and target.rstrip("/") != url and not redirected:
                redirected = True  # once: never a loop between standbys
                todo = [target.rstrip("/")]
                missed.append(f"{url}: 503, the leader is {target}")
                continue
            if target is not None:
                raise CliError(
                    f"error: 503 {url} does not lead; it names {target} as the leader "
                    f"({'; '.join(missed) or 'asked already'}); retry shortly",
                    EXIT["error"],
                )
            missed.append(f"{url}: 503 {_error_text(r)}")
        if not answered:
            if len(self.urls) == 1:
                raise CliError(f"error: cannot connect to {missed[0]}", EXIT["connect"])
            raise CliError(
                f"error: cannot connect to any controller: {'; '.join(missed)}", EXIT["connect"]
            )
        raise CliError(
            f"error: 503 no controller leads now ({'; '.join(missed)}); retry shortly",
            EXIT["error"],
        )


def _error_text(r: httpx.Response) -> str:
    """An error answer's message: the body's `error` and `detail`, else its text."""
    try:
        body = r.json()
        message = str(body.get("error") or r.reason_phrase)
        if body.get("detail"):
            message += f" ({json.dumps(body['detail'], separators=(',', ':'))})"
    except (ValueError, AttributeError):
        message = r.text.strip() or r.reason_phrase
    return message


def _answer(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        code = {404: "not_found", 401: "auth", 403: "auth"}.get(r.status_code, "error")
        raise CliError(f"error: {r.status_code} {_error_text(r)}", EXIT[code])
    if r.status_code == 204 or not r.content:
        return None
    return r.json()


def quote_name(name: str) -> str:
    return quote(name, safe="")
