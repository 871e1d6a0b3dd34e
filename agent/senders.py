"""Who sent a heartbeat, and which job it may speak for.

The heartbeat socket is shared by every job on the node (and open to the socket's group), so a
datagram's `job` and `rank` fields are claims. The kernel tells the agent the sending process
(SO_PASSCRED: pid and uid); `SenderResolver` turns that into the process's **origin** from
/proc, which a process cannot forge:
- `launch`: a descendant of a launch this agent started (torchrun backend): its job is known.
- `slurm`: a descendant of a root-owned `slurmstepd: [<id>.<step>]`: Slurm job <id>, whose
  heartbeats name the job `slurm-<id>`.
- `user`: anything else (a job started by hand, another scheduler): only its uid is known.
`JobClaims` (pure) decides whether an origin may speak for a job name: a launched job only
through its launch's processes, `slurm-<id>` only from inside Slurm job <id>, and any other name
is owned by the first origin that claims it (a uid, or a Slurm job) until the job has no ranks
left on the node.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "REFUSALS",
    "JobClaims",
    "Origin",
    "SenderResolver",
    "read_proc_entry",
]

OriginKind = Literal["launch", "slurm", "user"]
# why a heartbeat was refused (the log line and the `sender_not_allowed` drop count say which)
REFUSALS = (
    "other_job",  # the sender belongs to another job
    "not_the_jobs_process",  # the job is one this agent launched (or a Slurm job): not from it
    "owned_by_another_sender",  # another uid or Slurm job already speaks for this name
    "rank_taken",  # a live process of the job already speaks for this rank
    "too_many_jobs",
)
MAX_ANCESTRY = 64  # a deeper process tree is not a launch's (nor Slurm's)
MAX_CACHED = 1024  # sender pids remembered
RECHECK_S = 1.0  # a sender's origin is resolved again after this (pid reuse, adopted launches)
MAX_JOBS = 1024  # job names owned at once
SLURM_JOB_NAME = re.compile(r"slurm-(\d+)")
_STEPD_RE = re.compile(rb"^slurmstepd: \[(\d+)\.")


@dataclass(frozen=True)
class Origin:
    """What a sending process belongs to."""

    kind: OriginKind
    uid: int
    job: str | None = None  # launch: the launched job's name; slurm: "slurm-<id>"


@dataclass(frozen=True)
class ProcEntry:
    ppid: int
    start_ticks: int
    comm: str
    uid: int | None


def read_proc_entry(proc_root: str, pid: int) -> ProcEntry | None:
    """The parent, start time, command name and real uid of `pid`; None if it is gone."""
    try:
        with open(f"{proc_root}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    open_at, close_at = stat.find(b"("), stat.rfind(b")")
    if open_at < 0 or close_at < open_at:
        return None
    fields = stat[close_at + 2 :].split()
    try:
        ppid, start_ticks = int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None
    uid: int | None = None
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    uid = int(line.split()[1])
                    break
    except (OSError, ValueError, IndexError):
        uid = None
    comm = stat[open_at + 1 : close_at].decode("utf-8", "replace")
    return ProcEntry(ppid=ppid, start_ticks=start_ticks, comm=comm, uid=uid)


class SenderResolver:
    """pid -> Origin from /proc (`proc_root` is a fake tree in tests).

    `launches()` gives the live launches of this agent: (leader pid, leader start ticks) ->
    job name. Results are cached per pid for RECHECK_S.
    """

    def __init__(
        self,
        *,
        proc_root: str = "/proc",
        launches: Callable[[], Mapping[tuple[int, int], str]] = dict,
        monotonic: Callable[[], float],
    ) -> None:
        self.proc_root = proc_root
        self.launches = launches
        self._monotonic = monotonic
        self._cache: OrderedDict[int, tuple[float, Origin]] = OrderedDict()

    def origin(self, pid: int, uid: int) -> Origin:
        if pid <= 0:
            return Origin("user", uid)
        now = self._monotonic()
        cached = self._cache.get(pid)
        if cached is not None and now - cached[0] < RECHECK_S and cached[1].uid == uid:
            self._cache.move_to_end(pid)
            return cached[1]
        # resolved afresh every RECHECK_S: a pid the kernel handed to another process, or a
        # launch the agent adopted meanwhile, is seen within that
        origin = self._resolve(pid, uid, read_proc_entry(self.proc_root, pid))
        self._cache[pid] = (now, origin)
        self._cache.move_to_end(pid)
        while len(self._cache) > MAX_CACHED:
            self._cache.popitem(last=False)
        return origin

    def _resolve(self, pid: int, uid: int, entry: ProcEntry | None) -> Origin:
        """The sender's origin. The uid the kernel gave must be the process's own (else the
        pid was reused since the datagram was sent) and the job's owner's: the uid of the
        job's first process below its launch leader or `slurmstepd` (else the sender is a
        setuid program or a recycled pid inside another user's job). Anything else is a
        plain user process of that uid."""
        if entry is None or entry.uid != uid:
            return Origin("user", uid)
        launches = self.launches()
        seen = 0
        current, below = pid, entry
        proc: ProcEntry | None = entry
        while proc is not None and current > 1 and seen < MAX_ANCESTRY:
            job = launches.get((current, proc.start_ticks))
            if job is not None:
                return Origin("launch", uid, job) if below.uid == uid else Origin("user", uid)
            if proc.comm == "slurmstepd" and proc.uid == 0:
                slurm_id = self._slurm_job_id(current)
                if slurm_id is not None:
                    if below.uid != uid:
                        return Origin("user", uid)
                    return Origin("slurm", uid, f"slurm-{slurm_id}")
            below = proc
            current = proc.ppid
            proc = read_proc_entry(self.proc_root, current)
            seen += 1
        return Origin("user", uid)

    def _slurm_job_id(self, pid: int) -> str | None:
        try:
            with open(f"{self.proc_root}/{pid}/cmdline", "rb") as f:
                cmdline = f.read(256)
        except OSError:
            return None
        m = _STEPD_RE.match(cmdline)
        return None if m is None else m.group(1).decode()


class JobClaims:
    """Which origin may speak for which job name on this node. Not thread-safe: the heartbeat
    server calls it under its lock."""

    def __init__(self, *, launched: Callable[[], Collection[str]] = frozenset) -> None:
        self.launched = launched
        self._owners: dict[str, tuple[str, int | str]] = {}
        # the last check's (origin, job, owner): `bind` right after it reuses the owner rather
        # than asking `launched` again (both run once per heartbeat, under the server's lock)
        self._checked: tuple[Origin, str, tuple[str, int | str] | str | None] | None = None

    def check(self, origin: Origin, job: str) -> str | None:
        """None if `origin` may speak for `job`, else the refusal. Changes nothing: a free
        name is taken by `bind` once its heartbeat was accepted."""
        owner = self._owner(origin, job)
        self._checked = (origin, job, owner)
        if isinstance(owner, str):
            return owner
        if owner is None:
            return None
        bound = self._owners.get(job)
        if bound is None:
            return "too_many_jobs" if len(self._owners) >= MAX_JOBS else None
        return None if bound == owner else "owned_by_another_sender"

    def bind(self, origin: Origin, job: str) -> None:
        """`origin` speaks for `job` from now on (after `check` allowed it)."""
        checked = self._checked
        if checked is not None and checked[0] is origin and checked[1] == job:
            owner = checked[2]
        else:
            owner = self._owner(origin, job)
        if isinstance(owner, tuple) and job not in self._owners:
            self._owners[job] = owner

    def _owner(self, origin: Origin, job: str) -> tuple[str, int | str] | str | None:
        """The owner a free name would get; None: no owner needed (the origin proves the
        job); a string: the refusal."""
        if origin.kind == "launch":
            return None if origin.job == job else "other_job"
        if job in self.launched():
            return "not_the_jobs_process"
        slurm = SLURM_JOB_NAME.fullmatch(job)
        if origin.kind == "slurm":
            if job == origin.job:
                return None
            if slurm is not None:
                return "other_job"
            return ("slurm", str(origin.job))
        if slurm is not None:
            return "not_the_jobs_process"
        return ("uid", origin.uid)

    def forget(self, job: str) -> None:
        """The job has no rank left on this node: its name is free again."""
        self._owners.pop(job, None)

    def owners(self) -> dict[str, str]:
        """job -> its owner, for logs and tests."""
        return {job: f"{kind}:{who}" for job, (kind, who) in self._owners.items()}
