"""What trainguard knows of Slurm: the last read of its nodes, jobs and spare reservation,
refreshed by a sync thread (every `sync_interval_s`) and before each step; the node states
and reasons mirrored into trainguard's node table; and the names on both sides (agent node
names <-> Slurm NodeNames, Slurm job ids <-> the job names the trainer heartbeats carry).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence

from trainguard.bounds import clip_drain_reason
from trainguard.controller.actions.base import PermanentError
from trainguard.controller.backends.config import SlurmBackendConfig
from trainguard.controller.backends.slurm.cli import SlurmCommands, SlurmError, SlurmJob, SlurmNode
from trainguard.controller.backends.slurm.failures import as_step_error
from trainguard.controller.livestate import LiveState
from trainguard.controller.nodestate import NodeState

__all__ = ["REASON_PREFIX", "SlurmMirror", "node_state_of", "trainguard_reason"]

log = logging.getLogger("trainguard.controller.slurm")

REASON_PREFIX = "trainguard:"
_SLURM_JOB_NAME = re.compile(r"slurm-(\d+)")


def trainguard_reason(*, reason: str, rule: str | None, incident_id: int | None) -> str:
    """The Slurm drain reason trainguard writes (and later recognises as its own), cut to the
    drain reason bound: it is one argument of `scontrol`."""
    if rule and incident_id is not None:
        return clip_drain_reason(f"{REASON_PREFIX} {rule} incident {incident_id}")
    return clip_drain_reason(f"{REASON_PREFIX} {reason}")


def node_state_of(node: SlurmNode) -> tuple[str, str | None]:
    """trainguard's (state, drain reason) for a Slurm node: draining while Slurm still runs a
    job there, drained once it does not; a reason set by others says who set it."""
    if not (node.drain or node.down):
        return "active", None
    state = "draining" if node.drain and not node.down and node.busy else "drained"
    reason = node.reason or ("down" if node.down else "drained")
    if not reason.startswith(REASON_PREFIX):
        what = "down" if node.down else "drain"
        reason = f"{reason} (Slurm {what}, set by {node.reason_user or 'unknown'})"
    return state, reason


class SlurmMirror:
    """Slurm's nodes, jobs and spares as last read, and the names between the two sides.

    Every read of the state takes `lock` (an RLock: a step holds it across a read, a Slurm
    command and the refresh after it)."""

    def __init__(
        self, *, config: SlurmBackendConfig, commands: SlurmCommands, live: LiveState
    ) -> None:
        self.config = config
        self.commands = commands
        self._live = live
        self._to_slurm = dict(config.node_names)
        self._to_agent = {v: k for k, v in config.node_names.items()}
        self.lock = threading.RLock()
        self._nodes: dict[str, SlurmNode] = {}  # by Slurm name
        self._jobs: dict[str, SlurmJob] = {}  # by id
        self._spares: tuple[str, ...] | None = None  # Slurm names; None: never read
        self._names: dict[str, str] = {}  # Slurm job id -> the job name its heartbeats carry
        self._acted: set[str] = set()  # Slurm job ids a step worked on (shown while they live)
        # job id -> the nodes (Slurm names) it last ran on: squeue shows none once Slurm
        # requeued it (a node failure), and a replacement starts from that set
        self._allocations: dict[str, tuple[str, ...]] = {}
        # heartbeat job name -> the agent nodes its Slurm job runs on (`job_nodes`): replaced
        # whole by each refresh, read without the lock by the report path
        self._scope_nodes: dict[str, frozenset[str]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_sync_error: str | None = None

    # --- names ------------------------------------------------------------------------------

    def slurm_name(self, node: str) -> str:
        return self._to_slurm.get(node, node)

    def agent_name(self, node: str) -> str:
        return self._to_agent.get(node, node)

    def agent_nodes(self, job: SlurmJob) -> list[str]:
        return [self.agent_name(n) for n in job.nodes]

    def job_name(self, job_id: str) -> str:
        with self.lock:
            return self._names.get(job_id, f"slurm-{job_id}")

    def job_id(self, name: str) -> str | None:
        m = _SLURM_JOB_NAME.fullmatch(name)
        if m is not None:
            return m.group(1)
        with self.lock:
            for job_id, known in self._names.items():
                if known == name:
                    return job_id
        return None

    # --- the state as last read -------------------------------------------------------------

    def node(self, slurm_name: str) -> SlurmNode | None:
        with self.lock:
            return self._nodes.get(slurm_name)

    def nodes(self) -> dict[str, SlurmNode]:
        with self.lock:
            return dict(self._nodes)

    def spares(self) -> tuple[str, ...]:
        """The spare reservation's nodes (Slurm names); () before the first read."""
        with self.lock:
            return self._spares or ()

    def job(self, job_id: str) -> SlurmJob:
        """The Slurm job; PermanentError when squeue no longer shows it."""
        with self.lock:
            job = self._jobs.get(job_id)
        if job is None:
            raise PermanentError(f"Slurm job {job_id} is not in squeue (gone or purged)")
        return job

    def active_job_on(self, slurm_name: str) -> str | None:
        """The id of a job Slurm runs (or is ending) on the node, if any."""
        with self.lock:
            for job in self._jobs.values():
                if job.active and slurm_name in job.nodes:
                    return job.id
        return None

    def last_allocation(self, job_id: str) -> tuple[str, ...] | None:
        """The nodes (Slurm names) the job last ran on, while squeue shows it."""
        with self.lock:
            return self._allocations.get(job_id)

    def mark_acted(self, job_id: str) -> None:
        """A step worked on the job: show it in the job views while Slurm has it."""
        with self.lock:
            self._acted.add(job_id)

    def shown_jobs(self) -> list[SlurmJob]:
        """The jobs the job views show: those whose ranks report, and those a step worked on."""
        with self.lock:
            return [j for j in self._jobs.values() if j.id in self._names or j.id in self._acted]

    # --- reading Slurm ----------------------------------------------------------------------

    def refresh(self) -> None:
        """Read nodes, jobs and the spare reservation from Slurm; mirror the nodes into
        trainguard's node table. Raises SlurmError."""
        nodes = self.commands.nodes()
        jobs = self.commands.jobs()
        spares = self.commands.reservation_nodes(self.config.spare_reservation)
        with self.lock:
            self._nodes = nodes
            self._jobs = jobs
            self._spares = spares or ()
            for job in jobs.values():
                if job.state == "RUNNING" and job.nodes:
                    self._allocations[job.id] = job.nodes
            for gone in set(self._allocations) - set(jobs):
                del self._allocations[gone]
            self._learn_names()
            self._scope_nodes = self._job_scopes()
        self._mirror()

    def fresh(self) -> None:
        """`refresh()` for a step: Slurm's failure fails the step."""
        with as_step_error("reading Slurm (sinfo/squeue/scontrol)"):
            self.refresh()

    def _learn_names(self) -> None:
        """Map the job names seen in heartbeats to Slurm job ids. Caller holds the lock."""
        with self._live.lock:
            seen = {name: set(s.nodes) for name, s in self._live.jobs_seen.items()}
        for name, nodes in seen.items():
            m = _SLURM_JOB_NAME.fullmatch(name)
            if m is not None:
                self._names[m.group(1)] = name
                continue
            slurm_nodes = {self.slurm_name(n) for n in nodes}
            for job in self._jobs.values():
                if job.name == name and job.active and slurm_nodes & set(job.nodes):
                    self._names[job.id] = name

    def _job_scopes(self) -> dict[str, frozenset[str]]:
        """Heartbeat job name -> agent nodes, for each Slurm job not finished: its allocation,
        else the one it last ran on, else the nodes it is pinned to. Caller holds the lock."""
        out: dict[str, frozenset[str]] = {}
        for job in self._jobs.values():
            if job.finished:
                continue
            if job.state == "RUNNING" and job.nodes:
                slurm_nodes: Sequence[str] = job.nodes
            else:
                slurm_nodes = self._allocations.get(job.id) or job.required_nodes or ()
            nodes = frozenset(self.agent_name(n) for n in slurm_nodes)
            for name in {f"slurm-{job.id}", self._names.get(job.id)}:
                if name is not None:
                    out[name] = out.get(name, frozenset()) | nodes
        return out

    def job_nodes(self, job: str) -> frozenset[str] | None:
        """The agent nodes a Slurm job runs on, by the name its heartbeats carry; None if no
        Slurm job has that name (controller.jobscope)."""
        return self._scope_nodes.get(job)  # no lock: the report path holds the live state's

    def _mirror(self) -> None:
        """Slurm's drain/down state and reason -> the node table; the reservation -> roles."""
        with self.lock:
            nodes = dict(self._nodes)
            spares = set(self._spares or ())
            have_spares = self._spares is not None
        for rec in self._live.all_nodes():
            sn = nodes.get(self.slurm_name(rec.name))
            if sn is None:
                continue  # an agent on a host Slurm does not schedule
            state, reason = node_state_of(sn)
            held = NodeState.parse(rec.state)
            if held is not None and held.in_lifecycle:
                pass  # diagnosed, repaired, validated or retired: trainguard owns the state
            elif (rec.state, rec.drain_reason) != (state, reason):
                self._live.set_node_state(rec.name, state, reason=reason)
            role = "spare" if sn.name in spares else "active"
            if have_spares and rec.role != role:
                with self._live.lock:
                    self._live.put_node(self._live.store.nodes.update(rec.name, role=role))
                log.info("event=node_role node=%s role=%s source=slurm", rec.name, role)

    # --- the sync thread --------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._sync_loop, name="slurm-sync", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.command_timeout_s * 3 + 1)

    def _sync_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
                if self.last_sync_error is not None:
                    log.info("event=slurm_sync_ok")
                self.last_sync_error = None
            except SlurmError as e:
                if str(e) != self.last_sync_error:
                    log.warning("event=slurm_sync_failed error=%s", e)
                self.last_sync_error = str(e)
            except Exception:  # the sync must outlive a bug in one round
                log.exception("event=slurm_sync_error")
            self._stop.wait(self.config.sync_interval_s)
