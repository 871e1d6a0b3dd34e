"""Errors the service facade raises; the API maps them to HTTP status codes."""

from __future__ import annotations


class ServiceError(Exception):
    """Base: `str(e)` is a message safe to show the caller."""

    status = 500


class NotFound(ServiceError):
    status = 404


class Conflict(ServiceError):
    """The request is valid but the current state forbids it (e.g. drain below min nodes)."""

    status = 409


class BadRequest(ServiceError):
    status = 400


class LimitReached(ServiceError):
    """A configured limit (e.g. api.max_nodes) refuses the request; the message names it."""

    status = 403


class NotLeader(ServiceError):
    """This controller does not hold the leader lease (HA, controller/ha.py): it writes nothing
    and acts on nothing; the API answers 503 naming the leader (X-Trainguard-Leader)."""

    status = 503
