"""HF Transformers `Trainer` integration: `TrainguardCallback`, built from the trainer's parts.

The Trainer keeps its loop, its checkpoint format (safetensors) and its resume; the callback
adds what `Trainguard` gives a loop written around it (docs/trainer.md, "HF Transformers
Trainer"): heartbeats (telemetry.py, compute_timer.py), the NaN policy (nan_guard.py), a
controller's checkpoint or stop request and SIGTERM acted on at one agreed step by every rank
(agreement.py, signals.py) through `control.should_save` / `control.should_training_stop`,
and checksums of what each save wrote, so that `newest_verified_checkpoint()` resumes from
the newest `checkpoint-N` whose files verify.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.kinds import TrainerEdge
from trainguard.trainer.agreement import AgreementSettings, StepAgreement
from trainguard.trainer.channel import (
    AgentChannel,
    agent_socket_path,
    control_socket_path,
    job_name,
)
from trainguard.trainer.checkpoint import SaveResult
from trainguard.trainer.compute_timer import ComputeTimer
from trainguard.trainer.integrations.hf_checksums import (
    CHECKSUMS_NAME,
    newest_verified_checkpoint,
    verify_checkpoint,
    write_checksums,
)
from trainguard.trainer.nan_guard import NanGuard, NanSettings
from trainguard.trainer.signals import SignalGuard, SignalSettings
from trainguard.trainer.sync import Agreement, Coordinator, DistCoordinator, LocalCoordinator
from trainguard.trainer.telemetry import Telemetry

__all__ = [
    "CHECKSUMS_NAME",
    "TrainguardCallback",
    "newest_verified_checkpoint",
    "verify_checkpoint",
    "write_checksums",
]

log = logging.getLogger("trainguard.trainer")

_CHECKPOINT_ACTIONS = ("checkpoint", "checkpoint_stop")
_STOP_ACTIONS = ("stop", "checkpoint_stop")


class TrainguardCallback(TrainerCallback):
    """Add to `Trainer(callbacks=[...])` on every rank. The parts start at `on_train_begin`
    (where the process group exists) and stop at `on_train_end`.

    nan_policy: "continue" (report only) or "stop" (no save, stop training on every rank at
    that step). A rollback is a restart from `newest_verified_checkpoint()`: the Trainer
    cannot restore its state in the middle of `train()`. The loss is checked at each logging
    step (`logging_steps`); set `logging_nan_inf_filter=False` so that the Trainer does not
    replace a non-finite loss (the grad norm is checked either way).
    """

    def __init__(
        self,
        *,
        nan_policy: Literal["continue", "stop"] = "continue",
        grad_spike_factor: float | None = None,
        grad_spike_window: int = 50,
        sync_every: int | None = None,
        handle_sigterm: bool = True,
        sigterm_grace_s: float = 30.0,
        sigterm_hard_exit: bool = True,
        dump_stacks_on_sigusr1: bool = True,
        job: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if nan_policy not in ("continue", "stop"):
            raise ValueError(
                f"nan_policy must be 'continue' or 'stop' with the HF Trainer, got {nan_policy!r} "
                "(a rollback is a restart from newest_verified_checkpoint())"
            )
        # Each part validates its own settings (ValueError naming the argument), here, before
        # the Trainer starts.
        self._nan_settings = NanSettings(
            nan_policy=nan_policy,
            grad_spike_factor=grad_spike_factor,
            grad_spike_window=grad_spike_window,
        )
        self._sync_settings = AgreementSettings(sync_every=sync_every)
        self._signal_settings = SignalSettings(
            handle_sigterm=handle_sigterm,
            sigterm_grace_s=sigterm_grace_s,
            sigterm_hard_exit=sigterm_hard_exit,
            dump_stacks_on_sigusr1=dump_stacks_on_sigusr1,
        )
        self.job = job or job_name()
        self.clock = clock
        self._started = False
        self._first_step = True
        self._step = 0  # the newest step done
        self._last_mono: float | None = None
        self._last_tokens: int | None = None
        self._pending_heartbeat: dict[str, Any] | None = None  # sent by on_log, with the loss
        self._save_request_id: str | None = None  # the request the coming save serves
        self._save_answers_sigterm = False
        self._stopping = False
        self._hook_handles: list[Any] = []
        self._measuring: contextlib.AbstractContextManager[None] | None = None

    # --- the Trainer's events -------------------------------------------------------------

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if self._started:
            return
        distributed = dist.is_available() and dist.is_initialized()
        # Constructing it is a collective (two gloo groups): every rank is here, in order.
        self.coord: Coordinator = DistCoordinator() if distributed else LocalCoordinator()
        self.rank = self.coord.rank
        pid = os.getpid()
        agent_sock = agent_socket_path()
        self.channel = AgentChannel(
            agent_socket=agent_sock,
            control_socket=control_socket_path(
                job=self.job, rank=self.rank, pid=pid, agent_socket=agent_sock
            ),
        )
        save_every = args.save_steps if str(args.save_strategy).endswith("steps") else 0
        self.telemetry = Telemetry(
            channel=self.channel,
            job=self.job,
            rank=self.rank,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=self.coord.world_size,
            pid=pid,
            checkpoint_every=int(save_every),
            clock=self.clock,
        )
        self.agreement = StepAgreement(
            coordinator=self.coord, settings=self._sync_settings, job=self.job, clock=self.clock
        )
        self.nan = NanGuard(
            settings=self._nan_settings,
            job=self.job,
            rank=self.rank,
            emit=self.telemetry.event,
            clock=self.clock,
        )
        self.signals = SignalGuard(
            settings=self._signal_settings,
            job=self.job,
            rank=self.rank,
            latest_step=lambda: self.telemetry.ckpt_step,
            on_sigterm=self.agreement.note_sigterm,
            clock=self.clock,
        )
        self.samples_per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        if model is not None:
            self.compute_timer: ComputeTimer | None = ComputeTimer(model=model, clock=self.clock)
            self._hook_handles = [
                model.register_forward_pre_hook(self._forward_begins),
                model.register_forward_hook(self._forward_ends),
            ]
        else:
            self.compute_timer = None
        self._started = True
        self.signals.install()
        log.info(
            "event=trainer_start job=%s rank=%d world_size=%d integration=hf output_dir=%s "
            "control_socket=%s",
            self.job,
            self.rank,
            self.coord.world_size,
            args.output_dir,
            self.channel.control_socket or "-",
        )
        self.telemetry.send(step=state.global_step, phase="init")

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._first_step:
            self._first_step = False
            if state.global_step > 0:  # the Trainer resumed from checkpoint-<global_step>
                self.telemetry.checkpoint_loaded(step=state.global_step, request_id=None)
                log.info(
                    "event=resumed job=%s rank=%d step=%d integration=hf",
                    self.job,
                    self.rank,
                    state.global_step,
                )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The optimizer step `state.global_step` is done; the Trainer logs and saves next."""
        step = state.global_step
        now = self.clock.monotonic()
        step_time_s = None if self._last_mono is None else now - self._last_mono
        self._flush_heartbeat()  # a step whose on_log did not come
        compute_time_s = self.compute_timer.take() if self.compute_timer is not None else None
        self.agreement.receive(self.channel.poll())
        # The Trainer's own periodic save (set by its flow callback, the same on every rank)
        # also agrees, so it is never a step some rank takes for a stop.
        ag = self.agreement.at_step(step, step_time_s=step_time_s, periodic=control.should_save)
        if ag is not None:
            self._act(step, ag, control)
            if not self._stopping:
                self.agreement.post(ag.interval)
        tokens = None
        seen = getattr(state, "num_input_tokens_seen", None)
        if seen:
            tokens = None if self._last_tokens is None else seen - self._last_tokens
            self._last_tokens = seen
        heartbeat: dict[str, Any] = {
            "step": step,
            "phase": "stopping" if self._stopping else "train",
            "step_time_s": step_time_s,
            "compute_time_s": compute_time_s,
            "samples": self.samples_per_step,
            "tokens": tokens,
        }
        if control.should_log:
            self._pending_heartbeat = heartbeat  # on_log adds the loss and sends it
        else:
            self.telemetry.send(**heartbeat)
        self._last_mono = self.clock.monotonic()
        self._step = step

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """The Trainer's logged loss and grad norm are the mean over all ranks (its own
        all_gather), the same on every rank: each rank reaches the same NaN decision at the
        same step without an agreement, before this step's save."""
        logs = logs or {}
        loss = _as_float(logs.get("loss"))
        grad_norm = _as_float(logs.get("grad_norm"))
        if "loss" not in logs and "grad_norm" not in logs:
            return  # an evaluation or the end-of-training summary
        step = state.global_step
        if self.nan.check(step, loss=loss, grad_norm=grad_norm):
            self._nonfinite(step, control)
        pending, self._pending_heartbeat = self._pending_heartbeat, None
        if pending is not None:
            self.telemetry.send(**pending, loss=loss, grad_norm=grad_norm)

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The Trainer's save of `checkpoint-<global_step>` returned on this rank: once every
        rank's did, rank 0 records the checksums; every rank reports the commit."""
        step = state.global_step
        path = Path(str(args.output_dir)) / f"checkpoint-{step}"
        t0 = self.clock.monotonic()
        self.coord.all_gather_json(step)  # every rank's files are written
        mine: list[Any] = [True, 0, ""]
        if self.rank == 0:
            try:
                mine = [True, write_checksums(path, step=step), ""]
            except OSError as e:
                mine = [False, 0, f"checksums: {e.strerror or e}"]
        ok, size, reason = self.coord.all_gather_json(mine)[0]
        result = SaveResult(
            step=step,
            request_id=self._save_request_id,
            ok=bool(ok),
            duration_s=self.clock.monotonic() - t0,
            path=str(path),
            bytes=int(size),
            reason=str(reason),
        )
        self._save_request_id = None
        self._save_answers_sigterm = False
        self.telemetry.report(result)
        log.info(
            "event=checkpoint_%s job=%s rank=%d step=%d path=%s integration=hf",
            "committed" if ok else "failed",
            self.job,
            self.rank,
            step,
            path,
        )
        self._flush_heartbeat()
        # The commit reaches the agent now, not one step later (a stop ends the loop here).
        self.telemetry.send(step=step, phase="stopping" if self._stopping else "train")

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.close(step=state.global_step)

    def close(self, *, step: int) -> None:
        """Stop the parts: the library's private gloo groups, the last heartbeat (exit), the
        control socket, SIGTERM's handler."""
        if not self._started:
            return
        self._started = False
        self._flush_heartbeat()
        self.agreement.drain()
        # the two private gloo groups go now, not in the interpreter's teardown (SIGABRT)
        self.coord.close()
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []
        self.telemetry.event(TrainerEdge.EXIT, {})
        self.telemetry.send(step=step, phase="exit")
        self.channel.close()
        self.signals.restore()

    # --- acting on an agreement -----------------------------------------------------------

    def _act(self, step: int, ag: Agreement, control: TrainerControl) -> None:
        request_id = ag.request_id
        if request_id is not None:
            self.agreement.done(request_id)
        if ag.action in _CHECKPOINT_ACTIONS or ag.sigterm:
            control.should_save = True
            self._save_request_id = request_id if ag.action in _CHECKPOINT_ACTIONS else None
            self._save_answers_sigterm = ag.sigterm
            log.info(
                "event=checkpoint_agreed job=%s rank=%d step=%d request_id=%s sigterm=%s",
                self.job,
                self.rank,
                step,
                request_id or "-",
                ag.sigterm,
            )
        stop_reason: str | None = None
        if ag.sigterm:
            stop_reason = "sigterm"
        elif ag.action in _STOP_ACTIONS:
            stop_reason = ag.action
        if stop_reason is None:
            return
        # The Trainer saves (if asked above) in this step's _maybe_log_save_evaluate, then
        # leaves its loop: the stop is reported now, the commit by on_save.
        control.should_training_stop = True
        self._stopping = True
        self.telemetry.event(
            TrainerEdge.STOP, {"step": step, "reason": stop_reason, "request_id": request_id}
        )
        log.info(
            "event=stop job=%s rank=%d step=%d reason=%s request_id=%s integration=hf",
            self.job,
            self.rank,
            step,
            stop_reason,
            request_id or "-",
        )

    def _nonfinite(self, step: int, control: TrainerControl) -> None:
        """This step's logged state is not finite (the same on every rank): never save it."""
        if control.should_save:
            control.should_save = False
            log.warning(
                "event=checkpoint_skipped job=%s rank=%d step=%d reason=nonfinite_state",
                self.job,
                self.rank,
                step,
            )
            if self._save_request_id is not None or self._save_answers_sigterm:
                self.telemetry.event(
                    TrainerEdge.CHECKPOINT_FAILED,
                    {
                        "step": step,
                        "reason": "nonfinite_state",
                        "request_id": self._save_request_id,
                    },
                )
            self._save_request_id = None
            self._save_answers_sigterm = False
        if self.nan.action(nonfinite=True) != "stop" or self._stopping:
            return
        control.should_training_stop = True
        self._stopping = True
        self.telemetry.event(TrainerEdge.STOP, {"step": step, "reason": "nan"})
        log.error("event=stop job=%s rank=%d step=%d reason=nan", self.job, self.rank, step)

    def _flush_heartbeat(self) -> None:
        pending, self._pending_heartbeat = self._pending_heartbeat, None
        if pending is not None:
            self.telemetry.send(**pending)

    # --- compute time: the model's forward pass ---------------------------------------------

    def _forward_begins(self, module: torch.nn.Module, inputs: Any) -> None:
        # Forward only: with DDP the backward pass holds the gradient all-reduce, where every
        # rank waits for the slowest (docs/trainer.md, "Compute time").
        if self.compute_timer is None or not module.training:
            return
        self._measuring = self.compute_timer.measure(step=self._step + 1)
        self._measuring.__enter__()

    def _forward_ends(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        measuring, self._measuring = self._measuring, None
        if measuring is not None:
            measuring.__exit__(None, None, None)


def _as_float(v: Any) -> float | None:
    """A logged value as a float (NaN and Inf kept: the guard judges them)."""
    if v is None:
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None
