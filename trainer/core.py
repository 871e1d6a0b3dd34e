"""`Trainguard`: the one object a training loop calls once per step.

It sends the heartbeat, takes periodic / requested / emergency checkpoints, agrees with the
other ranks on the step at which every request, SIGTERM and NaN is acted upon, guards against
non-finite state, and restores everything on resume. Step convention: the checkpoint "of
step k" is taken after step k completed (optimizer and scheduler stepped), so it is exactly
the state needed to run step k+1; `resume()` returns k+1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import math
import os
import secrets
import shutil
import signal
import statistics
import sys
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from trainguard import __version__
from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.protocol import Heartbeat, HeartbeatPhase
from trainguard.trainer.channel import (
    AgentChannel,
    agent_socket_path,
    control_socket_path,
    job_name,
)
from trainguard.trainer.chaos import chaos_hooks, for_attempt, parse_chaos
from trainguard.trainer.checkpoint import (
    CheckpointWriter,
    SaveResult,
    load_rank_file,
    rank_file_name,
    read_tensor_file,
    tensor_file_name,
)
from trainguard.trainer.fence import (
    LaunchLock,
    LaunchLocked,
    StaleAttempt,
    epoch_from_env,
    raise_epoch,
)
from trainguard.trainer.grace import GraceWatchdog
from trainguard.trainer.hooks import StepHook
from trainguard.trainer.launch import LaunchMismatch, check_launch
from trainguard.trainer.manifest import (
    CheckpointInvalid,
    ForeignCheckpoint,
    Manifest,
    check_job,
    clean_stale,
    commit_dir,
    find_latest_good,
    read_manifest,
    step_dir_name,
    verify_dir,
)
from trainguard.trainer.s3 import S3Config, S3Store
from trainguard.trainer.state import (
    SnapshotPool,
    capture_rng,
    check_storable,
    derive_rng,
    fill_tensors,
    restore_rng,
    split_tensors,
)
from trainguard.trainer.sync import (
    REQUEST_ID_MAX_BYTES,
    Agreement,
    Coordinator,
    DistCoordinator,
    LocalCoordinator,
    LocalView,
)

__all__ = [
    "CheckpointMismatch",
    "LaunchMismatch",
    "NanPolicy",
    "StaleAttempt",
    "Stateful",
    "StepAction",
    "Trainguard",
]

log = logging.getLogger("trainguard.trainer")

NanPolicy = Literal["continue", "stop", "rollback"]
_NAN_POLICIES = ("continue", "stop", "rollback")
_HANDLED_IDS_MAX = 1024
_FOREIGN = -2  # broadcast by rank 0 when the newest checkpoint belongs to another job
# Adaptive agreement: its cost stays under 0.5 % of a step, unless that would break the
# reaction bound: stop, checkpoint requests, SIGTERM and NaN are acted on within
# max(2 steps, _REACTION_BOUND_S). An event waits at most 2 intervals (one for the next
# post, one for its collection), hence an interval of at most _REACTION_BOUND_S / 2 of
# steps, of which _REACTION_MARGIN is used: the step time is an average, and the steps of
# the next two intervals may be slower than it.
_SYNC_BUDGET = 0.005
_REACTION_BOUND_S = 1.0
_REACTION_MARGIN = 0.8
# nan_policy="continue" can see a non-finite loss at every step: one log line per rank at the
# first, then at most one per this many seconds, with the count of those not logged.
_NAN_LOG_EVERY_S = 60.0


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


class CheckpointMismatch(RuntimeError):
    """A good checkpoint exists but cannot be loaded into this run (e.g. a checkpoint written
    without a process group, resumed at another world size)."""


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
        checkpoint_every: int = 0,
        keep_last: int = 3,
        s3: S3Config | None = None,
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
        chaos: str | None = None,
        single_process: bool = False,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0 (0 = off), got {checkpoint_every}")
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 = keep all), got {keep_last}")
        if nan_policy not in _NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {_NAN_POLICIES}, got {nan_policy!r}")
        if skip_batches < 0:
            raise ValueError(f"skip_batches must be >= 0, got {skip_batches}")
        if skip_batches and nan_policy != "rollback":
            raise ValueError("skip_batches only applies to nan_policy='rollback'")
        if sync_every is not None and sync_every < 1:
            raise ValueError(f"sync_every must be >= 1 or None (adaptive), got {sync_every}")
        if sigterm_grace_s <= 0 or checkpoint_timeout_s <= 0:
            raise ValueError("sigterm_grace_s and checkpoint_timeout_s must be positive")
        if grad_spike_factor is not None and grad_spike_factor <= 1.0:
            raise ValueError(f"grad_spike_factor must exceed 1.0, got {grad_spike_factor}")
        if epoch is not None and epoch < 0:
            raise ValueError(f"epoch must be >= 0 or None (TRAINGUARD_ATTEMPT), got {epoch}")
        if launch_lock_timeout_s < 0:
            raise ValueError(f"launch_lock_timeout_s must be >= 0, got {launch_lock_timeout_s}")
        # The attempt epoch fences the checkpoint directory (trainer/fence.py); None: no fencing.
        self.epoch = epoch if epoch is not None else epoch_from_env()
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.sampler = sampler
        self.extra = dict(extra or {})
        # Absolute: paths in events and logs (checkpoint_committed.path) mean the same file to
        # whoever reads them, whatever their working directory.
        self.ckpt_dir = Path(ckpt_dir).absolute()
        self.checkpoint_every = checkpoint_every
        self.nan_policy = nan_policy
        self.skip_batches = skip_batches
        self.grad_spike_factor = grad_spike_factor
        self.sync_every = sync_every
        self.sigterm_grace_s = sigterm_grace_s
        self.sigterm_hard_exit = sigterm_hard_exit
        self.checkpoint_timeout_s = checkpoint_timeout_s
        self.clock = clock
        # Parsed before anything starts, so a bad spec fails alone (ChaosSpecError).
        chaos_rules = for_attempt(
            parse_chaos(chaos if chaos is not None else os.environ.get("TRAINGUARD_CHAOS", "")),
            os.environ.get("TRAINGUARD_ATTEMPT"),
        )

        self.coord: Coordinator
        distributed = dist.is_available() and dist.is_initialized()
        check_launch(initialized=distributed, single_process=single_process)
        if distributed:
            self.coord = DistCoordinator()
        else:
            self.coord = LocalCoordinator()
        self.rank = self.coord.rank
        self.world_size = self.coord.world_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.job = job or job_name()
        self.pid = os.getpid()
        # Empty unless chaos is configured: the step path then makes no hook calls at all.
        self._hooks: tuple[StepHook, ...] = chaos_hooks(
            rules=chaos_rules,
            rank=self.rank,
            job=self.job,
            model=model,
            clock=clock,
        )

        agent_sock = agent_socket_path()
        self.channel = AgentChannel(
            agent_socket=agent_sock,
            control_socket=control_socket_path(
                job=self.job, rank=self.rank, pid=self.pid, agent_socket=agent_sock
            ),
        )

        self._launch_lock: LaunchLock | None = None
        refusal = ""
        if self.rank == 0:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            refusal = self._fence_directory(launch_lock_timeout_s)
            if not refusal:
                clean_stale(self.ckpt_dir)
        # Also a barrier: no rank starts writing before rank 0 raised the epoch and cleaned
        # stale directories. A refusal travels in its place, so every rank raises it.
        run_nonce = self.coord.broadcast_str(refusal or f"ok:{secrets.token_hex(4)}")
        if not run_nonce.startswith("ok:"):
            self.channel.close()
            if self._launch_lock is not None:
                self._launch_lock.release()
            kind, _, detail = run_nonce.partition(":")
            log.error(
                "event=launch_refused job=%s rank=%d epoch=%s reason=%s",
                self.job,
                self.rank,
                self.epoch,
                detail.replace(" ", "_"),
            )
            if kind == "stale":
                mine, _, current = detail.partition(":")
                raise StaleAttempt(epoch=int(mine), current=int(current))
            raise LaunchLocked(detail)
        run_nonce = run_nonce.removeprefix("ok:")
        self._s3 = S3Store(s3, job=self.job) if s3 is not None else None
        self.writer = CheckpointWriter(
            ckpt_dir=self.ckpt_dir,
            coordinator=self.coord,
            keep_last=keep_last,
            job=self.job,
            version=__version__,
            run_nonce=run_nonce,
            epoch=self.epoch,
            s3=self._s3,
            hooks=self._hooks,
            clock=clock,
        )
        self._pool = SnapshotPool(clock=clock)
        self._snapshot_prepared = False

        self.ckpt_step: int | None = None
        self.ckpt_request_id: str | None = None
        self._pending: list[tuple[str, str]] = []  # (action, request_id), oldest first
        self._handled: deque[str] = deque(maxlen=_HANDLED_IDS_MAX)
        self._events: list[tuple[str, dict[str, Any]]] = []
        self._bad_since_sync = False
        self._grad_norms: deque[float] = deque(maxlen=max(5, grad_spike_window))
        self._last_mono: float | None = None
        self._calls_to_sync = 0  # step() calls until the posted agreement is collected
        self._step_time_ema_s: float | None = None
        self._nan_logged_at: float | None = None
        self._nan_not_logged = 0
        self._agree_cost_s = 0.0
        self._post_cost_s = 0.0
        self._last_step = 0
        # compute(): wall seconds of this step's blocks (CPU), or per step the CUDA event pairs
        # not yet read (the GPU may still be running them) plus the host time hooks blocked
        self._compute_s: float | None = None
        self._compute_used = False
        self._compute_cuda: bool | None = None
        self._compute_events: list[tuple[Any, Any]] = []
        self._compute_extra_s = 0.0
        self._compute_pending: deque[tuple[list[tuple[Any, Any]], float]] = deque()
        self._compute_last_s: float | None = None
        self._sigterm_at: float | None = None
        self._stale = False  # a commit was refused: a newer attempt owns the directory
        self._hard_exit_timer: GraceWatchdog | None = None
        self._closed = False
        self._prev_handler: Any = None
        self._handler_installed = False
        if handle_sigterm and threading.current_thread() is threading.main_thread():
            self._prev_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._handler_installed = True
        if dump_stacks_on_sigusr1:
            _register_stack_dump()
        log.info(
            "event=trainer_start job=%s rank=%d world_size=%d ckpt_dir=%s control_socket=%s "
            "epoch=%s chaos=%s",
            self.job,
            self.rank,
            self.world_size,
            self.ckpt_dir,
            self.channel.control_socket or "-",
            "-" if self.epoch is None else self.epoch,
            ",".join(r.kind for r in chaos_rules) or "-",
        )
        self._send(step=0, phase="init")

    # --- public API -----------------------------------------------------------------------

    def resume(self, *, first_step: int = 0) -> int:
        """Load the newest good checkpoint (verified; S3 if none locally) and return the step
        to run next: checkpoint step + 1, or `first_step` when there is none."""
        self._drain_agreement()
        self.writer.wait(self.checkpoint_timeout_s)
        found = self._agree_latest()
        if found is None:
            log.info("event=resume_fresh job=%s rank=%d", self.job, self.rank)
            return first_step
        step, manifest = found
        self._load(step, manifest)
        self.ckpt_step = step
        if manifest.request_id:
            self.ckpt_request_id = manifest.request_id
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
        now = self.clock.monotonic()
        step_time_s = None if self._last_mono is None else now - self._last_mono
        forced_loss = None
        for hook in self._hooks:
            forced = hook.before_step(
                step=step, step_time_s=step_time_s, compute_used=self._compute_used
            )
            if forced is not None:
                forced_loss = forced
        compute_time_s = self._take_compute_time()
        loss_v = _as_float(loss)
        grad_v = _as_float(grad_norm)
        if forced_loss is not None:
            loss_v = forced_loss
        self._check_finite(step, loss_v, grad_v)
        if self.sampler is not None and hasattr(self.sampler, "mark_step"):
            self.sampler.mark_step()
        self._receive_controls()
        self._collect_results()

        action = CONTINUE
        if step_time_s is not None:
            ema = self._step_time_ema_s
            self._step_time_ema_s = step_time_s if ema is None else 0.9 * ema + 0.1 * step_time_s
        agreement = self._agreement(step)
        if agreement is not None:
            action = self._act(step, agreement)
            if not action.stop:
                self._post(agreement.interval)
        phase: HeartbeatPhase = "stopping" if action.stop else "train"
        self._send(
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
        if not self._snapshot_prepared:
            self._prepare_snapshot()
        return action

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        """Wrap this rank's own work of a step: forward and backward, but not the waits in
        collectives (the gradient all-reduce). Blocks of one step add up (e.g. gradient
        accumulation). The sum is sent as `compute_time_s` with the next `step()`: in a
        synchronous job every rank's step time equals the slowest rank's, so only this time
        tells which rank is the straggler. On CUDA it is measured with CUDA events (no
        synchronisation; a step whose kernels are still running is reported when they are
        done). With DistributedDataParallel the backward pass contains the gradient
        all-reduce: wrap the forward pass and the loss only."""
        cuda = self._compute_cuda
        if cuda is None:
            cuda = self._compute_cuda = any(p.is_cuda for p in self.model.parameters())
        self._compute_used = True
        start = end = None
        if cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = self.clock.monotonic()
        yield
        slept_s = 0.0
        for hook in self._hooks:
            slept_s += hook.after_compute(
                step=self._last_step + 1, work_s=self.clock.monotonic() - t0
            )
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._compute_events.append((start, end))
            self._compute_extra_s += slept_s  # the GPU did not see the host's block
        else:
            self._compute_s = (self._compute_s or 0.0) + self.clock.monotonic() - t0

    def save(self, step: int, *, wait: bool = False) -> bool:
        """Checkpoint the state after `step` now (every rank must call it at the same step).
        Returns False when it was not started (state not finite, writer busy past timeout, or
        this attempt is stale)."""
        if self._stale:
            return False
        started = self._start_checkpoint(step, request_id=None)
        if started and wait:
            self.writer.wait(self.checkpoint_timeout_s)
            self._collect_results()
        return started

    def close(self) -> None:
        """Wait for the in-flight save (bounded), report, remove the control socket."""
        if self._closed:
            return
        self._closed = True
        self._drain_agreement()
        timeout_s = self.checkpoint_timeout_s
        if self._sigterm_at is not None:
            timeout_s = max(0.0, self._sigterm_at + self.sigterm_grace_s - self.clock.monotonic())
        if not self.writer.wait(timeout_s):
            log.error(
                "event=checkpoint_abandoned job=%s rank=%d reason=timeout", self.job, self.rank
            )
        self._collect_results()
        self._pool.close()
        if self._launch_lock is not None:
            self._launch_lock.release()
        self._events.append(("exit", {}))
        self._send(step=-1, phase="exit")
        self.channel.close()
        if self._handler_installed:
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGTERM, self._prev_handler)

    def __enter__(self) -> Trainguard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- per-step pieces ------------------------------------------------------------------

    def _fence_directory(self, lock_timeout_s: float) -> str:
        """Rank 0, at start: take the launch lock and raise the directory's epoch to ours.
        Returns "" or the refusal every rank raises ("stale:<ours>:<theirs>", "locked:<why>")."""
        if self.epoch is None:
            return ""
        lock = LaunchLock(self.ckpt_dir, epoch=self.epoch, clock=self.clock)
        try:
            lock.acquire(timeout_s=lock_timeout_s)
        except LaunchLocked as e:
            return f"locked:{e}"
        self._launch_lock = lock
        try:
            previous = raise_epoch(self.ckpt_dir, self.epoch)
        except StaleAttempt as e:
            return f"stale:{e.epoch}:{e.current}"
        if previous != self.epoch:
            log.info(
                "event=epoch_raised job=%s dir=%s epoch=%d previous=%s",
                self.job,
                self.ckpt_dir,
                self.epoch,
                "-" if previous is None else previous,
            )
        return ""

    def _view(self) -> LocalView:
        """This rank's view for the next agreement; the non-finite flag restarts with it."""
        view = LocalView(
            request=self._pending[0] if self._pending else None,
            sigterm=self._sigterm_at is not None,
            nonfinite=self._bad_since_sync,
            interval=self._propose_interval(),
            max_interval=self._max_interval(),
            stale=self._stale,
        )
        self._bad_since_sync = False
        return view

    def _agreement(self, step: int) -> Agreement | None:
        """The agreement to act on at this step, or None between agreements.

        Single process: the local view, every step. Distributed: the agreement posted
        `interval` step() calls ago is collected now (its all_reduce ran during the steps in
        between), and the next one is posted after acting. Which calls collect depends only
        on the step number, the call count and agreed values, so all ranks join the same
        collectives at the same steps. A step that checkpoints (periodic, requested, SIGTERM)
        also agrees on the state at this very step, so no rank saves a non-finite state
        another rank saw a moment ago."""
        if not self.coord.distributed:
            return self.coord.agree(self._view())
        self._calls_to_sync -= 1
        periodic = self._is_periodic(step)
        if not self.coord.in_flight:  # the first step, or after resume()
            return self.coord.agree(self._view())
        if self._calls_to_sync > 0 and not periodic:
            return None
        t0 = self.clock.monotonic()
        ag = self.coord.finish()
        self._agree_cost_s = self.clock.monotonic() - t0 + self._post_cost_s
        if periodic or ag.sigterm or ag.action in ("checkpoint", "checkpoint_stop"):
            now = self.coord.agree(self._view())
            ag = dataclasses.replace(
                ag, sigterm=ag.sigterm or now.sigterm, nonfinite=ag.nonfinite or now.nonfinite
            )
        return ag

    def _post(self, interval: int) -> None:
        """Distributed: start the next agreement; it is collected `interval` calls later."""
        if not self.coord.distributed:
            return
        t0 = self.clock.monotonic()
        self.coord.start(self._view())
        self._post_cost_s = self.clock.monotonic() - t0
        self._calls_to_sync = interval

    def _drain_agreement(self) -> None:
        """Collect a posted agreement nobody will act on (resume, close): every rank posted
        it at the same step, so every rank drains it."""
        if self.coord.in_flight:
            self.coord.finish()

    def _propose_interval(self) -> int:
        """Steps until the next agreement: fixed `sync_every`, or adaptive so that the
        agreement's measured cost stays under `_SYNC_BUDGET` of a step."""
        if self.sync_every is not None:
            return self.sync_every
        step_s = self._step_time_ema_s
        if not step_s or not self.coord.distributed:
            return 1
        return max(1, math.ceil(self._agree_cost_s / (_SYNC_BUDGET * step_s)))

    def _max_interval(self) -> int | None:
        """The reaction bound: an event waits at most two intervals, so an interval may span
        at most half of `_REACTION_BOUND_S` (with a margin; always one step). None with a
        fixed `sync_every`."""
        if self.sync_every is not None:
            return None
        step_s = self._step_time_ema_s
        if not step_s:
            return 1
        return max(1, int(_REACTION_MARGIN * _REACTION_BOUND_S / 2 / step_s))

    def _is_periodic(self, step: int) -> bool:
        return self.checkpoint_every > 0 and step > 0 and step % self.checkpoint_every == 0

    def _act(self, step: int, ag: Agreement) -> StepAction:
        request_id = ag.request_id
        if ag.request_id is not None:
            self._forget_request(ag.request_id)
        if ag.stale:
            # A newer attempt owns the directory: nothing this one computes can be kept.
            self._events.append(("stop", {"step": step, "reason": "stale_attempt"}))
            log.error(
                "event=stop job=%s rank=%d step=%d reason=stale_attempt epoch=%s",
                self.job,
                self.rank,
                step,
                self.epoch,
            )
            return StepAction(stop=True, reason="stale_attempt", request_id=request_id)
        if ag.nonfinite and self.nan_policy == "rollback":
            if ag.action is not None and ag.request_id is not None:
                # Every rank learnt the request from the agreement: act on it at the next
                # agreement, from the restored (finite) state.
                self._pending.insert(0, (ag.action, ag.request_id))
                self._handled.remove(ag.request_id)
            return self._rollback(step)
        if ag.nonfinite and self.nan_policy == "stop":
            if ag.action in ("checkpoint", "checkpoint_stop"):
                self._events.append(
                    (
                        "checkpoint_failed",
                        {"step": step, "reason": "nonfinite_state", "request_id": request_id},
                    )
                )
            self._events.append(("stop", {"step": step, "reason": "nan"}))
            log.error("event=stop job=%s rank=%d step=%d reason=nan", self.job, self.rank, step)
            return StepAction(stop=True, reason="nan")
        wants_ckpt = (
            self._is_periodic(step) or ag.action in ("checkpoint", "checkpoint_stop") or ag.sigterm
        )
        ckpt_rid = request_id if ag.action in ("checkpoint", "checkpoint_stop") else None
        started = False
        if wants_ckpt:
            if ag.nonfinite:
                log.warning(
                    "event=checkpoint_skipped job=%s rank=%d step=%d reason=nonfinite_state",
                    self.job,
                    self.rank,
                    step,
                )
                if ckpt_rid is not None or ag.sigterm:
                    self._events.append(
                        (
                            "checkpoint_failed",
                            {"step": step, "reason": "nonfinite_state", "request_id": ckpt_rid},
                        )
                    )
            else:
                deadline = None
                if ag.sigterm:
                    deadline = (self._sigterm_at or self.clock.monotonic()) + self.sigterm_grace_s
                started = self._start_checkpoint(step, request_id=ckpt_rid, deadline=deadline)
        stop_reason: str | None = None
        if ag.sigterm:
            stop_reason = "sigterm"
        elif ag.action in ("stop", "checkpoint_stop"):
            stop_reason = ag.action
        if stop_reason is None:
            return StepAction(checkpoint_started=started, request_id=ckpt_rid)
        if started:
            if ag.sigterm:
                left_s = max(
                    0.0,
                    (self._sigterm_at or self.clock.monotonic())
                    + self.sigterm_grace_s
                    - self.clock.monotonic(),
                )
            else:
                left_s = self.checkpoint_timeout_s
            if not self.writer.wait(left_s):
                log.error(
                    "event=checkpoint_abandoned job=%s rank=%d step=%d reason=grace_expired",
                    self.job,
                    self.rank,
                    step,
                )
            self._collect_results()
        self._events.append(
            ("stop", {"step": step, "reason": stop_reason, "request_id": request_id})
        )
        log.info(
            "event=stop job=%s rank=%d step=%d reason=%s request_id=%s",
            self.job,
            self.rank,
            step,
            stop_reason,
            request_id or "-",
        )
        return StepAction(
            stop=True, reason=stop_reason, checkpoint_started=started, request_id=request_id
        )

    def _start_checkpoint(
        self, step: int, *, request_id: str | None, deadline: float | None = None
    ) -> bool:
        timeout_s = self.checkpoint_timeout_s
        if deadline is not None:
            timeout_s = max(0.0, deadline - self.clock.monotonic())
        # At most one save in flight: wait for the previous one (identically on every rank,
        # so every rank starts this save's collectives together).
        if not self.writer.wait(timeout_s):
            log.error(
                "event=checkpoint_failed job=%s rank=%d step=%d reason=previous_save_still_running",
                self.job,
                self.rank,
                step,
            )
            self._events.append(
                (
                    "checkpoint_failed",
                    {
                        "step": step,
                        "request_id": request_id,
                        "reason": "previous_save_still_running",
                    },
                )
            )
            return False
        self._collect_results()
        if self._stale:
            return False  # the previous save was refused: every rank learnt it from its outcome
        try:
            rank_state, tensors = self._capture(step)
            snap = self._pool.snapshot({"rank": rank_state, "tensors": tensors})
        except Exception as e:
            # Must not diverge across ranks: a capture error is a programming error that
            # every rank hits identically (same model, same state types).
            log.error(
                "event=checkpoint_failed job=%s rank=%d step=%d reason=%s",
                self.job,
                self.rank,
                step,
                str(e).replace(" ", "_"),
            )
            self._events.append(
                ("checkpoint_failed", {"step": step, "request_id": request_id, "reason": str(e)})
            )
            return False
        self.writer.start(
            step=step,
            request_id=request_id,
            rank_state=snap["rank"],
            tensors=snap["tensors"],
            snapshot_bytes=self._pool.bytes,
        )
        return True

    def _prepare_snapshot(self) -> None:
        """Once, after the first step (the state is complete only then: Adam creates its
        moments in its first step): have the pool allocate and pre-fault the host buffers in
        the background, so the first save only copies, like every later one."""
        self._snapshot_prepared = True
        try:
            rank_state, tensors = self._capture(self._last_step)
            self._pool.prepare({"rank": rank_state, "tensors": tensors})
        except Exception as e:  # a save reports it; here it only costs the head start
            log.warning(
                "event=snapshot_prepare_failed job=%s rank=%d reason=%s",
                self.job,
                self.rank,
                str(e).replace(" ", "_"),
            )

    def _capture(self, step: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        msd, osd = self._model_optim_state()
        rank_state: dict[str, Any] = {
            "format_version": 1,
            "step": step,
            "rank": self.rank,
            "world_size": self.world_size,
            "rng": capture_rng(),
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "extra": {name: obj.state_dict() for name, obj in self.extra.items()},
        }
        # Model and optimizer tensors go to the bulk writer (DCP shards, or one raw tensor
        # file per rank); their structure and every other value stay in the rank file.
        tensors, rank_state["skeleton"] = split_tensors({"model": msd, "optim": osd})
        check_storable(rank_state)
        return rank_state, tensors

    def _model_optim_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        if self.coord.distributed:
            # Deferred heavy dependency: torch.distributed.checkpoint adds ~700 modules (~0.6 s)
            # to torch's import and only distributed runs use it (capture sharded state for a save).
            from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
                get_model_state_dict,
                get_state_dict,
            )

            if self.optimizer is None:
                return dict(get_model_state_dict(self.model)), {}
            msd, osd = get_state_dict(self.model, self.optimizer)
            return dict(msd), dict(osd)
        osd = self.optimizer.state_dict() if self.optimizer is not None else {}
        return self.model.state_dict(), osd

    def _load(self, step: int, manifest: Manifest) -> None:
        path = self.ckpt_dir / step_dir_name(step)
        same_world = manifest.world_size == self.world_size
        if not same_world and not (manifest.format == "dcp" and self.coord.distributed):
            raise CheckpointMismatch(
                f"{path}: written by world size {manifest.world_size} in format "
                f"{manifest.format!r}, this run has world size {self.world_size} "
                f"{'with' if self.coord.distributed else 'without'} a process group; only a "
                "checkpoint written with a process group (format 'dcp') loads at another world "
                "size, and only into a run with one (torchrun --nproc-per-node 1 for one rank)"
            )
        # At another world size the saved ranks are not this run's ranks: rank 0's file gives
        # the structure of the state and the values every rank shares (scheduler, scaler,
        # data position in samples, extras), and DCP reshards the tensors.
        rs = load_rank_file(path / rank_file_name(self.rank if same_world else 0))
        if manifest.format == "dcp":
            # Deferred heavy dependency: torch.distributed.checkpoint adds ~700 modules (~0.6 s)
            # to torch's import and only distributed runs use it (load a DCP checkpoint).
            from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415
            from torch.distributed.checkpoint import load as dcp_load  # noqa: PLC0415
            from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
                set_model_state_dict,
                set_state_dict,
            )

            msd, osd = self._model_optim_state()
            target, _ = split_tensors({"model": msd, "optim": osd})
            dcp_load(
                target,
                storage_reader=FileSystemReader(str(path / "dcp")),
                process_group=getattr(self.coord, "sync_group", None),
            )
            full = fill_tensors(rs["skeleton"], target)
            if self.optimizer is None:
                set_model_state_dict(self.model, full["model"])
            else:
                set_state_dict(
                    self.model,
                    self.optimizer,
                    model_state_dict=full["model"],
                    optim_state_dict=full["optim"],
                )
        elif manifest.format == "tensors":
            flat = read_tensor_file(path / tensor_file_name(self.rank), rs["tensor_index"])
            full = fill_tensors(rs["skeleton"], flat)
            self.model.load_state_dict(full["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(full["optim"])
        else:
            raise CheckpointMismatch(f"{path}: unknown checkpoint format {manifest.format!r}")
        if self.scheduler is not None and rs.get("scheduler") is not None:
            self.scheduler.load_state_dict(rs["scheduler"])
        if self.scaler is not None and rs.get("scaler") is not None:
            self.scaler.load_state_dict(rs["scaler"])
        if self.sampler is not None and rs.get("sampler") is not None:
            self.sampler.load_state_dict(rs["sampler"])
        for name, obj in self.extra.items():
            if name not in rs["extra"]:
                raise CheckpointMismatch(f"{path}: no state for extra {name!r}")
            obj.load_state_dict(rs["extra"][name])
        if same_world:
            restore_rng(rs["rng"])
            return
        seed = derive_rng(rs["rng"], step=step, rank=self.rank, world_size=self.world_size)
        log.info(
            "event=resumed_at_other_world_size job=%s rank=%d step=%d saved_world_size=%d "
            "world_size=%d rng_seed=%d",
            self.job,
            self.rank,
            step,
            manifest.world_size,
            self.world_size,
            seed,
        )

    def _agree_latest(self) -> tuple[int, Manifest] | None:
        """Rank 0 verifies and picks; every rank loads the step it broadcasts (shared FS).
        A checkpoint of another job makes every rank raise `ForeignCheckpoint`."""
        step = -1
        foreign: ForeignCheckpoint | None = None
        if self.rank == 0:
            try:
                found = find_latest_good(self.ckpt_dir)
                if found is not None:
                    check_job(found[2], job=self.job, where=str(found[1]))
                elif self._s3 is not None:
                    found = self._fetch_from_s3()
            except ForeignCheckpoint as e:
                found, foreign = None, e
            if found is not None:
                step = found[0]
            elif foreign is not None:
                step = _FOREIGN
        step = self.coord.broadcast_int(step)
        if step == _FOREIGN:
            where, _, theirs = self.coord.broadcast_str(
                f"{foreign.where}\0{foreign.theirs}" if foreign is not None else ""
            ).partition("\0")
            log.error(
                "event=checkpoint_refused job=%s rank=%d other_job=%s where=%s",
                self.job,
                self.rank,
                theirs,
                where,
            )
            raise ForeignCheckpoint(where, theirs=theirs, ours=self.job)
        if step < 0:
            return None
        return step, read_manifest(self.ckpt_dir / step_dir_name(step))

    def _fetch_from_s3(self) -> tuple[int, Path, Manifest] | None:
        assert self._s3 is not None
        try:
            steps = self._s3.remote_steps()
        except Exception as e:
            log.error("event=s3_list_failed job=%s reason=%s", self.job, str(e).replace(" ", "_"))
            return None
        for step in steps:
            tmp = self.ckpt_dir / f"{step_dir_name(step)}.tmp-{secrets.token_hex(4)}"
            try:
                self._s3.download(step, tmp)
                manifest = verify_dir(tmp, expected_step=step)
            except ForeignCheckpoint:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            except (CheckpointInvalid, Exception) as e:
                log.warning(
                    "event=checkpoint_skipped source=s3 step=%d reason=%s",
                    step,
                    str(e).replace(" ", "_"),
                )
                shutil.rmtree(tmp, ignore_errors=True)
                continue
            final = self.ckpt_dir / step_dir_name(step)
            commit_dir(tmp, final)
            return step, final, manifest
        return None

    def _rollback(self, step: int) -> StepAction:
        self.writer.wait(self.checkpoint_timeout_s)
        self._collect_results()
        found = self._agree_latest()
        if found is None:
            log.error(
                "event=stop job=%s rank=%d step=%d reason=nan_no_checkpoint",
                self.job,
                self.rank,
                step,
            )
            self._events.append(("stop", {"step": step, "reason": "nan_no_checkpoint"}))
            return StepAction(stop=True, reason="nan_no_checkpoint")
        good, manifest = found
        self._load(good, manifest)
        self._bad_since_sync = False  # what was seen since came from the state just replaced
        if self.skip_batches and self.sampler is not None and hasattr(self.sampler, "mark_step"):
            self.sampler.mark_step(self.skip_batches)
        self._grad_norms.clear()
        log.warning(
            "event=nan_rollback job=%s rank=%d step=%d to_step=%d skip_batches=%d",
            self.job,
            self.rank,
            step,
            good,
            self.skip_batches,
        )
        self._events.append(
            ("nan_rollback", {"step": step, "to_step": good, "skip_batches": self.skip_batches})
        )
        return StepAction(rollback=True, reason="nan", next_step=good + 1)

    def _check_finite(self, step: int, loss: float | None, grad_norm: float | None) -> None:
        bad = (loss is not None and not math.isfinite(loss)) or (
            grad_norm is not None and not math.isfinite(grad_norm)
        )
        if bad:
            self._bad_since_sync = True
            self._events.append(("nan_loss", {"step": step, "loss": loss, "grad_norm": grad_norm}))
            now = self.clock.monotonic()
            if self._nan_logged_at is not None and now - self._nan_logged_at < _NAN_LOG_EVERY_S:
                self._nan_not_logged += 1
                return
            log.error(
                "event=nan_loss job=%s rank=%d step=%d loss=%r grad_norm=%r policy=%s "
                "not_logged_since_last=%d",
                self.job,
                self.rank,
                step,
                loss,
                grad_norm,
                self.nan_policy,
                self._nan_not_logged,
            )
            self._nan_logged_at = now
            self._nan_not_logged = 0
            return
        if grad_norm is None or self.grad_spike_factor is None:
            return
        if len(self._grad_norms) >= 5:
            median = statistics.median(self._grad_norms)
            if median > 0 and grad_norm > self.grad_spike_factor * median:
                self._bad_since_sync = True
                self._events.append(
                    ("grad_norm_spike", {"step": step, "grad_norm": grad_norm, "median": median})
                )
                log.error(
                    "event=grad_norm_spike job=%s rank=%d step=%d grad_norm=%r median=%r",
                    self.job,
                    self.rank,
                    step,
                    grad_norm,
                    median,
                )
                return
        self._grad_norms.append(grad_norm)

    def _receive_controls(self) -> None:
        for c in self.channel.poll():
            if c.job and c.job != self.job:
                log.warning("event=control_rejected job=%s other_job=%s", self.job, c.job)
                continue
            if not c.request_id or len(c.request_id.encode()) > REQUEST_ID_MAX_BYTES:
                log.warning("event=control_rejected job=%s reason=bad_request_id", self.job)
                continue
            if c.request_id in self._handled or any(r[1] == c.request_id for r in self._pending):
                continue
            log.info(
                "event=control_received job=%s rank=%d action=%s request_id=%s",
                self.job,
                self.rank,
                c.action,
                c.request_id,
            )
            self._pending.append((c.action, c.request_id))

    def _forget_request(self, request_id: str) -> None:
        self._pending = [r for r in self._pending if r[1] != request_id]
        self._handled.append(request_id)

    def _collect_results(self) -> None:
        for r in self.writer.take_results():
            self._report(r)

    def _report(self, r: SaveResult) -> None:
        if r.ok:
            self.ckpt_step = r.step
            if r.request_id:
                self.ckpt_request_id = r.request_id
            self._events.append(
                (
                    "checkpoint_committed",
                    {
                        "step": r.step,
                        "request_id": r.request_id,
                        "duration_s": r.duration_s,
                        "path": r.path,
                    },
                )
            )
        else:
            self._stale = self._stale or r.stale
            self._events.append(
                (
                    "checkpoint_failed",
                    {"step": r.step, "request_id": r.request_id, "reason": r.reason},
                )
            )

    def _send(
        self,
        *,
        step: int,
        phase: HeartbeatPhase,
        loss: float | None = None,
        grad_norm: float | None = None,
        step_time_s: float | None = None,
        compute_time_s: float | None = None,
        samples: int | None = None,
        tokens: int | None = None,
    ) -> None:
        rate_ok = step_time_s is not None and step_time_s > 0
        base: dict[str, Any] = {
            "job": self.job,
            "rank": self.rank,
            "step": self._last_step if step < 0 else step,
            "t": self.clock.now(),
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "pid": self.pid,
            "loss": loss,
            "grad_norm": grad_norm,
            "samples_per_s": samples / step_time_s if rate_ok and samples else None,  # type: ignore[operator]
            "tokens_per_s": tokens / step_time_s if rate_ok and tokens else None,  # type: ignore[operator]
            "step_time_s": step_time_s,
            "compute_time_s": compute_time_s,
            "phase": phase,
            "ckpt_step": self.ckpt_step,
            "ckpt_request_id": self.ckpt_request_id,
            "control_socket": self.channel.control_socket,
        }
        events, self._events = self._events, []
        if not events:
            self.channel.send_plain(base)
            return
        # One edge event per datagram; the level fields repeat in each.
        for name, data in events:
            self.channel.send(Heartbeat(**base, event=name, event_data=data))

    # --- SIGTERM --------------------------------------------------------------------------

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self._sigterm_at is not None:
            return
        self._sigterm_at = self.clock.monotonic()
        log.warning(
            "event=sigterm job=%s rank=%d grace_s=%.1f", self.job, self.rank, self.sigterm_grace_s
        )
        if self.sigterm_hard_exit:
            # Runs past close(): the grace bounds the whole exit, interpreter shutdown included.
            self._hard_exit_timer = GraceWatchdog(
                grace_s=self.sigterm_grace_s,
                describe=lambda: f"job={self.job} rank={self.rank} latest_step={self.ckpt_step}",
            )
            self._hard_exit_timer.start()

    def _take_compute_time(self) -> float | None:
        """This step's compute() time (None if it used none); on CUDA the newest step whose
        events have completed, without waiting for the GPU."""
        if not self._compute_cuda:
            took, self._compute_s = self._compute_s, None
            return took
        if self._compute_events:
            self._compute_pending.append((self._compute_events, self._compute_extra_s))
            self._compute_events, self._compute_extra_s = [], 0.0
        while self._compute_pending and all(e.query() for _, e in self._compute_pending[0][0]):
            pairs, extra_s = self._compute_pending.popleft()
            self._compute_last_s = extra_s + sum(a.elapsed_time(b) for a, b in pairs) / 1000.0
        if len(self._compute_pending) > 8:  # a GPU far behind: never hold events unbounded
            self._compute_pending.popleft()
        took, self._compute_last_s = self._compute_last_s, None
        return took


_stack_dump_registered = False


def _register_stack_dump() -> None:
    """SIGUSR1 -> every thread's Python stack on stderr (faulthandler, in C: it works while
    the loop is stuck in a collective). The agent's `collect_stacks` sends it. It stays
    registered for the life of the process: SIGUSR1's default action kills, and a dump
    request racing with close() must never do that. A handler the program installed itself
    is left alone."""
    global _stack_dump_registered
    if _stack_dump_registered:
        return
    if signal.getsignal(signal.SIGUSR1) not in (signal.SIG_DFL, None):
        log.info("event=stack_dump_not_registered reason=sigusr1_handler_exists")
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
    except (AttributeError, ValueError, OSError, RuntimeError) as e:
        # stderr without a file descriptor (embedded interpreters, some test runners)
        log.info("event=stack_dump_not_registered reason=%r", str(e))
        return
    _stack_dump_registered = True


def _as_float(v: float | torch.Tensor | None) -> float | None:
    if v is None:
        return None
    if isinstance(v, torch.Tensor):
        return float(v.detach().item())
    return float(v)
