"""What the store raises: it cannot be opened, the database went away, or the write fence
refused a write. The API maps the last two to 503 (controller/api.py)."""

from __future__ import annotations


class StoreError(RuntimeError):
    """The store cannot be opened or used (names the file and the reason)."""


class StoreConnectError(RuntimeError):
    """PostgreSQL cannot be reached (or psycopg is missing); the message names the URL with its
    password elided and the reason."""


class StoreUnavailable(RuntimeError):
    """The store was reachable and is not now (PostgreSQL stopped, restarting, cut off): the
    statement did not run, or its transaction was not committed. Retry once it is back; the
    API answers 503. The message names the URL with its password elided and the reason."""


class LeaseLost(RuntimeError):
    """The write fence refused a write transaction (HA, store/lease.py): this controller does
    not hold the leader lease now (a standby, or its lease ran out or was taken over). The
    transaction wrote nothing; the API answers 503 naming the leader (X-Trainguard-Leader)."""


__all__ = ["LeaseLost", "StoreConnectError", "StoreError", "StoreUnavailable"]
