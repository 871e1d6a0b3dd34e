"""trainguard-controller: load the config, start the Controller, serve the API with uvicorn.

SIGHUP reloads the rules and the tokens file (a bad file is logged and the running rules or
tokens stay: `agentctl token issue` adds tokens without a restart); SIGTERM/SIGINT
stop serving, then stop the controller (threads joined, store flushed and closed).
With `api.ingest_workers: N` (`--ingest-workers N`) the port is served by N worker processes
that hand reports to this one (`controller/ingest/`); they are stopped before the controller.
Exit codes: 0 clean stop, 1 runtime failure, 2 bad configuration or usage.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import signal
import socket
import ssl
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from trainguard import __version__
from trainguard.controller.actions.notify import build_notifiers
from trainguard.controller.auth import load_tokens
from trainguard.controller.backup import main as backup_main
from trainguard.controller.composition import Controller
from trainguard.controller.config import load_config
from trainguard.controller.connlimits import (
    CredentialLimits,
    bounded,
    conn_limits,
    tune_malloc,
)
from trainguard.controller.errors import ServiceError
from trainguard.controller.ha import HaController
from trainguard.controller.ingest.frontend import IngestFrontend
from trainguard.controller.runtime import new_event_loop, setup_logging
from trainguard.controller.scrapetargets import main as targets_main
from trainguard.controller.store.errors import LeaseLost
from trainguard.controller.storeurl import redact_url
from trainguard.controller.storewatch import StoreWatch, postgres_probe
from trainguard.controller.tick import load_rule_set
from trainguard.controller.tlsauth import uvicorn_tls_options
from trainguard.controller.watchdog import watchdog_running
from trainguard.strict import ConfigError
from trainguard.systemd import SystemdNotifier
from trainguard.unitfile import install_unit_main
from trainguard.xid_catalog import XidCatalog

log = logging.getLogger("trainguard.controller.main")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
# the store probe connection's connect, statement and TCP timeouts (storewatch.py bounds
# the whole probe)
PROBE_CONN_TIMEOUT_S = 3.0


# name -> (usage, what it does): the subcommands, as --help lists them
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "check-config": ("check-config CONFIG", "validate CONFIG as a start would, print a summary"),
    "install-unit": ("install-unit", "write the systemd unit for this installation"),
    "targets": ("targets HOSTS", "write Prometheus file_sd targets for HOSTS (a hostlist)"),
    "backup": ("backup DEST", "copy the live store to DEST"),
    "restore": ("restore BACKUP", "install BACKUP as the store (controller stopped)"),
}


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="trainguard-controller",
        description="trainguard controller: rules, incidents, actions and the REST API",
        epilog="Subcommands (each with its own --help):\n"
        + "\n".join(f"  {usage:<21} {what}" for usage, what in SUBCOMMANDS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"{p.prog} {__version__}")
    p.add_argument(
        "--config", default=None, help="config file (default /etc/trainguard/controller.yaml)"
    )
    p.add_argument("--host", default=None, help="API listen address (overrides api.host)")
    p.add_argument("--port", type=int, default=None, help="API port; 0 = a free port")
    p.add_argument("--db", default=None, help="SQLite store path (overrides store.path)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="record decisions and intended actions, execute nothing (safety.dry_run)",
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default=None)
    p.add_argument(
        "--ingest-in-threadpool",
        action="store_true",
        help="tuning: ingest reports in the threadpool instead of on the event loop",
    )
    p.add_argument(
        "--ingest-workers",
        type=int,
        default=None,
        help="processes serving the API port and handing reports over (api.ingest_workers); "
        "0 = serve everything in this process",
    )
    return p.parse_args(argv)


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(addr)
    sock.set_inheritable(True)
    return sock


def _store_tool(argv: Sequence[str]) -> bool:
    """`[--config FILE] [--db FILE] backup|restore ...`: the store's backup and restore
    (controller/backup.py, docs/controller.md "Backup and restore")."""
    i = 0
    while i < len(argv) and argv[i].startswith(("--config", "--db")):
        i += 1 if "=" in argv[i] else 2
    return i < len(argv) and argv[i] in ("backup", "restore")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "install-unit":
        return install_unit_main(argv[1:], prog="trainguard-controller")
    if argv and argv[0] == "check-config":
        return check_config_main(argv[1:])
    if argv and argv[0] == "targets":
        return targets_main(argv[1:])
    if _store_tool(argv):
        return backup_main(argv)
    args = _parse_args(argv)
    setup_logging(args.log_level or "info")
    overrides: dict[str, Any] = {
        "api.host": args.host,
        "api.port": args.port,
        "store.path": args.db,
        "safety.dry_run": True if args.dry_run else None,
        "api.ingest_workers": args.ingest_workers,
    }
    try:
        config = load_config(args.config, overrides=overrides)
        tokens = load_tokens(
            config.api.tokens_file,
            allow_shared_agent_tokens=config.api.allow_shared_agent_tokens,
        )
    except ConfigError as e:
        print(f"trainguard-controller: bad configuration: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.log_level is None:
        logging.getLogger().setLevel(config.log.level.upper())
    if len(tokens) == 0:
        log.warning(
            "event=no_tokens tokens_file=%s detail=every_request_is_401", config.api.tokens_file
        )
    shared = tokens.shared_agent_tokens()
    if shared:
        log.warning(
            "event=shared_agent_tokens tokens=%s detail=api.allow_shared_agent_tokens is on: "
            "each of these may speak for ANY node; bind one token per node (docs/security.md)",
            ",".join(shared),
        )

    try:
        # HA (ha.enabled): one of several controllers on one PostgreSQL store, leading while
        # it holds the lease, a standby serving reads otherwise (controller/ha.py). On
        # PostgreSQL a lone controller holds the lease too: losing the store steps it down
        # and its return starts it again from the store, as a restart would
        leased = config.ha.enabled or config.store.url is not None
        controller: Any = HaController(config) if leased else Controller(config)
        watch = _store_watch(config, controller) if config.store.url is not None else None
    except ConfigError as e:
        print(f"trainguard-controller: bad configuration: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        sock = _bind(config.api.host, config.api.port)
    except OSError as e:
        print(
            f"trainguard-controller: cannot listen on {config.api.host}:{config.api.port}: "
            f"{e.strerror or e}",
            file=sys.stderr,
        )
        controller.stop()
        return EXIT_FAILURE
    return _serve(
        controller, config, tokens, sock, threadpool=args.ingest_in_threadpool, watch=watch
    )


def check_config_main(argv: Sequence[str]) -> int:
    """`check-config CONFIG`: what a start checks before it serves (the config, the tokens
    file, the rules, the XID catalog, the notifiers, the TLS files), without opening the
    store or the port. Exit 0 with a one-line summary, or 2 with the error a start prints."""
    p = argparse.ArgumentParser(
        prog="trainguard-controller check-config",
        description="Validate a controller config as a start would; exit 0 (a one-line "
        "summary) or 2 (the error).",
    )
    p.add_argument("config", metavar="CONFIG", help="the controller config file")
    args = p.parse_args(argv)
    try:
        summary = check_config(args.config)
    except ConfigError as e:
        print(f"trainguard-controller: bad configuration: {e}", file=sys.stderr)
        return EXIT_CONFIG
    print(summary)
    return EXIT_OK


def check_config(path: str) -> str:
    """Validate the config at `path` and what it names; raises ConfigError, else returns the
    one-line summary."""
    config = load_config(path)
    tokens = load_tokens(
        config.api.tokens_file, allow_shared_agent_tokens=config.api.allow_shared_agent_tokens
    )
    rules = load_rule_set(config)
    XidCatalog.load(config.xid_catalog or None)
    notifiers = build_notifiers(config.notify)
    config.store.read_password()
    _check_tls(config.api)
    api = config.api
    scheme = "https" if api.tls_cert_file else "http"
    mtls = " mtls" if api.tls_client_ca_file else ""
    store = redact_url(config.store.url) if config.store.url else f"sqlite:{config.store.path}"
    paging = ",".join(sorted(n.channel for n in notifiers)) or "none"
    return (
        f"ok: {path}: api={scheme}://{api.host}:{api.port}{mtls} store={store} "
        f"ha={'on' if config.ha.enabled else 'off'} backend={config.backend.kind} "
        f"rules={len(rules.names())} tokens={len(tokens)} notify={paging}"
    )


def _check_tls(api: Any) -> None:
    """The server certificate, its key and the client CA load as the server would load them."""
    if api.tls_cert_file is None:
        return
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(api.tls_cert_file, api.tls_key_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            "", "api.tls_cert_file", f"cannot load {api.tls_cert_file}: {e}"
        ) from None
    if api.tls_client_ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=api.tls_client_ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                "", "api.tls_client_ca_file", f"cannot load {api.tls_client_ca_file}: {e}"
            ) from None


def _store_watch(config: Any, controller: Any) -> StoreWatch:
    """The PostgreSQL store's probe and page (controller/storewatch.py)."""
    url = config.store.url
    instance = urlsplit(config.ha.advertise_url).netloc or socket.gethostname()
    return StoreWatch(
        probe=postgres_probe(
            url, password=config.store.read_password(), timeout_s=PROBE_CONN_TIMEOUT_S
        ),
        notifiers=build_notifiers(config.notify),
        instance=instance,
        store=redact_url(url),
        page_after_s=config.store.page_after_s,
        registry=controller.metrics.registry,
    )


def _serve(
    controller: Any,
    config: Any,
    tokens: Any,
    sock: socket.socket,
    *,
    threadpool: bool,
    watch: StoreWatch | None = None,
) -> int:
    # uvicorn and fastapi (which the api module imports) are heavy: deferred until serving, so
    # a bad configuration is answered without loading them
    try:
        import uvicorn  # noqa: PLC0415

        from trainguard.controller.api.app import create_app  # noqa: PLC0415
    except ImportError as e:
        print(
            f"trainguard-controller: {e.name or e} is not installed: the controller host needs "
            "pip install 'trainguard[controller]'",
            file=sys.stderr,
        )
        sock.close()
        controller.stop()
        return EXIT_CONFIG

    app = create_app(
        controller,
        tokens=tokens,
        max_body_bytes=config.api.max_body_bytes,
        metrics_registry=controller.metrics.registry,
        report_latency=controller.metrics.report_ingest_seconds,
        ingest_in_threadpool=threadpool,
        leadership=controller if isinstance(controller, HaController) else None,
    )
    limits = conn_limits(config.api.connections)
    tls = uvicorn_tls_options(
        cert_file=config.api.tls_cert_file,
        key_file=config.api.tls_key_file,
        client_ca_file=config.api.tls_client_ca_file,
    )
    tune_malloc()  # large bodies unmapped when freed: a burst's memory goes back
    uv_config = uvicorn.Config(
        CredentialLimits(app, limits=limits),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=math.ceil(limits.idle_timeout_s),
        **bounded(tls, limits),
    )
    server: Any = uvicorn.Server(uv_config)
    if config.api.ingest_workers > 0:
        server = IngestFrontend(
            app,
            workers=config.api.ingest_workers,
            tokens=tokens,
            max_body_bytes=config.api.max_body_bytes,
            tls_cert_file=config.api.tls_cert_file,
            tls_key_file=config.api.tls_key_file,
            tls_client_ca_file=config.api.tls_client_ca_file,
            log_level=logging.getLevelName(logging.getLogger().level).lower(),
            conn_limits=json.dumps(dataclasses.asdict(limits)),
        )
    notifier = SystemdNotifier()
    loop = new_event_loop()

    def reload_rules() -> None:
        try:
            count = controller.reload_rules(actor="sighup")
        except (ServiceError, LeaseLost) as e:
            log.error("event=sighup_reload_failed detail=%s", str(e).replace("\n", " "))
            return
        except Exception:  # a reload must never end silently: log it, the rules stay
            log.exception("event=sighup_reload_failed detail=unexpected_error")
            return
        log.info("event=sighup_reload rules=%d", count)

    def reload_tokens() -> None:
        try:
            fresh = load_tokens(
                config.api.tokens_file,
                allow_shared_agent_tokens=config.api.allow_shared_agent_tokens,
            )
        except ConfigError as e:
            log.error("event=sighup_tokens_failed detail=%s", str(e).replace("\n", " "))
            return
        tokens.replace_with(fresh)
        if isinstance(server, IngestFrontend):
            # the workers' channels belong to the event loop: hand the new set over there
            loop.call_soon_threadsafe(server.set_tokens, tokens)
        log.info("event=sighup_tokens tokens=%d", len(tokens))

    def reload() -> None:
        reload_tokens()
        reload_rules()

    def on_hup(signum: int, frame: FrameType | None) -> None:
        # work off the signal handler: reloading reads files and takes the controller lock
        threading.Thread(target=reload, name="trainguard-reload", daemon=True).start()

    def on_term(signum: int, frame: FrameType | None) -> None:
        # uvicorn swaps in its own handlers while serving and re-raises the signal after a
        # graceful shutdown; this handler is what it then finds, so the process does not die
        # before the controller is stopped
        log.info("event=signal signal=%s", signal.Signals(signum).name)
        server.should_exit = True

    signal.signal(signal.SIGHUP, on_hup)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            host, port = sock.getsockname()[:2]
            scheme = "https" if config.api.tls_cert_file else "http"
            log.info("event=api_listening url=%s://%s:%d", scheme, host, port)
            notifier.ready(status=f"serving on {host}:{port}")
        async with watchdog_running(notifier, healthy=controller.ticking):
            await task

    controller.start()
    if watch is not None:
        watch.start()
    code = EXIT_OK
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(run())
    except Exception:
        log.exception("event=server_failed")
        code = EXIT_FAILURE
    finally:
        loop.close()
        notifier.stopping()
        if watch is not None:
            watch.stop()
        controller.stop()
        sock.close()
        notifier.close()
    if code == EXIT_OK and not server.started:
        code = EXIT_FAILURE
    log.info("event=controller_exit code=%d", code)
    return code


if __name__ == "__main__":
    sys.exit(main())
