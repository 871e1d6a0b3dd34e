"""A fake Slurm for the Slurm backend's unit tests: a SlurmRunner that keeps node states,
jobs and the spare reservation, answers `sinfo --json`, `squeue --json` and
`scontrol show reservation` in Slurm 22.05's shapes, applies the scontrol / scancel calls
the backend makes, records every argv, and fails a call on request with the message real
Slurm prints (`fail_next`)."""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from trainguard.controller.backends.slurm.cli import SlurmError


@dataclass
class FakeNode:
    state: str = "idle"
    flags: set[str] = field(default_factory=set)
    reason: str = ""
    reason_user: str = ""


@dataclass
class FakeJob:
    id: str
    name: str
    nodes: list[str]
    state: str = "RUNNING"
    restart_cnt: int = 0
    held: bool = False
    required: list[str] = field(default_factory=list)
    comment: str = ""


class FakeSlurm:
    def __init__(self, nodes: Sequence[str], *, spares: Sequence[str] = ()) -> None:
        self.nodes = {n: FakeNode() for n in nodes}
        self.jobs: dict[str, FakeJob] = {}
        self.reservation: list[str] | None = list(spares) if spares else None
        self.reservation_fields: dict[str, str] = {}  # those of the last `create reservation`
        self.calls: list[tuple[str, ...]] = []
        self.failures: list[tuple[str, SlurmError]] = []  # (argv prefix text, error)
        self._lock = threading.Lock()

    def fail_next(self, prefix: str, message: str, *, transient: bool = False) -> None:
        """The next call whose argv starts with `prefix` fails with Slurm's `message`."""
        self.failures.append((prefix, SlurmError(message, transient=transient)))

    def submit(self, job_id: str, nodes: Sequence[str], *, name: str = "train") -> FakeJob:
        job = FakeJob(job_id, name, list(nodes))
        self.jobs[job_id] = job
        for n in nodes:
            self.nodes[n].state = "allocated"
        return job

    def admin(self, node: str, *, state: str, reason: str, user: str = "admin") -> None:
        """Someone else (an admin, NHC) drains or downs a node."""
        n = self.nodes[node]
        if state == "down":
            n.state = "down"
        else:
            n.flags.add("DRAIN")
        n.reason, n.reason_user = reason, user

    # --- SlurmRunner ----------------------------------------------------------------------

    def run(self, argv: Sequence[str]) -> str:
        call = tuple(argv)
        with self._lock:
            self.calls.append(call)
            text = " ".join(call)
            for i, (prefix, error) in enumerate(self.failures):
                if text.startswith(prefix):
                    del self.failures[i]
                    raise error
            return self._answer(call)

    def _answer(self, call: tuple[str, ...]) -> str:
        cmd, *args = call
        if cmd == "sinfo":
            return json.dumps({"errors": [], "nodes": [self._node(n) for n in self.nodes]})
        if cmd == "squeue":
            return json.dumps({"errors": [], "jobs": [self._job(j) for j in self.jobs.values()]})
        if cmd == "scancel":
            self._end(self.jobs[args[0]], "CANCELLED")
            return ""
        assert cmd == "scontrol", call
        if args[:2] == ["show", "reservation"]:
            if self.reservation is None:
                raise SlurmError(
                    f"scontrol show reservation: Reservation {args[2]} not found", transient=False
                )
            return f"ReservationName={args[2]} Nodes={','.join(self.reservation)} NodeCnt=1\n"
        if args[0] == "update" and args[1].startswith("nodename="):
            return self._update_node(
                args[1].split("=", 1)[1], dict(a.split("=", 1) for a in args[2:])
            )
        if args[0] == "update" and args[1].startswith("reservationname="):
            self.reservation = args[2].split("=", 1)[1].split(",")
            return ""
        if args[0] == "delete":
            self.reservation = None
            return ""
        if args[:2] == ["create", "reservation"]:
            fields = dict(a.split("=", 1) for a in args[2:])
            assert self.reservation is None, "scontrol create: Reservation exists"
            self.reservation = fields["nodes"].split(",")
            self.reservation_fields = fields
            return ""
        if args[0] in ("requeuehold", "hold", "release"):
            job = self._known(args[1])
            if args[0] == "requeuehold":
                self._end(job, "PENDING")
                job.restart_cnt += 1
            job.held = args[0] != "release"
            return ""
        if args[0] == "update" and args[1].startswith("jobid="):
            job = self._known(args[1].split("=", 1)[1])
            key, value = args[2].split("=", 1)
            if key == "nodelist":
                job.required = value.split(",")
            if key == "starttime" and not job.held and job.state == "PENDING":
                self._start(job)
            if key == "comment":
                job.comment = value
            return ""
        raise AssertionError(f"the fake does not know {call}")

    def _known(self, job_id: str) -> FakeJob:
        if job_id not in self.jobs:
            raise SlurmError(
                f"scontrol: Invalid job id specified for job {job_id}", transient=False
            )
        return self.jobs[job_id]

    def _update_node(self, name: str, fields: dict[str, str]) -> str:
        if name not in self.nodes:
            raise SlurmError(
                "scontrol update: slurm_update error: Invalid node name specified", transient=False
            )
        n = self.nodes[name]
        state = fields.get("state")
        if state == "drain":
            n.flags.add("DRAIN")
        elif state == "down":
            n.state = "down"
        elif state == "resume":
            n.flags.discard("DRAIN")
            if n.state == "down":
                n.state = "idle"
        n.reason = fields.get("reason", "") if state != "resume" else ""
        n.reason_user = "root" if n.reason else ""
        return ""

    def _end(self, job: FakeJob, state: str) -> None:
        for name in job.nodes:
            if self.nodes[name].state == "allocated":
                self.nodes[name].state = "idle"
        job.state = state
        if state == "PENDING":
            job.nodes = []

    def _start(self, job: FakeJob) -> None:
        job.nodes = list(job.required)
        job.state = "RUNNING"
        for name in job.nodes:
            self.nodes[name].state = "allocated"

    def _node(self, name: str) -> dict[str, object]:
        n = self.nodes[name]
        return {
            "name": name,
            "state": n.state,
            "state_flags": sorted(n.flags),
            "reason": n.reason,
            "reason_set_by_user": n.reason_user or None,
        }

    def _job(self, j: FakeJob) -> dict[str, object]:
        return {
            "job_id": int(j.id),
            "name": j.name,
            "job_state": j.state,
            "nodes": ",".join(j.nodes),
            "restart_cnt": j.restart_cnt,
            "requeue": True,
            "state_reason": "JobHeldAdmin" if j.held else "None",
            "required_nodes": ",".join(j.required),
            "node_count": 3,
            "start_time": 0,
            "user_name": "alice",
            "comment": j.comment,
        }
