"""Client certificates as agent credentials (mutual TLS): which node a verified peer
certificate names, and the uvicorn protocol that hands it to the app.

With `api.tls_client_ca_file` the API's TLS context asks every client for a certificate
(CERT_OPTIONAL: clients without one, agentctl and token agents, still connect) and verifies
one that is sent against that CA. The node a certificate speaks for is its subject CN or,
when the subject has no CN, its one DNS subjectAltName. uvicorn does not put the peer
certificate in the ASGI scope, so `peer_node_protocol` subclasses its HTTP protocol: when a
connection is made it reads the verified certificate from the transport's SSL object once,
and every request on that connection finds the node under `PEER_NODE_KEY` in
`scope["state"]` (a per-connection copy of the app state; nothing a client sends reaches it).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from typing import Any

__all__ = ["PEER_NODE_KEY", "cert_node", "peer_node", "peer_node_protocol", "uvicorn_tls_options"]

PEER_NODE_KEY = "trainguard.peer_node"


def cert_node(cert: Mapping[str, Any] | None) -> str | None:
    """The node a verified certificate (as `SSLObject.getpeercert()` returns it) names: its
    subject CN, else its only DNS subjectAltName; None when it names none or several."""
    if not cert:
        return None
    cns = [
        value
        for rdn in cert.get("subject", ())
        for key, value in rdn
        if key == "commonName" and value.strip()
    ]
    if len(cns) == 1:
        return str(cns[0])
    if cns:
        return None  # several CNs: which node is meant is not clear
    dns = {value for key, value in cert.get("subjectAltName", ()) if key == "DNS" and value}
    return str(dns.pop()) if len(dns) == 1 else None


def peer_node(transport: asyncio.BaseTransport) -> str | None:
    """The node named by the verified client certificate of a TLS connection, if any."""
    ssl_object = transport.get_extra_info("ssl_object")
    if ssl_object is None:
        return None
    try:
        return cert_node(ssl_object.getpeercert())
    except (ValueError, ssl.SSLError):  # handshake not done: no verified certificate
        return None


def peer_node_protocol(base: type[asyncio.Protocol]) -> type[asyncio.Protocol]:
    """`base` (a uvicorn HTTP protocol class) that puts the client certificate's node into
    each request's `scope["state"][PEER_NODE_KEY]`."""

    class PeerNodeProtocol(base):  # type: ignore[valid-type,misc]
        app_state: dict[str, Any]  # set by uvicorn's protocol __init__

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            node = peer_node(transport)
            if node is not None:
                # per connection: uvicorn copies app_state into every request's scope
                self.app_state = {**self.app_state, PEER_NODE_KEY: node}

    PeerNodeProtocol.__name__ = PeerNodeProtocol.__qualname__ = f"PeerNode{base.__name__}"
    return PeerNodeProtocol


def uvicorn_tls_options(
    *, cert_file: str | None, key_file: str | None, client_ca_file: str | None
) -> dict[str, Any]:
    """Keyword arguments for `uvicorn.Config`: TLS when a certificate is given, and with a
    client CA, optional client certificates verified against it and read into the scope."""
    options: dict[str, Any] = {"ssl_certfile": cert_file, "ssl_keyfile": key_file}
    if client_ca_file is not None:
        # deferred: uvicorn is heavy, and only a process that serves imports it
        from uvicorn.protocols.http.auto import AutoHTTPProtocol  # noqa: PLC0415

        options.update(
            ssl_ca_certs=client_ca_file,
            ssl_cert_reqs=ssl.CERT_OPTIONAL,
            http=peer_node_protocol(AutoHTTPProtocol),
        )
    else:
        options["http"] = "auto"  # httptools when installed: a C parser for the report path
    return options
