"""`TrainguardCallback`: trainguard for a PyTorch Lightning job, through Lightning's own
checkpointing (`trainer.save_checkpoint`) and stop flag (`trainer.should_stop`).

Built on `OwnCheckpointer` (integrations/own.py): the heartbeat of each optimizer step, the
step every rank agrees on for a checkpoint request, a stop request or a SIGTERM, and the
commit reported back. A save writes Lightning's checkpoint into trainguard's layout (a
`step_NNNNNN/` directory holding `lightning.ckpt` and a manifest with its sha256, committed by
one rename), so `resume_path()` returns the newest checkpoint whose checksums verify, and a
corrupt or partial one is skipped.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from trainguard import __version__
from trainguard.clock import SYSTEM_CLOCK, Clock
from trainguard.trainer.core import StepAction
from trainguard.trainer.integrations.own import OwnCheckpointer
from trainguard.trainer.manifest import (
    Manifest,
    apply_retention,
    clean_stale,
    commit_dir,
    find_latest_good,
    hash_file,
    new_tmp_dir,
    step_dir_name,
    write_manifest,
)
from trainguard.trainer.retention import RetentionPolicy
from trainguard.trainer.sampler import ResumableSampler

__all__ = ["CKPT_FILE", "TrainguardCallback"]

log = logging.getLogger("trainguard.trainer")

CKPT_FILE = "lightning.ckpt"  # Lightning's checkpoint inside a committed step directory


class TrainguardCallback(pl.Callback):
    """Add to `Trainer(callbacks=[...])` and start with `trainer.fit(model,
    ckpt_path=cb.resume_path())`.

    Steps are Lightning's `global_step` (optimizer steps, from 1); the checkpoint of step k
    holds the state after step k. A `ResumableSampler` given as `sampler` (with
    `Trainer(use_distributed_sampler=False)`) keeps the data position in the checkpoint, so a
    resume mid-epoch continues with the next batch. The callback does not save Lightning's
    random states: a model with dropout resumes with fresh ones (see docs/trainer.md).
    """

    def __init__(
        self,
        *,
        ckpt_dir: str | Path,
        checkpoint_every: int = 0,
        keep_last: int = 3,
        sampler: ResumableSampler | None = None,
        nan_policy: Literal["continue", "stop"] = "continue",
        sync_every: int | None = None,
        handle_sigterm: bool = True,
        sigterm_grace_s: float = 30.0,
        sigterm_hard_exit: bool = True,
        job: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 = keep all), got {keep_last}")
        self.ckpt_dir = Path(ckpt_dir).absolute()
        self.checkpoint_every = checkpoint_every
        self.keep_last = keep_last
        self.sampler = sampler
        self._own_kwargs: dict[str, Any] = {
            "checkpoint_every": checkpoint_every,
            "nan_policy": nan_policy,
            "sync_every": sync_every,
            "handle_sigterm": handle_sigterm,
            "sigterm_grace_s": sigterm_grace_s,
            "sigterm_hard_exit": sigterm_hard_exit,
            "job": job,
            "clock": clock,
        }
        self._clock = clock
        self.guard: OwnCheckpointer | None = None
        self._trainer: pl.Trainer | None = None
        self._loaded_step: int | None = None
        self._compute: contextlib.ExitStack | None = None
        self._lightning_sigterm: Any = None  # Lightning's handler while ours is in place
        self.last_action: StepAction | None = None  # what the newest step's call decided

    # --- resume ---------------------------------------------------------------------------

    def resume_path(self) -> str | None:
        """Lightning's checkpoint in the newest committed step directory whose checksums
        verify (a bad one is logged and skipped); None when there is none."""
        found = find_latest_good(self.ckpt_dir) if self.ckpt_dir.is_dir() else None
        if found is None:
            return None
        return str(found[1] / CKPT_FILE)

    @property
    def ckpt_step(self) -> int | None:
        return None if self.guard is None else self.guard.ckpt_step

    # --- Lightning hooks ------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.guard is not None:
            return
        self._trainer = trainer
        if trainer.is_global_zero:
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            clean_stale(self.ckpt_dir)
        # Every rank at this point: the process group exists (Lightning made it in setup).
        self.guard = OwnCheckpointer(save=self._save, model=pl_module, **self._own_kwargs)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._loaded_step = int(checkpoint.get("global_step", 0))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.guard is None:
            return
        # Lightning put its own SIGTERM handler in place after setup(): on SIGTERM it leaves
        # the loop at the next step without a checkpoint. Ours takes over (an emergency save
        # at the agreed step, then should_stop) until on_train_end puts Lightning's back, so
        # that Lightning's teardown and then close() restore the handlers in order.
        if self._own_kwargs["handle_sigterm"] and (
            threading.current_thread() is threading.main_thread()
        ):
            self._lightning_sigterm = signal.signal(signal.SIGTERM, self.guard.signals.on_sigterm)
        if self._loaded_step:
            self.guard.resumed(self._loaded_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._lightning_sigterm is not None:
            signal.signal(signal.SIGTERM, self._lightning_sigterm)
            self._lightning_sigterm = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.guard is None:
            return
        # This rank's own work: forward and loss. DDP's backward holds the gradient
        # all-reduce, where every rank waits for the slowest: not compute time.
        self._compute = contextlib.ExitStack()
        self._compute.enter_context(self.guard.compute())

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._end_compute()

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._end_compute()
        if self.guard is None:
            return
        if self.sampler is not None:
            self.sampler.mark_step()
        action = self.guard.step(
            trainer.global_step, loss=_loss_of(outputs), samples=_samples_of(batch)
        )
        self.last_action = action
        if action.stop:
            trainer.should_stop = True

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end_compute()
        if stage == "fit" and self.guard is not None:
            self.guard.close()

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()} if self.sampler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.sampler is not None and "sampler" in state_dict:
            self.sampler.load_state_dict(state_dict["sampler"])

    # --- the save --------------------------------------------------------------------------

    def _save(self, step: int) -> None:
        """Lightning's checkpoint of `step` into a temporary directory (rank 0 writes it; every
        rank takes part), checksummed and committed by rank 0; raises on every rank if the
        commit failed."""
        trainer = self._trainer
        assert trainer is not None
        tmp = new_tmp_dir(self.ckpt_dir, step)
        trainer.save_checkpoint(tmp / CKPT_FILE)  # every rank; a barrier at its end
        error: str | None = None
        if trainer.is_global_zero:
            try:
                self._commit(tmp, step)
            except Exception as e:  # any failure fails the checkpoint, on every rank
                error = f"{type(e).__name__}: {e}"
        error = trainer.strategy.broadcast(error, src=0)
        if error is not None:
            raise RuntimeError(f"lightning checkpoint of step {step} not committed: {error}")

    def _commit(self, tmp: Path, step: int) -> None:
        size, digest = hash_file(tmp / CKPT_FILE)
        trainer = self._trainer
        assert trainer is not None and self.guard is not None
        manifest = Manifest(
            step=step,
            world_size=trainer.world_size,
            format="lightning",
            files={CKPT_FILE: {"size": size, "sha256": digest}},
            created_at=self._clock.now(),
            loss_finite=True,  # a non-finite state is never saved (OwnCheckpointer)
            trainguard_version=__version__,
            job=self.guard.job,
        )
        write_manifest(tmp, manifest)
        commit_dir(tmp, self.ckpt_dir / step_dir_name(step))
        apply_retention(
            self.ckpt_dir,
            policy=RetentionPolicy(recent_last=self.keep_last),
            now=self._clock.now(),
            newest_good_step=step,
        )

    def _end_compute(self) -> None:
        if self._compute is not None:
            self._compute.close()
            self._compute = None


def _loss_of(outputs: Any) -> torch.Tensor | float | None:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    return loss if isinstance(loss, (torch.Tensor, float, int)) else None


def _samples_of(batch: Any) -> int | None:
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else None
