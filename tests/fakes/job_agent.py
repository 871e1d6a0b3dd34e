"""A fake node agent for controller job tests: builds the Reports a real agent would send
(ranks, job processes, job_exit / command_result events) and carries out the commands that
come back the way agents/jobs.py and the trainer library do (start_job, stop_job,
checkpoint, collect_stacks), with a shared checkpoint directory per job. Every command is
recorded, so tests assert the exact commands the controller sent at each step."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any

from trainguard.membership import Membership
from trainguard.model import GpuSample
from trainguard.protocol import (
    Command,
    Event,
    JobProcess,
    RankState,
    Report,
    ReportResponse,
    StandbyState,
)

_pids = itertools.count(1000)


@dataclass
class SharedCheckpoints:
    """The job's checkpoint directory (shared filesystem): committed steps by job."""

    committed: dict[str, int] = field(default_factory=dict)
    every_steps: int = 10
    # the newest step any rank of the job reached: what a rank that rejoins in process takes
    # from a healthy peer
    live: dict[str, int] = field(default_factory=dict)


@dataclass
class _Launch:
    attempt: int
    nproc: int
    pids: list[int]
    step: int
    state: str = "running"
    request_id: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    node_rank: int = 0
    world: int = 1
    # set by a rejoin / a standby assignment: the global rank of each local process
    ranks: list[int] | None = None
    # exited, its ranks' last state not reported yet (the agent keeps them for one report)
    last_words: bool = False

    def rank(self, i: int) -> int:
        return self.ranks[i] if self.ranks is not None else self.node_rank * self.nproc + i


class FakeJobAgent:
    def __init__(
        self,
        node: str,
        *,
        ckpts: SharedCheckpoints,
        role: str = "active",
        labels: dict[str, str] | None = None,
    ) -> None:
        self.node = node
        self.ckpts = ckpts
        self.role = role
        self.labels = labels or {"address": "127.0.0.1"}
        self.instance = f"{node}-inst"
        self.seq = 0
        self.event_id = 0
        self.silent = False
        self.hold = False  # launched ranks stay at their resume step (a slow start)
        # set: every launch dies before its first step with this output (e.g. the launch lock
        # on a full disk): start_job succeeds, then a job_exit with code 1 follows
        self.fail_start: str | None = None
        # a `preflight` answers with a preflight_result: these checks fail with their detail
        # (name -> detail); `preflight_answers` False: it never answers (a hung agent)
        self.preflight_fails: dict[str, str] = {}
        self.preflight_answers = True
        self._held_preflights: list[Command] = []  # unanswered while preflight_answers is False
        # a `repair` (GPU reset / reboot) fails with this message; else it clears preflight_fails
        # (as a reset clears a GPU's faults) unless `repair_fixes` is False
        self.repair_fails: str | None = None
        self.repair_fixes = True
        # this many `repair` commands are refused as while a job still runs on the node
        self.repair_busy = 0
        self.commands: list[Command] = []
        self._done: set[str] = set()
        self._events: list[Event] = []
        self.launches: dict[str, _Launch] = {}
        self.gpus: tuple[GpuSample, ...] = ()
        self.loss = 1.0
        # what collect_stacks dumps (the real agent: agent/stacks.py, data["stacks"])
        # the node's warm standby as the report says it (None: it keeps none); an
        # assign_standby takes it (then it is not ready), or fails with `assign_fails`
        self.standby: StandbyState | None = None
        self.assign_fails: str | None = None
        self.rejoin_fails: str | None = None
        self.stacks = (
            '--- rank 0 pid 1000 ---\nThread 0x00007f (most recent call first):\n  File "train.py"'
        )

    # --- what the agent sends -----------------------------------------------------------

    def event(self, kind: str, **kw: Any) -> None:
        self.event_id += 1
        self._events.append(Event(id=self.event_id, kind=kind, ts=0.0, **kw))

    def report(self, *, now: float) -> Report:
        self.seq += 1
        ranks: list[RankState] = []
        jobs: list[JobProcess] = []
        for job, launch in self.launches.items():
            jobs.append(
                JobProcess(job=job, attempt=launch.attempt, state=launch.state, pid=launch.pids[0])  # type: ignore[arg-type]
            )
            if launch.state != "running" and not launch.last_words:
                continue
            launch.last_words = False
            ckpt = self.ckpts.committed.get(job)
            for i, pid in enumerate(launch.pids):
                ranks.append(
                    RankState(
                        job=job,
                        rank=launch.rank(i),
                        world_size=launch.world,
                        epoch=launch.attempt,
                        local_rank=i,
                        step=launch.step,
                        pid=pid,
                        loss=self.loss,
                        step_time_s=0.5,
                        ckpt_step=ckpt,
                        ckpt_request_id=launch.request_id,
                    )
                )
        events = tuple(self._events)
        return Report(
            node=self.node,
            instance=self.instance,
            seq=self.seq,
            sent_at=now,
            role_hint=self.role,  # type: ignore[arg-type]
            labels=dict(self.labels),
            gpus=self.gpus,
            ranks=tuple(ranks),
            jobs=tuple(jobs),
            events=events,
            standby=self.standby,
        )

    def acked(self, response: ReportResponse) -> None:
        self._events = [e for e in self._events if e.id > response.ack_event_id]
        for cmd in response.commands:
            if cmd.id in self._done:
                continue
            self._done.add(cmd.id)
            self.commands.append(cmd)
            if cmd.kind == "preflight":
                if self.preflight_answers:
                    self._preflight(cmd)
                else:
                    self._held_preflights.append(cmd)
                continue
            if cmd.kind == "repair" and self.repair_busy > 0:
                self.repair_busy -= 1
                method = cmd.args.get("method")
                self.event(
                    "command_result",
                    data={
                        "command_id": cmd.id,
                        "ok": False,
                        "message": f"{method} refused: job(s) train still run on this node",
                        "method": method,
                        "jobs": ["train"],
                    },
                )
                continue
            ok, message = self._execute(cmd)
            data: dict[str, Any] = {"command_id": cmd.id, "ok": ok, "message": message}
            if cmd.kind == "collect_stacks":
                data.update(
                    stacks=self.stacks, log_path=f"/var/lib/trainguard/{cmd.args['job']}.log"
                )
            self.event("command_result", data=data)

    def answer_held_preflights(self) -> None:
        """Answer the preflights held while `preflight_answers` was False (a slow one ends)."""
        self.preflight_answers = True
        held, self._held_preflights = self._held_preflights, []
        for cmd in held:
            self._preflight(cmd)

    def _preflight(self, cmd: Command) -> None:
        checks = [
            {
                "name": name,
                "passed": name not in self.preflight_fails,
                "detail": self.preflight_fails.get(name, "ok"),
            }
            for name in cmd.args["checks"]
        ]
        passed = all(c["passed"] for c in checks)
        self.event(
            "preflight_result",
            data={"command_id": cmd.id, "passed": passed, "checks": checks, "duration_s": 3.0},
        )

    # --- the training loop, one call per simulated second -------------------------------

    def train(self) -> None:
        if self.hold:
            return
        for job, launch in self.launches.items():
            if launch.state != "running":
                continue
            launch.step += 1
            self.ckpts.live[job] = max(self.ckpts.live.get(job, 0), launch.step)
            if launch.step % self.ckpts.every_steps == 0:
                self.ckpts.committed[job] = max(self.ckpts.committed.get(job, 0), launch.step)

    def finish(self, job: str) -> None:
        """The job's ranks end their run: torchrun exits 0. The next report carries the ranks'
        last state with the exit, as the agent's does."""
        launch = self.launches[job]
        launch.state = "exited"
        launch.last_words = True
        self.event(
            "job_exit",
            job=job,
            code=0,
            message="exited with code 0",
            data={"attempt": launch.attempt, "stopped": False, "output_tail": ""},
        )

    def crash(self, job: str, *, code: int = 1) -> None:
        """A rank dies (kill -9): torchrun exits non-zero, not asked to."""
        launch = self.launches[job]
        launch.state = "exited"
        self.event(
            "job_exit",
            job=job,
            code=code,
            message=f"exited with code {code}",
            data={"attempt": launch.attempt, "stopped": False, "output_tail": "worker failed"},
        )

    # --- in-process recovery (agent/inprocess.py and the trainer's rejoin) --------------

    def _rejoin(self, a: dict[str, Any]) -> tuple[bool, str]:
        launch = self.launches.get(a["job"])
        if self.rejoin_fails is not None:
            return False, self.rejoin_fails
        if launch is None or launch.state != "running":
            return False, f"rank(s) of job {a['job']} not reachable on this node"
        new = {r["rank"]: Membership.from_json(r["membership"]) for r in a["ranks"]}
        current = [launch.rank(i) for i in range(launch.nproc)]
        if set(new) != set(current):
            return False, f"rank(s) {sorted(set(new) - set(current))} not reachable"
        launch.ranks = [new[r].rank for r in current]
        launch.world = next(iter(new.values())).world_size
        launch.attempt = a["epoch"]  # the launch is the new attempt's (retag)
        return True, f"rejoin to epoch {a['epoch']} sent"

    def _assign(self, a: dict[str, Any]) -> tuple[bool, str]:
        if self.assign_fails is not None:
            return False, self.assign_fails
        if self.standby is None or not self.standby.ready:
            return False, "the warm standby is not ready"
        m = Membership.from_json(a["membership"])
        self.standby = StandbyState(module=self.standby.module, ready=False)
        self.launches[a["job"]] = _Launch(
            attempt=a["epoch"],
            nproc=1,
            pids=[next(_pids)],
            step=self.ckpts.live.get(a["job"], self.ckpts.committed.get(a["job"], 0)),
            ranks=[m.rank],
            world=m.world_size,
        )
        return True, f"standby is rank {m.rank}"

    # --- commands -----------------------------------------------------------------------

    def _execute(self, cmd: Command) -> tuple[bool, str]:
        a = cmd.args
        if cmd.kind == "start_job":
            current = self.launches.get(a["job"])
            if current is not None and current.state == "running":
                if current.attempt == a["attempt"]:
                    return False, f"attempt {a['attempt']} is already running"
                return False, f"job {a['job']} attempt {current.attempt} is already running"
            resume = self.ckpts.committed.get(a["job"], 0)
            self.launches[a["job"]] = _Launch(
                attempt=a["attempt"],
                nproc=a["nproc_per_node"],
                pids=[next(_pids) for _ in range(a["nproc_per_node"])],
                step=resume,
                env=dict(a.get("env", {})),
                node_rank=a.get("node_rank", 0),
                world=a["nnodes"] * a["nproc_per_node"],
            )
            if self.fail_start is not None:
                self.launches[a["job"]].state = "exited"
                self.event(
                    "job_exit",
                    job=a["job"],
                    code=1,
                    message="exited with code 1",
                    data={
                        "attempt": a["attempt"],
                        "stopped": False,
                        "output_tail": self.fail_start,
                    },
                )
            return True, "started"
        if cmd.kind == "stop_job":
            launch = self.launches.get(a["job"])
            if launch is None or launch.state != "running":
                return True, "not running"
            launch.state = "exited"
            self.event(
                "job_exit",
                job=a["job"],
                code=-15,
                message="killed by SIGTERM",
                data={"attempt": launch.attempt, "stopped": True},
            )
            return True, "stopped"
        if cmd.kind == "checkpoint":
            launch = self.launches.get(a["job"])
            if launch is None or launch.state != "running":
                return False, "no ranks"
            self.ckpts.committed[a["job"]] = launch.step
            launch.request_id = a["request_id"]
            return True, f"sent to {launch.nproc} ranks"
        if cmd.kind == "collect_stacks":
            return True, "stacks of 1 of 1 rank(s)"
        if cmd.kind == "rejoin":
            return self._rejoin(a)
        if cmd.kind == "assign_standby":
            return self._assign(a)
        if cmd.kind == "set_checkpoint_interval":
            launch = self.launches.get(a["job"])
            if launch is None or launch.state != "running":
                return False, "no ranks"
            return True, f"sent to {launch.nproc} ranks"
        if cmd.kind == "repair":
            if self.repair_fails is not None:
                return False, self.repair_fails
            if self.repair_fixes:
                self.preflight_fails = {}
                self.gpus = tuple(
                    dataclasses.replace(g, ecc_uncorrected_volatile_total=0) for g in self.gpus
                )
            if a.get("method") == "reboot":
                return True, "reboot started"
            return True, f"reset GPU {','.join(map(str, a.get('gpus') or [0]))}"
        return False, f"unknown command {cmd.kind}"
