"""The agent's hand in an in-process recovery (docs/agent.md, "In-process recovery"): `rejoin`
relays each surviving local rank its place in the re-formed world (a Control(rejoin) to that
rank's control socket) and makes the node's launch the new attempt's; `assign_standby` hands
the spare's ready warm standby its membership and the job's environment, and tracks it as the
job's rank on this node (agent.standby_ranks)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from trainguard.agent.commands import CommandError, CommandResult, Handler
from trainguard.agent.jobpolicy import JobPolicy, JobRefused
from trainguard.agent.standby import StandbyPool
from trainguard.agent.standby_ranks import StandbyRanks
from trainguard.command_args import AssignStandbyArgs, RejoinArgs, decode_args
from trainguard.membership import Membership
from trainguard.protocol import Command, CommandKind, Control

__all__ = ["RankSender", "StandbyEnv", "inprocess_handlers"]


class RankSender(Protocol):
    def send_control_to(self, job: str, rank: int, control: Control) -> bool: ...


class Retagger(Protocol):
    def retag(self, job: str, *, attempt: int) -> bool: ...


@dataclass(frozen=True)
class StandbyEnv:
    """What the agent sets for a rank it starts, as for a launch (agent.jobs.build_env)."""

    node: str
    heartbeat_socket: str
    control_dir: str | None


def standby_env(
    args: AssignStandbyArgs, membership: Membership, *, where: StandbyEnv
) -> dict[str, str]:
    env = dict(args.env)
    env.update(
        TRAINGUARD_JOB=args.job,
        TRAINGUARD_ATTEMPT=str(args.epoch),
        TRAINGUARD_NODE=where.node,
        TRAINGUARD_AGENT_SOCKET=where.heartbeat_socket,
        # what torchrun would set for this rank (the standby runs one, as local rank 0)
        RANK=str(membership.rank),
        WORLD_SIZE=str(membership.world_size),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    if where.control_dir is not None:
        env["TRAINGUARD_CONTROL_DIR"] = where.control_dir
    if args.ckpt_dir is not None:
        env["TRAINGUARD_CKPT_DIR"] = args.ckpt_dir
    return env


def inprocess_handlers(
    *,
    sender: RankSender,
    launches: Retagger,
    ranks: StandbyRanks,
    pool: Callable[[], StandbyPool | None],
    policy: JobPolicy,
    where: StandbyEnv,
) -> dict[str, Handler]:
    """`rejoin` and `assign_standby` for `CommandExecutor.register` (agent.commands)."""

    def rejoin(cmd: Command) -> CommandResult:
        args = decode_args(RejoinArgs, cmd.args)
        # first the attempt: the controller's fencing names the new one from now on, and
        # must not stop the launch whose ranks are rejoining
        launches.retag(args.job, attempt=args.epoch)
        ranks.retag(args.job, attempt=args.epoch)
        sent: list[int] = []
        missing: list[int] = []
        for rank, membership in sorted(args.memberships().items()):
            control = Control(
                action="rejoin",
                request_id=cmd.id,
                job=args.job,
                membership=membership.to_json(),
            )
            (sent if sender.send_control_to(args.job, rank, control) else missing).append(rank)
        data = {"job": args.job, "epoch": args.epoch, "ranks_sent": sent, "ranks_missing": missing}
        if missing:
            return CommandResult(
                ok=False,
                message=f"rank(s) {missing} of job {args.job} not reachable on this node",
                data=data,
            )
        return CommandResult(
            ok=True, message=f"rejoin to epoch {args.epoch} sent to rank(s) {sent}", data=data
        )

    def assign_standby(cmd: Command) -> CommandResult:
        args = decode_args(AssignStandbyArgs, cmd.args)
        standby = pool()
        if standby is None:
            raise CommandError("no warm standby on this node (standby.enabled is false)")
        module = standby.config.module
        if module != args.module:
            raise CommandError(f"the standby runs module {module!r}, the job's is {args.module!r}")
        if ranks.running(args.job):
            raise CommandError(f"a standby already runs job {args.job} on this node")
        try:
            policy.check(
                env=args.env,
                nproc_per_node=1,
                python=standby.config.python or None,
                program="-m",
                cwd=standby.config.cwd or None,
                module=module,
            )
        except JobRefused as e:
            raise CommandError(f"job {args.job!r} refused: {e}") from None
        membership = Membership.from_json(args.membership)
        line = json.dumps(
            {
                "membership": json.loads(membership.to_json()),
                "env": standby_env(args, membership, where=where),
            }
        )
        child = standby.take(line)
        if child is None:
            raise CommandError("the warm standby is not ready")
        ranks.add(job=args.job, attempt=args.epoch, child=child)
        return CommandResult(
            ok=True,
            message=f"standby pid {child.pid} is rank {membership.rank} of job {args.job}"
            f" (epoch {args.epoch})",
            data={"job": args.job, "epoch": args.epoch, "pid": child.pid},
        )

    return {CommandKind.REJOIN: rejoin, CommandKind.ASSIGN_STANDBY: assign_standby}
