"""The rules route: reload the rule files (a bad file keeps the old rules)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import Depends
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from trainguard.controller.api.requests import Guards
from trainguard.controller.api.routing import Routes, ok
from trainguard.controller.auth import Principal
from trainguard.controller.service import ControllerService

__all__ = ["RulesReloaded", "add_rule_routes"]

log = logging.getLogger("trainguard.controller.api")


@dataclass(frozen=True)
class RulesReloaded:
    rules: int


def add_rule_routes(routes: Routes, *, service: ControllerService, guards: Guards) -> None:
    writer = guards.writer

    @routes.add(
        "POST",
        "/v1/rules/reload",
        "rules",
        routes.answer("Rules reloaded", routes.schemas.ref(RulesReloaded), (400, 401, 403)),
    )
    async def reload_rules(who: Principal = Depends(writer)) -> Response:
        count = await run_in_threadpool(service.reload_rules, actor=who.name)
        log.info("event=rules_reloaded rules=%s actor=%s", count, who.name)
        return ok(RulesReloaded(rules=count))
