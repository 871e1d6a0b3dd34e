"""Where a Slurm job may run next: which of its nodes are unusable, and the spares of the
reservation general work cannot use (`spare_reservation`) that may stand in for them; taking
a spare is taking it out of the reservation for the job. A spare is taken only after a
passing preflight (the gate of controller.actions.sparecheck, `pick`): a failing one is
drained in Slurm with the reason (so it stays out of the pool) and the next one is tried. A
node the lifecycle repairs and brings back as a spare goes back into the reservation.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from trainguard.controller.actions.base import ActionContext
from trainguard.controller.actions.jobsteps import gate_spares
from trainguard.controller.actions.sparecheck import SparePreflight
from trainguard.controller.backends.slurm.cli import SlurmJob
from trainguard.controller.backends.slurm.failures import as_step_error
from trainguard.controller.backends.slurm.mirror import SlurmMirror, trainguard_reason
from trainguard.controller.livestate import LiveState

__all__ = ["SlurmSpares"]

log = logging.getLogger("trainguard.controller.slurm")


class SlurmSpares:
    """A job's node set, its unusable nodes, and spares taken out of the reservation."""

    def __init__(
        self,
        *,
        mirror: SlurmMirror,
        live: LiveState,
        node_silent_after_s: float,
        open_incident_nodes: Callable[[], set[str]],
        spare_check: SparePreflight | None = None,
    ) -> None:
        self._mirror = mirror
        self._live = live
        self._silent_after_s = node_silent_after_s
        self._open_incident_nodes = open_incident_nodes
        # the gate drains a spare it takes out of the pool in Slurm too
        self._check = (
            dataclasses.replace(spare_check, out_of_pool=self._drain_out)
            if spare_check is not None
            else None
        )

    @property
    def reservation(self) -> str:
        return self._mirror.config.spare_reservation

    def silent(self, node: str) -> bool:
        """The node's agent has not reported within `node_silent_after_s` (or never)."""
        age = self._live.report_age_s(node)
        return age is None or age > self._silent_after_s

    def usable(self, node: str) -> bool:
        """The agent reports and Slurm may schedule on the node."""
        sn = self._mirror.node(self._mirror.slurm_name(node))
        return sn is not None and sn.usable and not self.silent(node)

    def bad(self, nodes: list[str], sick: str | None) -> list[str]:
        """The nodes (agent names) a next run must not use: the sick one and the unusable."""
        return [n for n in nodes if n == sick or not self.usable(n)]

    def job_nodes(self, job: SlurmJob) -> list[str]:
        """The job's node set: its allocation while it runs, else the one it last ran on,
        else the nodes it was pinned to, else where its ranks reported from."""
        if job.state == "RUNNING" and job.nodes:
            return self._mirror.agent_nodes(job)
        # completing: squeue shows only the nodes still cleaning up
        last = self._mirror.last_allocation(job.id)
        if last:
            return [self._mirror.agent_name(n) for n in last]
        if job.required_nodes:
            return [self._mirror.agent_name(n) for n in job.required_nodes]
        with self._live.lock:
            seen = self._live.jobs_seen.get(self._mirror.job_name(job.id))
            return sorted(seen.nodes) if seen is not None else []

    def candidates(self, exclude: set[str]) -> list[str]:
        """Spares (agent names) a job may take now: in the reservation, idle and usable in
        Slurm, their agent healthy with no open incident."""
        open_nodes = self._open_incident_nodes()
        spares = self._mirror.spares()
        nodes = self._mirror.nodes()
        out = []
        for sname in spares:
            node = self._mirror.agent_name(sname)
            sn = nodes.get(sname)
            if node in exclude or sn is None or not sn.usable or sn.busy:
                continue
            if self.silent(node) or node in open_nodes:
                continue
            out.append(node)
        return sorted(out)

    def pick(
        self, ctx: ActionContext, progress: dict[str, Any], *, exclude: set[str], need: int
    ) -> tuple[list[str], str | None]:
        """The candidates that may join a job now, through the preflight gate (`need` of
        them at most), and what the step waits for while a preflight runs; `progress` (the
        step's output) gains the running preflights."""
        return gate_spares(
            self._check, self.candidates(exclude), need=need, ctx=ctx, progress=progress
        )

    def _drain_out(self, node: str, reason: str) -> None:
        """A spare the gate takes out of the pool: drained in Slurm with the reason (the next
        sync mirrors it into the node table)."""
        sname = self._mirror.slurm_name(node)
        text = trainguard_reason(reason=reason, rule=None, incident_id=None)
        with as_step_error(f"draining spare {node} in Slurm"):
            self._mirror.commands.drain(sname, reason=text)
        log.warning("event=slurm_spare_drained node=%s reason=%r", node, text)

    def put_in_pool(self, node: str, *, role: str) -> None:
        """A node the lifecycle brings back as a spare joins the reservation (created again
        when trainguard removed its last node); one brought back active leaves it. Read from
        Slurm first, so a re-run changes nothing."""
        sname = self._mirror.slurm_name(node)
        commands = self._mirror.commands
        with self._mirror.lock, as_step_error(f"returning {node} to the {role} pool in Slurm"):
            current = commands.reservation_nodes(self.reservation)
            members = list(current or ())
            if role == "spare" and sname not in members:
                if current is None:
                    users = self._mirror.config.spare_reservation_users
                    commands.create_reservation(self.reservation, [sname], users=users)
                else:
                    commands.set_reservation_nodes(self.reservation, [*members, sname])
            elif role == "active" and sname in members:
                commands.set_reservation_nodes(self.reservation, [m for m in members if m != sname])
            else:
                return
            self._mirror.refresh()
        log.info(
            "event=slurm_spare_returned node=%s slurm_node=%s role=%s reservation=%s",
            node,
            sname,
            role,
            self.reservation,
        )

    def take(
        self,
        job: SlurmJob,
        *,
        bad: list[str],
        nodes: list[str],
        spares: list[str] | None = None,
    ) -> dict[str, str]:
        """Swap each bad node for a spare (`spares`, those `pick` gave; else every
        candidate) taken out of the reservation; {} when too few."""
        if spares is None:
            spares = self.candidates(exclude=set(nodes))
        if len(spares) < len(bad):
            return {}
        swap = dict(zip(bad, spares, strict=False))
        left = [s for s in self._mirror.spares() if self._mirror.agent_name(s) not in swap.values()]
        with as_step_error(f"taking {', '.join(swap.values())} out of the spare reservation"):
            self._mirror.commands.set_reservation_nodes(self.reservation, left)
            self._mirror.refresh()
        log.info(
            "event=slurm_spare_taken job=%s swap=%s reservation_left=%s",
            job.id,
            ",".join(f"{b}->{s}" for b, s in swap.items()),
            ",".join(left) or "-",
        )
        return swap
