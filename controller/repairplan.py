"""The node lifecycle's plan after a hardware drain: which repair the XID catalog asks for, what
a diagnosis (a preflight's checks) makes of it, and the action rows that carry a node through
diagnose -> repair -> validate, with the reboot policy and its rate limit
(docs/controller.md "Node lifecycle").

Each next row is added by the step before it finishes, under a key derived from the drain's
(`lifecycle:<step>:<drain key>`): a step re-run after a controller crash adds the same key
again, which the store ignores, so no step is planned twice and none is lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.controller.config import LifecycleConfig
from trainguard.controller.records import NewAction
from trainguard.controller.store import Store
from trainguard.controller.views import IncidentView
from trainguard.kinds import EventKind
from trainguard.xid_catalog import XidCatalog

log = logging.getLogger("trainguard.controller.repairplan")

# catalog action -> the agent's repair method (contract REPAIR_METHODS)
REPAIR_OF_ACTION = {"reset_gpu": "gpu_reset", "reboot_node": "reboot"}
# idempotency key prefixes of the lifecycle's rows
KEY_DIAGNOSE = "lifecycle:diagnose:"
KEY_RESET = "lifecycle:reset:"
KEY_REBOOT = "lifecycle:reboot:"
KEY_VALIDATE = "lifecycle:validate:"
# a failed one of these is a hardware failure (controller.lemons counts it)
HARDWARE_FAILURE_KEYS = (KEY_RESET, KEY_REBOOT, KEY_VALIDATE)
# the preflight checks a GPU reset or reboot can fix (ckpt_storage is not the GPU's)
GPU_CHECKS = frozenset({"nvml_health", "row_remaps", "ecc", "compute_burn", "collective_bandwidth"})
# what a diagnosis runs: the GPU's own state and a burn (silent data corruption), in seconds;
# the all-reduce and the storage write wait for the validation, which runs every check
DIAGNOSIS_CHECKS = ("nvml_health", "row_remaps", "ecc", "compute_burn")
# XIDs reported this long before the incident opened still count for its repair, s
EVENT_LOOKBACK_S = 600.0
_EVENT_KINDS = (EventKind.XID.value, EventKind.GPU_LOST.value, EventKind.FALLEN_OFF_BUS.value)


@dataclass(frozen=True)
class RepairNeed:
    """What the catalog asks of a drained node: `action` reset_gpu or reboot_node, on `gpus`
    (empty: all), and the evidence (`why`, e.g. "XID 48 on GPU 1")."""

    action: str
    gpus: tuple[int, ...]
    why: str


def repair_need(events: Sequence[dict[str, Any]], catalog: XidCatalog) -> RepairNeed | None:
    """The most severe repair the node's XID / GPU-lost events ask for (reboot_node over
    reset_gpu), or None when none asks for one."""
    reboot: list[tuple[int | None, str]] = []
    reset: list[tuple[int | None, str]] = []
    for e in events:
        gpu = e.get("gpu") if isinstance(e.get("gpu"), int) else None
        kind = e.get("kind")
        if kind in (EventKind.GPU_LOST.value, EventKind.FALLEN_OFF_BUS.value):
            reboot.append((gpu, "GPU lost"))
            continue
        code = e.get("code")
        if kind != EventKind.XID.value or not isinstance(code, int):
            continue
        action = catalog.classify(code, str(e.get("message") or "")).action
        if action == "reboot_node":
            reboot.append((gpu, f"XID {code}"))
        elif action == "reset_gpu":
            reset.append((gpu, f"XID {code}"))
    found, action = (reboot, "reboot_node") if reboot else (reset, "reset_gpu")
    if not found:
        return None
    gpus = tuple(sorted({g for g, _ in found if g is not None}))
    whys = sorted({w for _, w in found})
    where = f" on GPU {','.join(map(str, gpus))}" if gpus else ""
    return RepairNeed(action=action, gpus=gpus, why=", ".join(whys) + where)


@dataclass(frozen=True)
class Diagnosis:
    """What a diagnosis decided: `method` (gpu_reset / reboot) to run, or None with `why` the
    node stays out."""

    method: str | None
    why: str


def diagnose(*, action: str, checks: Sequence[Any]) -> Diagnosis:
    """The repair for a node whose catalog action is `action`, given its preflight's checks:
    a GPU that no longer answers NVML needs a reboot (a reset cannot reach it), else the
    catalog's action runs even when every check passes (a pending remap or a wedged engine is
    cleared only by it); a node whose only failing check is not the GPU's (ckpt_storage) is
    not one a repair fixes."""
    failed = {
        str(c.get("name"))
        for c in checks
        if isinstance(c, dict) and not c.get("passed", False) and c.get("name")
    }
    if failed and not failed & GPU_CHECKS:
        names = ", ".join(sorted(failed))
        return Diagnosis(None, f"{names} failed: not a GPU fault a reset or reboot fixes")
    if "nvml_health" in failed:
        return Diagnosis("reboot", "a GPU does not answer NVML: a node reboot")
    method = REPAIR_OF_ACTION.get(action)
    if method is None:
        return Diagnosis(None, f"no repair for the catalog's action {action!r}")
    return Diagnosis(method, f"the catalog's {action}")


@dataclass(frozen=True)
class FollowUp:
    """What a drain's follow-up did: `note` for the drain step; `keep_out` a reason to add to
    the node's drain reason when no repair is planned (e.g. a reboot the policy refuses)."""

    note: str
    keep_out: str | None = None


class RepairPlanner:
    """Adds the lifecycle's rows and keeps the reboot policy and its rate limit."""

    def __init__(
        self,
        *,
        store: Store,
        config: LifecycleConfig,
        catalog: XidCatalog,
        now: Callable[[], float],
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self._store = store
        self._config = config
        self._catalog = catalog
        self._now = now
        self._wake = wake
        self._lock = threading.Lock()  # one rate-limit count and add at a time

    @property
    def config(self) -> LifecycleConfig:
        return self._config

    def after_drain(self, node: str, *, incident: IncidentView, key: str) -> FollowUp | None:
        """A drain step of `incident` left `node` drained: plan its diagnosis when the
        catalog asks for a repair the policy allows. None: nothing to follow up."""
        if not self._config.auto_repair:
            return None
        since = incident.opened_at - EVENT_LOOKBACK_S
        events = self._store.events.of_node_since(node, since, kinds=_EVENT_KINDS)
        need = repair_need(events, self._catalog)
        if need is None:
            return None
        if need.action == "reboot_node" and self._store.actions.by_key(KEY_DIAGNOSE + key) is None:
            refused = self.reboot_refused()
            if refused is not None:
                log.info("event=repair_refused node=%s why=%r reason=%r", node, need.why, refused)
                return FollowUp(note=f"not repaired: {refused}", keep_out=f"{need.why}: {refused}")
        self._add(
            NewAction(
                kind="diagnose",
                target=node,
                idempotency_key=KEY_DIAGNOSE + key,
                params={
                    "node": node,
                    "action": need.action,
                    "gpus": list(need.gpus),
                    "why": need.why,
                    "incident": incident.id,
                    "root": key,
                },
            )
        )
        log.info("event=repair_planned node=%s action=%s why=%r", node, need.action, need.why)
        return FollowUp(note=f"diagnosis planned ({need.why}: {need.action})")

    def start_repair(
        self, node: str, *, method: str, gpus: Sequence[int], root: str, why: str
    ) -> str | None:
        """Add the repair row; for a reboot, only where the policy and the rate limit allow
        (else the reason the node stays out, and nothing is added)."""
        if method == "reboot":
            with self._lock:
                if self._store.actions.by_key(KEY_REBOOT + root) is None:
                    refused = self._reboot_refused()
                    if refused is not None:
                        return refused
                self._add(self._repair_row(node, method=method, gpus=(), root=root, why=why))
            return None
        self._add(self._repair_row(node, method=method, gpus=gpus, root=root, why=why))
        return None

    def start_validation(self, node: str, *, root: str) -> None:
        self._add(
            NewAction(
                kind="validate",
                target=node,
                idempotency_key=KEY_VALIDATE + root,
                params={"node": node, "role": self._config.repair_return_role, "root": root},
            )
        )

    def repair_refused(self, method: str) -> str | None:
        """Why `method` may not start now (a reboot the policy or the rate limit refuses)."""
        return self.reboot_refused() if method == "reboot" else None

    def reboot_refused(self) -> str | None:
        """Why a lifecycle reboot may not start now, or None."""
        with self._lock:
            return self._reboot_refused()

    def _reboot_refused(self) -> str | None:
        cfg = self._config
        if not cfg.reboot_enabled:
            return "needs a node reboot; lifecycle.reboot_enabled is off"
        since = self._now() - cfg.reboot_window_s
        done = self._store.actions.count_keyed_since(KEY_REBOOT, since=since)
        if done >= cfg.reboot_max:
            return (
                f"needs a node reboot; the rate limit is reached ({done} lifecycle reboots in"
                f" {cfg.reboot_window_s:g} s, lifecycle.reboot_max {cfg.reboot_max})"
            )
        return None

    def _repair_row(
        self, node: str, *, method: str, gpus: Sequence[int], root: str, why: str
    ) -> NewAction:
        prefix = KEY_REBOOT if method == "reboot" else KEY_RESET
        return NewAction(
            kind="repair",
            target=node,
            idempotency_key=prefix + root,
            params={"node": node, "method": method, "gpus": list(gpus), "why": why, "root": root},
        )

    def _add(self, row: NewAction) -> None:
        self._store.actions.add(None, [row], ts=self._now())
        self._wake()


__all__ = [
    "DIAGNOSIS_CHECKS",
    "GPU_CHECKS",
    "HARDWARE_FAILURE_KEYS",
    "Diagnosis",
    "FollowUp",
    "RepairNeed",
    "RepairPlanner",
    "diagnose",
    "repair_need",
]
