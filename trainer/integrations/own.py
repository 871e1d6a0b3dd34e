"""`OwnCheckpointer`: trainguard for a job that keeps its own loop and its own checkpoint code.

A torchtitan-, Megatron- or plain-DCP-style loop saves and loads its state itself. It calls
`step()` once per step; trainguard sends the heartbeat (loss, throughput, compute time, the
checkpoint health), agrees with every rank on the step at which a controller's checkpoint
request, a stop request or a SIGTERM is acted on, calls the job's `save(step)` there (every
rank at the same step) and reports `checkpoint_committed` or `checkpoint_failed`, so the
controller's proactive checkpoint waits for the job's own commit. Built from the trainer's
parts (agreement, signals, telemetry, compute_timer, nan_guard), as `Trainguard` is.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.kinds import TrainerEdge
from trainguard.protocol import HeartbeatPhase
from trainguard.trainer.agreement import AgreementSettings, StepAgreement
from trainguard.trainer.channel import job_name
from trainguard.trainer.checkpoint import SaveResult
from trainguard.trainer.compute_timer import ComputeTimer
from trainguard.trainer.core import StepAction, as_float, open_channel
from trainguard.trainer.nan_guard import NanGuard, NanSettings
from trainguard.trainer.signals import SignalGuard, SignalSettings
from trainguard.trainer.sync import Agreement, Coordinator, DistCoordinator, LocalCoordinator
from trainguard.trainer.telemetry import Telemetry

__all__ = ["OwnCheckpointer", "SaveFn"]

log = logging.getLogger("trainguard.trainer")

# The job's save: write the checkpoint of the state after `step` (every rank calls it at the
# same step, so a collective save such as DCP's works); raise if it did not commit.
SaveFn = Callable[[int], None]

_CHECKPOINT_ACTIONS = ("checkpoint", "checkpoint_stop")
_CONTINUE = StepAction()


class OwnCheckpointer:
    """Call `resumed(step)` after the job loaded its own checkpoint, `step(step, loss=...)` once
    after each step (the same steps on every rank), wrap the rank's own work in `compute()`,
    and `close()` at the end. `step()` returns a `StepAction`; on `stop` leave the loop (the
    save the stop asked for has run). Checkpoint convention as `Trainguard`'s: the checkpoint
    "of step k" holds the state after step k.

    In a distributed job every rank must construct it at the same point (it creates two small
    gloo process groups). NaN policy "rollback" needs trainguard's own checkpoints: here only
    "continue" and "stop"; a non-finite state is never saved.
    """

    def __init__(
        self,
        *,
        save: SaveFn,
        model: torch.nn.Module | None = None,
        checkpoint_every: int = 0,
        nan_policy: Literal["continue", "stop"] = "continue",
        sync_every: int | None = None,
        handle_sigterm: bool = True,
        sigterm_grace_s: float = 30.0,
        sigterm_hard_exit: bool = True,
        dump_stacks_on_sigusr1: bool = True,
        job: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0 = off), got {checkpoint_every}")
        if nan_policy not in ("continue", "stop"):
            raise ValueError(
                f"nan_policy must be 'continue' or 'stop' with the job's own checkpointer "
                f"(rollback restores trainguard's checkpoints), got {nan_policy!r}"
            )
        signal_settings = SignalSettings(
            handle_sigterm=handle_sigterm,
            sigterm_grace_s=sigterm_grace_s,
            sigterm_hard_exit=sigterm_hard_exit,
            dump_stacks_on_sigusr1=dump_stacks_on_sigusr1,
        )
        self._save_fn = save
        self.checkpoint_every = checkpoint_every
        self.clock = clock
        distributed = dist.is_available() and dist.is_initialized()
        self.coord: Coordinator = DistCoordinator() if distributed else LocalCoordinator()
        self.rank = self.coord.rank
        self.world_size = self.coord.world_size
        self.job = job or job_name()
        pid = os.getpid()
        self.channel = open_channel(job=self.job, rank=self.rank, pid=pid)
        self.telemetry = Telemetry(
            channel=self.channel,
            job=self.job,
            rank=self.rank,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=self.world_size,
            pid=pid,
            checkpoint_every=checkpoint_every,
            clock=clock,
        )
        self.agreement = StepAgreement(
            coordinator=self.coord,
            settings=AgreementSettings(sync_every=sync_every),
            job=self.job,
            clock=clock,
        )
        self.nan = NanGuard(
            settings=NanSettings(nan_policy=nan_policy),
            job=self.job,
            rank=self.rank,
            emit=self.telemetry.event,
            clock=clock,
        )
        # Without a model the blocks are timed on the clock (a CUDA model: with CUDA events).
        self.compute_timer = ComputeTimer(model=model or torch.nn.Module(), clock=clock)
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
        self._closed = False
        self.signals.install()
        log.info(
            "event=trainer_start job=%s rank=%d world_size=%d mode=own_checkpointer "
            "control_socket=%s",
            self.job,
            self.rank,
            self.world_size,
            self.channel.control_socket or "-",
        )
        self.telemetry.send(step=0, phase="init")

    @property
    def ckpt_step(self) -> int | None:
        """The newest checkpoint committed (or resumed from) as this rank knows it."""
        return self.telemetry.ckpt_step

    def resumed(self, step: int) -> None:
        """The job loaded its own checkpoint of `step`: it is the newest one (heartbeat)."""
        self.agreement.drain()
        self._last_step = step  # the rank stands there until it trains further
        self.telemetry.checkpoint_loaded(step=step, request_id=None)
        log.info("event=resumed job=%s rank=%d step=%d", self.job, self.rank, step)

    def compute(self) -> contextlib.AbstractContextManager[None]:
        """Wrap this rank's own work of a step (see `Trainguard.compute`)."""
        return self.compute_timer.measure(step=self._last_step + 1)

    def step(
        self,
        step: int,
        *,
        loss: float | torch.Tensor | None = None,
        grad_norm: float | torch.Tensor | None = None,
        samples: int | None = None,
        tokens: int | None = None,
    ) -> StepAction:
        """Call once after step `step` completed; may call the job's save (every rank)."""
        if self._closed:
            raise RuntimeError("OwnCheckpointer.step() after close()")
        now = self.clock.monotonic()
        step_time_s = None if self._last_mono is None else now - self._last_mono
        compute_time_s = self.compute_timer.take()
        loss_v = as_float(loss)
        grad_v = as_float(grad_norm)
        if self.nan.check(step, loss=loss_v, grad_norm=grad_v):
            self.agreement.note_nonfinite()
        self.agreement.receive(self.channel.poll())
        action = _CONTINUE
        agreement = self.agreement.at_step(
            step, step_time_s=step_time_s, periodic=self._periodic(step)
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
        # The save ran inside this step's call: it does not count as the next step's time.
        self._last_mono = self.clock.monotonic()
        self._last_step = step
        return action

    def save(self, step: int, *, request_id: str | None = None) -> bool:
        """Run the job's save for `step` now and report its outcome (every rank must call it
        at the same step). True when it committed."""
        t0 = self.clock.monotonic()
        try:
            self._save_fn(step)
        except Exception as e:  # the job's code: any failure is a failed checkpoint
            log.exception(
                "event=checkpoint_failed job=%s rank=%d step=%d reason=%s",
                self.job,
                self.rank,
                step,
                type(e).__name__,
            )
            result = SaveResult(
                step=step,
                request_id=request_id,
                ok=False,
                duration_s=self.clock.monotonic() - t0,
                path="",
                reason=f"{type(e).__name__}: {e}",
            )
        else:
            result = SaveResult(
                step=step,
                request_id=request_id,
                ok=True,
                duration_s=self.clock.monotonic() - t0,
                path="",
            )
            log.info(
                "event=checkpoint_committed job=%s rank=%d step=%d request_id=%s duration_s=%.3f",
                self.job,
                self.rank,
                step,
                request_id or "-",
                result.duration_s,
            )
        self.telemetry.report(result)
        return result.ok

    def close(self) -> None:
        """Destroy the library's private gloo groups, report the exit and remove the control
        socket."""
        if self._closed:
            return
        self._closed = True
        self.agreement.drain()
        # the two private gloo groups go now, not in the interpreter's teardown (SIGABRT)
        self.coord.close()
        self.telemetry.event(TrainerEdge.EXIT, {})
        self.telemetry.send(step=self._last_step, phase="exit")
        self.channel.close()
        self.signals.restore()

    def __enter__(self) -> OwnCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- acting on an agreement -----------------------------------------------------------

    def _periodic(self, step: int) -> bool:
        return self.checkpoint_every > 0 and step % self.checkpoint_every == 0

    def _act(self, step: int, ag: Agreement) -> StepAction:
        request_id = ag.request_id
        if request_id is not None:
            self.agreement.done(request_id)
        ckpt_rid = request_id if ag.action in _CHECKPOINT_ACTIONS else None
        wants_save = self._periodic(step) or ckpt_rid is not None or ag.sigterm
        if self.nan.action(nonfinite=ag.nonfinite) == "stop":
            if ckpt_rid is not None:
                self.telemetry.checkpoint_skipped(step=step, request_id=ckpt_rid)
            self.telemetry.event(TrainerEdge.STOP, {"step": step, "reason": "nan"})
            log.error("event=stop job=%s rank=%d step=%d reason=nan", self.job, self.rank, step)
            return StepAction(stop=True, reason="nan")
        started = False
        if wants_save and ag.nonfinite:
            log.warning(
                "event=checkpoint_skipped job=%s rank=%d step=%d reason=nonfinite_state",
                self.job,
                self.rank,
                step,
            )
            if ckpt_rid is not None or ag.sigterm:
                self.telemetry.checkpoint_skipped(step=step, request_id=ckpt_rid)
        elif wants_save:
            self.save(step, request_id=ckpt_rid)
            started = True
        stop_reason: str | None = None
        if ag.sigterm:
            stop_reason = "sigterm"
        elif ag.action in ("stop", "checkpoint_stop"):
            stop_reason = ag.action
        if stop_reason is None:
            return StepAction(checkpoint_started=started, request_id=ckpt_rid)
        self.telemetry.stopping(step=step, reason=stop_reason, request_id=request_id)
        return StepAction(
            stop=True, reason=stop_reason, checkpoint_started=started, request_id=request_id
        )
