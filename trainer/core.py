"""`Trainguard`: the one object a training loop calls once per step, a facade over the parts.

The parts, each usable alone: `CheckpointManager` (checkpoint_manager.py: capture, write,
verify, load, fence), `StepAgreement` (agreement.py: the step every rank acts at),
`SignalGuard` (signals.py: SIGTERM and its grace, SIGUSR1), `Telemetry` and `ComputeTimer`
(telemetry.py, compute_timer.py: the heartbeat and the compute time it carries), `NanGuard`
(nan_guard.py: non-finite state and its policy). `step()` runs them in order and decides
what the loop does. Step convention: the checkpoint "of step k" is taken after step k
completed (optimizer and scheduler stepped), so it is exactly the state needed to run step
k+1; `resume()` returns k+1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from trainguard.ckpt_env import INTERVAL_ENV, CheckpointInterval, parse_interval
from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.decode import Invalid
from trainguard.kinds import TrainerEdge
from trainguard.protocol import HeartbeatPhase
from trainguard.trainer.agreement import AgreementSettings, StepAgreement
from trainguard.trainer.channel import (
    AgentChannel,
    agent_socket_path,
    control_socket_path,
    job_name,
)
from trainguard.trainer.chaos import chaos_hooks, for_attempt, parse_chaos
from trainguard.trainer.checkpoint import SaveResult
from trainguard.trainer.checkpoint_manager import (
    CheckpointManager,
    CheckpointMismatch,
    CheckpointSettings,
    Stateful,
    TrainState,
)
from trainguard.trainer.compute_timer import ComputeTimer
from trainguard.trainer.fence import LaunchLocked, StaleAttempt, epoch_from_env
from trainguard.trainer.hooks import StepHook
from trainguard.trainer.launch import LaunchMismatch, check_launch
from trainguard.trainer.manifest import Manifest
from trainguard.trainer.membership_inbox import MembershipInbox
from trainguard.trainer.nan_guard import NanGuard, NanPolicy, NanSettings
from trainguard.trainer.peer_state import agree_source, replica_state_ok, transfer_state
from trainguard.trainer.rejoin import (
    Membership,
    PeerLossGuard,
    PeerLost,
    RejoinFailed,
    join_world,
    leave_world,
)
from trainguard.trainer.replica import ReplicaConfig, replica_from_env
from trainguard.trainer.retention import RetentionPolicy, retention_from_env
from trainguard.trainer.s3 import S3Config
from trainguard.trainer.sampler import ResumableSampler
from trainguard.trainer.signals import SignalGuard, SignalSettings
from trainguard.trainer.sync import Agreement, Coordinator, DistCoordinator, LocalCoordinator
from trainguard.trainer.telemetry import Telemetry

__all__ = [
    "CheckpointMismatch",
    "LaunchMismatch",
    "NanPolicy",
    "PeerLost",
    "RejoinFailed",
    "StaleAttempt",
    "Stateful",
    "StepAction",
    "Trainguard",
]

log = logging.getLogger("trainguard.trainer")

_CHECKPOINT_ACTIONS = ("checkpoint", "checkpoint_stop")


@dataclass(frozen=True)
class StepAction:
    """What the loop must do after `Trainguard.step()`.

    stop: leave the loop now (a checkpoint the stop asked for has already committed or
          failed and been reported); then call `close()`.
    rollback: the state was restored from checkpoint `next_step - 1`; continue at `next_step`
          and rebuild the data iterator (the sampler position moved).
    """

    stop: bool = False
    # "stop", "checkpoint_stop", "sigterm", "nan", "nan_no_checkpoint", "stale_attempt"
    reason: str | None = None
    rollback: bool = False
    next_step: int | None = None
    checkpoint_started: bool = False
    request_id: str | None = None


CONTINUE = StepAction()


class Trainguard:
    """Wraps a job's training state; see docs/trainer.md for the full contract.

    In a distributed job every rank must construct it at the same point (it creates two
    small gloo process groups) and call `step()` for the same step numbers.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        scaler: Stateful | None = None,
        sampler: Stateful | None = None,
        extra: Mapping[str, Stateful] | None = None,
        ckpt_dir: str | os.PathLike[str],
        checkpoint_every: int | Literal["auto"] = 0,
        keep_last: int = 3,
        retention: RetentionPolicy | None = None,
        s3: S3Config | None = None,
        replica: ReplicaConfig | None = None,
        nan_policy: NanPolicy = "continue",
        skip_batches: int = 0,
        grad_spike_factor: float | None = None,
        grad_spike_window: int = 50,
        sync_every: int | None = None,
        handle_sigterm: bool = True,
        sigterm_grace_s: float = 30.0,
        sigterm_hard_exit: bool = True,
        checkpoint_timeout_s: float = 600.0,
        dump_stacks_on_sigusr1: bool = True,
        job: str | None = None,
        epoch: int | None = None,
        launch_lock_timeout_s: float = 60.0,
        collective_timeout_s: float | None = None,
        full_every: int = 0,
        chaos: str | None = None,
        single_process: bool = False,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        # The settings of each part; each validates its own (ValueError naming the argument).
        interval = checkpoint_interval(checkpoint_every)
        self.interval_auto = interval.auto  # the controller sets the interval (set_interval)
        ckpt_settings = CheckpointSettings(
            ckpt_dir=Path(ckpt_dir),
            checkpoint_every=interval.every_steps,
            keep_last=keep_last,
            retention=retention if retention is not None else retention_from_env(),
            s3=s3,
            replica=replica if replica is not None else replica_from_env(),
            checkpoint_timeout_s=checkpoint_timeout_s,
            epoch=epoch if epoch is not None else epoch_from_env(),
            launch_lock_timeout_s=launch_lock_timeout_s,
            full_every=full_every,
        )
        nan_settings = NanSettings(
            nan_policy=nan_policy,
            skip_batches=skip_batches,
            grad_spike_factor=grad_spike_factor,
            grad_spike_window=grad_spike_window,
        )
        sync_settings = AgreementSettings(sync_every=sync_every)
        signal_settings = SignalSettings(
            handle_sigterm=handle_sigterm,
            sigterm_grace_s=sigterm_grace_s,
            sigterm_hard_exit=sigterm_hard_exit,
            dump_stacks_on_sigusr1=dump_stacks_on_sigusr1,
        )
        self.clock = clock
        # Parsed before anything starts, so a bad spec fails alone (ChaosSpecError).
        chaos_rules = for_attempt(
            parse_chaos(chaos if chaos is not None else os.environ.get("TRAINGUARD_CHAOS", "")),
            os.environ.get("TRAINGUARD_ATTEMPT"),
        )
        distributed = dist.is_available() and dist.is_initialized()
        check_launch(initialized=distributed, single_process=single_process)
        self._collective_timeout_s = collective_timeout_s
        self.coord: Coordinator = (
            DistCoordinator(timeout_s=collective_timeout_s) if distributed else LocalCoordinator()
        )
        self.rank = self.coord.rank
        self.world_size = self.coord.world_size
        self.job = job or job_name()
        self.state = TrainState(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            sampler=sampler,
            extra=dict(extra or {}),
        )
        # Empty unless chaos is configured: the step path then makes no hook calls at all.
        self._hooks: tuple[StepHook, ...] = chaos_hooks(
            rules=chaos_rules, rank=self.rank, job=self.job, model=model, clock=clock
        )
        pid = os.getpid()
        self.channel = open_channel(job=self.job, rank=self.rank, pid=pid)
        try:
            self.checkpoints = CheckpointManager(
                state=self.state,
                settings=ckpt_settings,
                coordinator=self.coord,
                job=self.job,
                hooks=self._hooks,
                on_result=self._on_save_result,
                clock=clock,
            )
        except (StaleAttempt, LaunchLocked):
            self.channel.close()
            raise
        self.telemetry = Telemetry(
            channel=self.channel,
            job=self.job,
            rank=self.rank,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=self.world_size,
            pid=pid,
            checkpoint_every=ckpt_settings.checkpoint_every,
            replicator=self.checkpoints.replicator,
            epoch=self.checkpoints.epoch,
            clock=clock,
        )
        self.agreement = StepAgreement(
            coordinator=self.coord, settings=sync_settings, job=self.job, clock=clock
        )
        self.inbox = MembershipInbox(job=self.job, rank=lambda: self.rank, epoch=lambda: self.epoch)
        self.nan = NanGuard(
            settings=nan_settings,
            job=self.job,
            rank=self.rank,
            emit=self.telemetry.event,
            clock=clock,
        )
        self.compute_timer = ComputeTimer(model=model, hooks=self._hooks, clock=clock)
        self.signals = SignalGuard(
            settings=signal_settings,
            job=self.job,
            rank=self.rank,
            latest_step=lambda: self.telemetry.ckpt_step,
            on_sigterm=self.agreement.note_sigterm,
            clock=clock,
        )
        self._last_mono: float | None = None
        self._last_step = 0
        # The step the state is complete at (its step() entered; resume()'s checkpoint): what
        # a re-formed world continues from (rejoin).
        self._completed_step: int | None = None
        self._closed = False
        self.signals.install()
        log.info(
            "event=trainer_start job=%s rank=%d world_size=%d ckpt_dir=%s control_socket=%s "
            "epoch=%s chaos=%s checkpoint_every=%d%s",
            self.job,
            self.rank,
            self.world_size,
            self.ckpt_dir,
            self.channel.control_socket or "-",
            "-" if self.epoch is None else self.epoch,
            ",".join(r.kind for r in chaos_rules) or "-",
            interval.every_steps,
            " (auto)" if interval.auto else "",
        )
        self.telemetry.send(step=0, phase="init")

    # --- what the parts hold, under the names the library has always used -------------------

    @property
    def ckpt_dir(self) -> Path:
        return self.checkpoints.ckpt_dir

    @property
    def epoch(self) -> int | None:
        """This launch's attempt epoch (None: no fencing)."""
        return self.checkpoints.epoch

    @property
    def ckpt_step(self) -> int | None:
        """The newest checkpoint committed (or resumed from) as this rank knows it."""
        return self.telemetry.ckpt_step

    @property
    def ckpt_request_id(self) -> str | None:
        return self.telemetry.ckpt_request_id

    @property
    def checkpoint_every(self) -> int:
        """The periodic checkpoint interval in force, steps (0: none); with `auto` it changes
        when the controller sets it."""
        return self.checkpoints.settings.checkpoint_every

    # --- public API -----------------------------------------------------------------------

    def resume(self, *, first_step: int = 0) -> int:
        """Load the newest good checkpoint (verified; S3 if none locally) and return the step
        to run next: checkpoint step + 1, or `first_step` when there is none."""
        self.agreement.drain()
        self.checkpoints.wait()
        found = self.checkpoints.restore_latest()
        self._report_fallback(found)
        if found is None:
            log.info("event=resume_fresh job=%s rank=%d", self.job, self.rank)
            self._completed_step = first_step - 1
            return first_step
        step, manifest = found
        self._completed_step = step
        # the rank stands at the checkpoint's step until it trains further: a run that
        # resumes at its end and exits reports that step, not 0
        self._last_step = step
        self.telemetry.checkpoint_loaded(step=step, request_id=manifest.request_id)
        source = self.checkpoints.restore_source
        if source is not None and source != "local":
            self.telemetry.checkpoint_restored(step=step, source=source)
        log.info(
            "event=resumed job=%s rank=%d step=%d next_step=%d", self.job, self.rank, step, step + 1
        )
        return step + 1

    def step(
        self,
        step: int,
        *,
        loss: float | torch.Tensor | None = None,
        grad_norm: float | torch.Tensor | None = None,
        samples: int | None = None,
        tokens: int | None = None,
    ) -> StepAction:
        """Call once after step `step` completed (optimizer and scheduler stepped)."""
        if self._closed:
            raise RuntimeError("Trainguard.step() after close()")
        self._completed_step = step
        now = self.clock.monotonic()
        step_time_s = None if self._last_mono is None else now - self._last_mono
        forced_loss = None
        for hook in self._hooks:
            forced = hook.before_step(
                step=step, step_time_s=step_time_s, compute_used=self.compute_timer.used
            )
            if forced is not None:
                forced_loss = forced
        compute_time_s = self.compute_timer.take()
        loss_v = as_float(loss)
        grad_v = as_float(grad_norm)
        if forced_loss is not None:
            loss_v = forced_loss
        if self.nan.check(step, loss=loss_v, grad_norm=grad_v):
            self.agreement.note_nonfinite()
        sampler = self.state.sampler
        if sampler is not None and hasattr(sampler, "mark_step"):
            sampler.mark_step()
        self.agreement.receive(self.inbox.sort(self.channel.poll()))
        self.checkpoints.collect()

        action = CONTINUE
        agreement = self.agreement.at_step(
            step, step_time_s=step_time_s, periodic=self.checkpoints.is_periodic(step)
        )
        if agreement is not None:
            action = self._act(step, agreement)
            if not action.stop:
                self.agreement.post(agreement.interval)
        phase: HeartbeatPhase = "stopping" if action.stop else "train"
        self.telemetry.send(
            step=step,
            phase=phase,
            loss=loss_v,
            grad_norm=grad_v,
            step_time_s=step_time_s,
            compute_time_s=compute_time_s,
            samples=samples,
            tokens=tokens,
        )
        self._last_mono = self.clock.monotonic()
        self._last_step = step
        if not self.checkpoints.snapshot_prepared:
            self.checkpoints.prepare_snapshot(step)
        return action

    def compute(self) -> contextlib.AbstractContextManager[None]:
        """Wrap this rank's own work of a step: forward and backward, but not the waits in
        collectives (the gradient all-reduce). Blocks of one step add up (e.g. gradient
        accumulation). The sum is sent as `compute_time_s` with the next `step()`: in a
        synchronous job every rank's step time equals the slowest rank's, so only this time
        tells which rank is the straggler. On CUDA it is measured with CUDA events (no
        synchronisation; a step whose kernels are still running is reported when they are
        done). With DistributedDataParallel the backward pass contains the gradient
        all-reduce: wrap the forward pass and the loss only."""
        return self.compute_timer.measure(step=self._last_step + 1)

    # --- in-process rejoin (docs/trainer.md, "In-process rejoin") ---------------------------

    def peer_loss_guard(self) -> PeerLossGuard:
        """`with tg.peer_loss_guard():` around a step (forward, backward, optimizer, `step()`):
        a collective broken by a lost peer raises `PeerLost` carrying the last step this rank
        completed; the loop then waits for its membership and calls `rejoin()`."""
        return PeerLossGuard(lambda: self._completed_step)

    def wait_membership(self, *, timeout_s: float) -> Membership:
        """This rank's place in the re-formed world: the `rejoin` Control the agent relays to
        its control socket (one that came before the loss was seen is kept; one not newer than
        this rank's epoch is ignored). Requests of other actions read meanwhile stay pending
        for the new world. `RejoinFailed` after `timeout_s`."""
        return self.inbox.wait(
            self.channel, timeout_s=timeout_s, others=self.agreement.receive, clock=self.clock
        )

    def rejoin(self, membership: Membership) -> int:
        """A healthy rank of a broken world joins the next one, in this process: leave every
        process group, initialise the new world, re-create the library's groups, adopt the
        next attempt epoch (rank 0 raises the directory's: older ranks can never commit), and
        agree with the replacements on the newest state, which the ranks without it receive
        from a peer. With NCCL the old communicators are aborted first (bounded by the
        membership's timeout). Returns the step to run next. The training process group is
        new: wrap the model again (DistributedDataParallel) after it. Raises `RejoinFailed`
        when the fast path cannot work (fall back to a full restart)."""
        if self.epoch is not None and membership.epoch <= self.epoch:
            raise ValueError(
                f"rejoin: the membership's epoch {membership.epoch} must be newer than this "
                f"rank's {self.epoch}"
            )
        if isinstance(self.coord, DistCoordinator):
            self.coord.abandon()
        # The old world's save (if any) ends with a failure as soon as its collectives see
        # the lost peer; it must end before its groups are destroyed.
        if not self.checkpoints.wait(membership.timeout_s):
            raise RejoinFailed("a checkpoint save of the old world is still running")
        self.checkpoints.close(0.0)
        self.coord.close()  # the library's groups of the old world, released as at close()
        leave_world(abort_timeout_s=membership.timeout_s)
        join_world(membership)
        self._bind(membership)
        log.info(
            "event=rejoined job=%s rank=%d world_size=%d epoch=%d last_step=%s",
            self.job,
            self.rank,
            self.world_size,
            membership.epoch,
            self._completed_step,
        )
        return self._state_from_peer()

    def join_from_peer(self) -> int:
        """A replacement rank (a fresh process built like any rank, after `join_world`): take
        the newest state from a healthy peer; with no peer, the world loads the checkpoint.
        Returns the step to run next. Every rank of the new world calls this or `rejoin()`."""
        self._completed_step = None
        return self._state_from_peer()

    def _bind(self, membership: Membership) -> None:
        """Rebuild the parts that hold the old world: coordinator, checkpoint manager (it
        fences the directory with the new epoch), agreement, the rank in telemetry."""
        coord = DistCoordinator(timeout_s=membership.timeout_s)
        self.coord = coord
        self.rank, self.world_size = coord.rank, coord.world_size
        settings = dataclasses.replace(self.checkpoints.settings, epoch=membership.epoch)
        self.checkpoints = CheckpointManager(
            state=self.state,
            settings=settings,
            coordinator=coord,
            job=self.job,
            hooks=self._hooks,
            on_result=self._on_save_result,
            clock=self.clock,
        )
        self.agreement.rebind(coord)
        self.telemetry.replicator = self.checkpoints.replicator  # the old one closed with it
        self.telemetry.rank = self.nan.rank = self.signals.rank = self.rank
        self.telemetry.world_size = self.world_size
        self.telemetry.epoch = membership.epoch
        if isinstance(self.state.sampler, ResumableSampler):
            self.state.sampler.set_world(rank=self.rank, world_size=self.world_size)
        self._last_mono = None  # the recovery is no step time (stragglers, agreement schedule)

    def _state_from_peer(self) -> int:
        coord = self.coord
        if not isinstance(coord, DistCoordinator):
            raise RejoinFailed("state from a peer needs a process group")
        offered = self._completed_step if replica_state_ok(self.state) else None
        source = agree_source(coord, step=offered)
        if not source.found:
            log.warning(
                "event=state_from_checkpoint job=%s rank=%d reason=no_peer_holds_state",
                self.job,
                self.rank,
            )
            return self.resume()
        t0 = self.clock.monotonic()
        moved = transfer_state(
            self.state,
            coord=coord,
            source=source,
            load=offered != source.step,
            ckpt_dir=self.ckpt_dir,
        )
        self._completed_step = source.step
        log.info(
            "event=state_from_peer job=%s rank=%d source=%d step=%d bytes=%d duration_s=%.3f",
            self.job,
            self.rank,
            source.rank,
            source.step,
            moved,
            self.clock.monotonic() - t0,
        )
        return source.step + 1

    def mark_milestone(self, name: str) -> None:
        """Name the next checkpoint a milestone (e.g. "best-val"), kept by retention forever
        (the newest of each name); call `save()` after it to checkpoint now."""
        self.checkpoints.mark_milestone(name)

    def save(self, step: int, *, wait: bool = False) -> bool:
        """Checkpoint the state after `step` now (every rank must call it at the same step).
        Returns False when it was not started (state not finite, writer busy past timeout, or
        this attempt is stale)."""
        if self.checkpoints.stale:
            return False
        started = self.checkpoints.save(step)
        if started and wait:
            self.checkpoints.wait()
            self.checkpoints.collect()
        return started

    def close(self) -> None:
        """Wait for the in-flight save (bounded), report, remove the control socket."""
        if self._closed:
            return
        self._closed = True
        self.agreement.drain()
        self.checkpoints.close(self.signals.left_s() if self.signals.received else None)
        if not self.checkpoints.writer.busy():  # an abandoned save still uses its group
            self.coord.close()
        self.telemetry.event(TrainerEdge.EXIT, {})
        self.telemetry.send(step=self._last_step, phase="exit")
        self.channel.close()
        self.signals.restore()

    def __enter__(self) -> Trainguard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- acting on an agreement -----------------------------------------------------------

    def _on_save_result(self, result: SaveResult) -> None:
        self.telemetry.report(result)
        if result.stale:
            self.agreement.note_stale()

    def _act(self, step: int, ag: Agreement) -> StepAction:
        request_id = ag.request_id
        if request_id is not None:
            self.agreement.done(request_id)
        if ag.stale:
            # A newer attempt owns the directory: nothing this one computes can be kept.
            self.telemetry.event(TrainerEdge.STOP, {"step": step, "reason": "stale_attempt"})
            log.error(
                "event=stop job=%s rank=%d step=%d reason=stale_attempt epoch=%s",
                self.job,
                self.rank,
                step,
                self.epoch,
            )
            return StepAction(stop=True, reason="stale_attempt", request_id=request_id)
        nan_action = self.nan.action(nonfinite=ag.nonfinite)
        if nan_action == "rollback":
            if ag.action is not None and request_id is not None:
                # Every rank learnt the request from the agreement: act on it at the next
                # agreement, from the restored (finite) state.
                self.agreement.retry_first(ag.action, request_id, value=ag.value)
            return self._rollback(step)
        if nan_action == "stop":
            if ag.action in _CHECKPOINT_ACTIONS:
                self.telemetry.checkpoint_skipped(step=step, request_id=request_id)
            self.telemetry.event(TrainerEdge.STOP, {"step": step, "reason": "nan"})
            log.error("event=stop job=%s rank=%d step=%d reason=nan", self.job, self.rank, step)
            return StepAction(stop=True, reason="nan")
        ckpt_rid = request_id if ag.action in _CHECKPOINT_ACTIONS else None
        started = False
        if self.checkpoints.is_periodic(step) or ag.action in _CHECKPOINT_ACTIONS or ag.sigterm:
            if ag.nonfinite:
                log.warning(
                    "event=checkpoint_skipped job=%s rank=%d step=%d reason=nonfinite_state",
                    self.job,
                    self.rank,
                    step,
                )
                if ckpt_rid is not None or ag.sigterm:
                    self.telemetry.checkpoint_skipped(step=step, request_id=ckpt_rid)
            else:
                deadline = self.signals.deadline() if ag.sigterm else None
                started = self.checkpoints.save(step, request_id=ckpt_rid, deadline=deadline)
        if ag.action == "set_interval" and request_id is not None:
            # after this step's own periodic check, so every rank switches from step + 1
            self._set_interval(step, every_steps=ag.value, request_id=request_id)
        stop_reason: str | None = None
        if ag.sigterm:
            stop_reason = "sigterm"
        elif ag.action in ("stop", "checkpoint_stop"):
            stop_reason = ag.action
        if stop_reason is None:
            return StepAction(checkpoint_started=started, request_id=ckpt_rid)
        if started:
            if not self.checkpoints.wait(self.signals.left_s() if ag.sigterm else None):
                log.error(
                    "event=checkpoint_abandoned job=%s rank=%d step=%d reason=grace_expired",
                    self.job,
                    self.rank,
                    step,
                )
            self.checkpoints.collect()
        self.telemetry.stopping(step=step, reason=stop_reason, request_id=request_id)
        return StepAction(
            stop=True, reason=stop_reason, checkpoint_started=started, request_id=request_id
        )

    def _report_fallback(self, found: tuple[int, Manifest] | None) -> None:
        """Newer checkpoints were passed over (rank 0 verified them; it logged why): say so."""
        skipped = self.checkpoints.skipped
        if not skipped:
            return
        self.telemetry.event(
            TrainerEdge.CHECKPOINT_FALLBACK,
            {
                "skipped_steps": [s for s, _ in skipped],
                "step": found[0] if found is not None else None,
                "reason": f"{skipped[0][1].file}: {skipped[0][1].reason}",
            },
        )

    def _set_interval(self, step: int, *, every_steps: int, request_id: str) -> None:
        """The controller's new periodic interval, agreed at `step` (every rank here): taken
        with `auto`, ignored (logged) with a fixed interval."""
        if not self.interval_auto or every_steps < 1:
            log.warning(
                "event=checkpoint_interval_ignored job=%s rank=%d step=%d every_steps=%d "
                "request_id=%s reason=%s",
                self.job,
                self.rank,
                step,
                every_steps,
                request_id,
                "fixed_interval" if not self.interval_auto else "bad_value",
            )
            return
        before = self.checkpoints.settings.checkpoint_every
        self.checkpoints.set_checkpoint_every(every_steps)
        self.telemetry.ckpt_health.checkpoint_every = every_steps
        log.info(
            "event=checkpoint_interval_changed job=%s rank=%d step=%d every_steps=%d "
            "before=%d request_id=%s",
            self.job,
            self.rank,
            step,
            every_steps,
            before,
            request_id,
        )

    def _rollback(self, step: int) -> StepAction:
        self.checkpoints.wait()
        self.checkpoints.collect()
        found = self.checkpoints.restore_latest()
        self._report_fallback(found)
        if found is None:
            log.error(
                "event=stop job=%s rank=%d step=%d reason=nan_no_checkpoint",
                self.job,
                self.rank,
                step,
            )
            self.telemetry.event(TrainerEdge.STOP, {"step": step, "reason": "nan_no_checkpoint"})
            return StepAction(stop=True, reason="nan_no_checkpoint")
        good, _ = found
        self.agreement.clear_nonfinite()  # what was seen since came from the state just replaced
        skip = self.nan.settings.skip_batches
        sampler = self.state.sampler
        if skip and sampler is not None and hasattr(sampler, "mark_step"):
            sampler.mark_step(skip)
        self.nan.rolled_back(step=step, to_step=good)
        return StepAction(rollback=True, reason="nan", next_step=good + 1)


def checkpoint_interval(
    checkpoint_every: int | Literal["auto"], env: Mapping[str, str] | None = None
) -> CheckpointInterval:
    """The periodic interval a rank starts with. `TRAINGUARD_CHECKPOINT_INTERVAL` (the job
    spec's `checkpoint.interval`, set by the controller) wins when set: `N`, or `auto[:N]`
    (with no N the argument's number, if any, is the start); else the argument: a number of
    steps, or "auto" (no periodic checkpoint until the controller sets one)."""
    if checkpoint_every != "auto" and (
        isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int)
    ):
        raise ValueError(f"checkpoint_every must be steps or 'auto', got {checkpoint_every!r}")
    own = 0 if checkpoint_every == "auto" else checkpoint_every
    raw = (os.environ if env is None else env).get(INTERVAL_ENV, "").strip()
    if not raw:
        return CheckpointInterval(every_steps=own, auto=checkpoint_every == "auto")
    try:
        spec = parse_interval(raw)
    except Invalid as e:
        raise ValueError(str(e)) from None
    if spec.auto and spec.every_steps == 0:
        return CheckpointInterval(every_steps=max(own, 0), auto=True)
    return spec


def open_channel(*, job: str, rank: int, pid: int) -> AgentChannel:
    """The rank's link to its agent: heartbeats out, control datagrams in."""
    agent_sock = agent_socket_path()
    return AgentChannel(
        agent_socket=agent_sock,
        control_socket=control_socket_path(job=job, rank=rank, pid=pid, agent_socket=agent_sock),
    )


def as_float(v: float | torch.Tensor | None) -> float | None:
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return float(v.detach().item())
    return float(v)
