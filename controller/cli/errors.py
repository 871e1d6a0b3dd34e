"""agentctl's exit codes and the error that carries one to main."""

from __future__ import annotations

__all__ = ["EXIT", "CliError"]

EXIT = {
    "ok": 0,
    "error": 1,
    "usage": 2,
    "not_found": 3,
    "auth": 4,
    "connect": 5,
    "interrupted": 130,  # Ctrl-C (128 + SIGINT), as a shell reports a command it stopped
}


class CliError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code
