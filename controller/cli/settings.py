"""Where agentctl connects and with which token: flags, then the environment, then the
strict config file (`~/.config/trainguard/agentctl.yaml`)."""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from trainguard.controller.cli.errors import EXIT, CliError
from trainguard.leader import split_urls, url_list_problem
from trainguard.strict import ConfigError, Invalid, build, load_yaml

__all__ = ["DEFAULT_URL", "AgentctlConfig", "Settings", "check_urls", "settings_of"]

DEFAULT_URL = "http://127.0.0.1:8800"


@dataclass(frozen=True)
class AgentctlConfig:
    # the controller's base URL, or several comma-separated
    url: str | None = None
    # several controllers as a list, instead of `url`
    urls: list[str] | None = None
    token_file: str | None = None
    # PEM CA bundle that signed the controller's certificate (a self-signed or private CA);
    # relative to this file
    ca_file: str | None = None

    def __post_init__(self) -> None:
        if self.url is not None and self.urls is not None:
            raise Invalid("urls", "set url or urls, not both")
        if self.urls is not None:
            check_urls(self.urls, key="urls")

    def resolved_urls(self) -> tuple[str, ...] | None:
        """The configured controllers, or None when the file names none."""
        if self.urls is not None:
            return tuple(self.urls)
        return tuple(split_urls(self.url)) if self.url is not None else None


def check_urls(urls: Sequence[str], *, key: str) -> None:
    """Raise Invalid naming `key` (and the entry's index) for a bad controller URL list."""
    problem = url_list_problem(urls)
    if problem is not None:
        index, reason = problem
        raise Invalid(key if index is None else f"{key}[{index}]", reason)


def _config_path(arg: str | None) -> tuple[Path, bool]:
    if arg:
        return Path(arg), True
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "trainguard" / "agentctl.yaml", False


@dataclass(frozen=True)
class Settings:
    urls: tuple[str, ...]
    token: str | None
    ca_file: str | None


def settings_of(args: argparse.Namespace, err: IO[str]) -> Settings:
    path, explicit = _config_path(args.config)
    cfg = AgentctlConfig()
    if explicit or path.exists():
        try:
            cfg = build(AgentctlConfig, load_yaml(path), source=str(path))
        except ConfigError as e:
            raise CliError(f"error: {e}", EXIT["usage"]) from None
    urls = _urls(args, cfg)
    ca_file = args.ca_file or os.environ.get("TRAINGUARD_CA_FILE") or None
    if ca_file is None and cfg.ca_file is not None:
        ca_file = cfg.ca_file
        if not Path(ca_file).is_absolute():
            ca_file = str(path.parent / ca_file)
    return Settings(urls=urls, token=_token(args, cfg, path, err), ca_file=ca_file)


def _urls(args: argparse.Namespace, cfg: AgentctlConfig) -> tuple[str, ...]:
    """The controller URLs: --url, else TRAINGUARD_URL (each comma-separated), else the
    config file, else the default; a bad entry is a usage error naming where it came from."""
    for source, text in (("--url", args.url), ("TRAINGUARD_URL", os.environ.get("TRAINGUARD_URL"))):
        if text:
            urls = split_urls(text)
            try:
                check_urls(urls, key=source)
            except Invalid as e:
                raise CliError(f"error: {e.key}: {e.reason}", EXIT["usage"]) from None
            return tuple(urls)
    return cfg.resolved_urls() or (DEFAULT_URL,)


def _token(args: argparse.Namespace, cfg: AgentctlConfig, path: Path, err: IO[str]) -> str | None:
    token_file = args.token_file
    if token_file is None and not os.environ.get("TRAINGUARD_TOKEN"):
        token_file = cfg.token_file
        if token_file is not None and not Path(token_file).is_absolute():
            token_file = str(path.parent / token_file)
    if token_file is None:
        return os.environ.get("TRAINGUARD_TOKEN") or None
    try:
        with open(token_file, encoding="utf-8") as f:
            mode = os.fstat(f.fileno()).st_mode
            token = f.read().strip()
    except OSError as e:
        raise CliError(
            f"error: cannot read token file {token_file}: {e.strerror or e}", EXIT["usage"]
        ) from None
    if os.name == "posix" and stat.S_ISREG(mode) and mode & 0o077:
        err.write(
            f"warning: token file {token_file} is open to group or others "
            f"(mode {stat.S_IMODE(mode):04o}); fix: chmod 600 {token_file}\n"
        )
    return token
