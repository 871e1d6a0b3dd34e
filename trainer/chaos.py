"""Chaos injection for the trainer library: `TRAINGUARD_CHAOS` parsed strictly, and the
`StepHook` that injects its faults into one rank (`chaos_hooks`).

Off unless the env var (or `Trainguard(chaos=...)`) is set; without rules no hook is installed,
so the step path makes no calls into this module. Grammar (comma-separated rules, each
optionally scoped):

    slow=0.2@rank1          this rank sleeps an extra 20 % of its measured work, every step
                            (of the time in `Trainguard.compute()` blocks when the loop uses
                            them, else of its step time)
    slow=0.5@step10:rank1   the same from step 10 on (in the first attempt only, like every
                            step-scoped rule: the replacement node is not slow)
    hang@step30:rank2       rank 2 blocks forever at step 30 (a stuck collective, a dead GPU)
    raise@step25            every rank raises ChaosError at step 25
    nan@step17:rank0        the loss at step 17 is NaN and the model's first float parameter
                            is filled with NaN, so the state really is non-finite
    pause_write@step20      the checkpoint writer for step 20 stops after creating its
                            temporary directory and waits forever (a kill -9 mid-write test)

A scope is `@stepK`, `@rankR`, `@stepK:rankR` (or `:rankR` after a step). Each step-scoped
rule fires once per process, and only in the job's first attempt (`TRAINGUARD_ATTEMPT` unset
or 1): the restart a fault triggers inherits the same env and resumes before step K, and
firing again there would turn one injected fault into a crash loop. `slow` without a step
holds in every attempt. A bad spec raises ChaosSpecError at start, naming the rule.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Literal

import torch

from trainguard.clock import Clock
from trainguard.trainer.hooks import StepHook

__all__ = [
    "ChaosError",
    "ChaosHook",
    "ChaosRule",
    "ChaosSpecError",
    "chaos_hooks",
    "for_attempt",
    "parse_chaos",
]

log = logging.getLogger("trainguard.trainer")

ChaosKind = Literal["slow", "hang", "raise", "nan", "pause_write"]
_KINDS: tuple[str, ...] = ("slow", "hang", "raise", "nan", "pause_write")
_NEEDS_STEP = {"hang", "raise", "nan", "pause_write"}

_RULE = re.compile(
    r"^(?P<kind>[a-z_]+)(?:=(?P<value>[^@:]+))?"
    r"(?:@(?P<scope>(?:step\d+|rank\d+)(?::(?:step\d+|rank\d+))?))?$"
)


class ChaosSpecError(ValueError):
    """`TRAINGUARD_CHAOS` could not be parsed; the message names the rule and the reason."""


class ChaosError(RuntimeError):
    """Raised on purpose by a `raise@stepK` chaos rule."""


@dataclass(frozen=True)
class ChaosRule:
    kind: ChaosKind
    step: int | None = None  # `slow`: from this step on (None: every step); others: at it
    rank: int | None = None  # None: every rank
    fraction: float = 0.0  # `slow`: extra sleep as a fraction of the measured work

    def applies(self, *, step: int, rank: int) -> bool:
        if self.rank is not None and self.rank != rank:
            return False
        if self.step is None:
            return True
        return step >= self.step if self.kind == "slow" else step == self.step


def parse_chaos(spec: str) -> tuple[ChaosRule, ...]:
    """Parse a chaos spec; an empty spec means no rules."""
    rules: list[ChaosRule] = []
    for raw in spec.split(","):
        text = raw.strip()
        if not text:
            continue
        m = _RULE.match(text)
        if m is None:
            raise ChaosSpecError(
                f"TRAINGUARD_CHAOS rule {text!r}: expected KIND[=VALUE][@stepK][:rankR], "
                f"KIND one of {', '.join(_KINDS)}"
            )
        kind = m.group("kind")
        if kind not in _KINDS:
            raise ChaosSpecError(
                f"TRAINGUARD_CHAOS rule {text!r}: unknown kind {kind!r} "
                f"(expected one of {', '.join(_KINDS)})"
            )
        step: int | None = None
        rank: int | None = None
        for part in (m.group("scope") or "").split(":"):
            if not part:
                continue
            name = "step" if part.startswith("step") else "rank"
            number = int(part[4:])
            if name == "step":
                if step is not None:
                    raise ChaosSpecError(f"TRAINGUARD_CHAOS rule {text!r}: step given twice")
                step = number
            else:
                if rank is not None:
                    raise ChaosSpecError(f"TRAINGUARD_CHAOS rule {text!r}: rank given twice")
                rank = number
        value = m.group("value")
        fraction = 0.0
        if kind == "slow":
            if value is None:
                raise ChaosSpecError(
                    f"TRAINGUARD_CHAOS rule {text!r}: slow needs a fraction, e.g. slow=0.2"
                )
            try:
                fraction = float(value)
            except ValueError:
                raise ChaosSpecError(
                    f"TRAINGUARD_CHAOS rule {text!r}: slow fraction {value!r} is not a number"
                ) from None
            if not 0.0 < fraction <= 100.0:
                raise ChaosSpecError(
                    f"TRAINGUARD_CHAOS rule {text!r}: slow fraction must be in (0, 100]"
                )
        elif value is not None:
            raise ChaosSpecError(f"TRAINGUARD_CHAOS rule {text!r}: {kind} takes no value")
        if kind in _NEEDS_STEP and step is None:
            raise ChaosSpecError(f"TRAINGUARD_CHAOS rule {text!r}: {kind} needs @stepK")
        rules.append(ChaosRule(kind=kind, step=step, rank=rank, fraction=fraction))  # type: ignore[arg-type]
    return tuple(rules)


def for_attempt(rules: tuple[ChaosRule, ...], attempt: str | None) -> tuple[ChaosRule, ...]:
    """The rules that apply in the job attempt `attempt` (the `TRAINGUARD_ATTEMPT` value;
    None or empty outside a managed job): step-scoped rules only in attempt 1."""
    if not attempt:
        return rules
    try:
        number = int(attempt)
    except ValueError:
        raise ChaosSpecError(f"TRAINGUARD_ATTEMPT {attempt!r} is not an integer") from None
    if number <= 1:
        return rules
    return tuple(r for r in rules if r.step is None)


def chaos_hooks(
    *,
    rules: tuple[ChaosRule, ...],
    rank: int,
    job: str,
    model: torch.nn.Module,
    clock: Clock,
) -> tuple[StepHook, ...]:
    """The hooks that inject the faults of `rules` (parsed, `for_attempt` applied) into rank
    `rank`: one `ChaosHook`, or none at all when there are no rules."""
    if not rules:
        return ()
    return (ChaosHook(rules=rules, rank=rank, job=job, model=model, clock=clock),)


class ChaosHook(StepHook):
    """Injects the faults of `rules` into one rank: raise, hang, slow and nan in the step path,
    pause_write in the checkpoint writer. Each step-scoped rule fires at most once."""

    def __init__(
        self,
        *,
        rules: tuple[ChaosRule, ...],
        rank: int,
        job: str,
        model: torch.nn.Module,
        clock: Clock,
    ) -> None:
        self.rules = rules
        self.rank = rank
        self.job = job
        self.model = model
        self.clock = clock
        self._fired: set[ChaosRule] = set()
        self._slept_s = 0.0  # the last step's `slow` sleep without compute() blocks
        self._pause_steps = frozenset(
            r.step
            for r in rules
            if r.kind == "pause_write" and r.step is not None and (r.rank is None or r.rank == rank)
        )

    def before_step(
        self, *, step: int, step_time_s: float | None, compute_used: bool
    ) -> float | None:
        if self._fires("raise", step):
            log.error("event=chaos_raise job=%s rank=%d step=%d", self.job, self.rank, step)
            raise ChaosError(f"chaos: raise at step {step} on rank {self.rank}")
        if self._fires("hang", step):
            log.error("event=chaos_hang job=%s rank=%d step=%d", self.job, self.rank, step)
            while True:
                time.sleep(3600)
        # With compute() blocks, after_compute() applies the slowdown to this rank's own work.
        if not compute_used:
            for rule in self.rules:
                if rule.kind == "slow" and rule.applies(step=step, rank=self.rank) and step_time_s:
                    work_s = max(0.0, step_time_s - self._slept_s)
                    self._slept_s = work_s * rule.fraction
                    self.clock.sleep(self._slept_s)
        if self._fires("nan", step):
            self._poison_model()
            return math.nan
        return None

    def after_compute(self, *, step: int, work_s: float) -> float:
        fraction = sum(
            r.fraction
            for r in self.rules
            if r.kind == "slow" and r.applies(step=step, rank=self.rank)
        )
        slept_s = work_s * fraction
        if slept_s:
            self.clock.sleep(slept_s)
        return slept_s

    def before_rank_file(self, *, step: int, rank: int, tmp: Path, file: BinaryIO) -> None:
        if step not in self._pause_steps:
            return
        # Stop mid-write, forever, so a test can kill -9 the trainer right here.
        file.write(b"PK partial")
        file.flush()
        log.warning("event=chaos_pause_write step=%d rank=%d dir=%s", step, rank, tmp)
        threading.Event().wait()

    def _fires(self, kind: str, step: int) -> bool:
        for rule in self.rules:
            if rule.kind == kind and rule.applies(step=step, rank=self.rank):
                if rule in self._fired:
                    continue
                self._fired.add(rule)
                return True
        return False

    def _poison_model(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.is_floating_point():
                    p.fill_(math.nan)
                    break
        log.error("event=chaos_nan job=%s rank=%d", self.job, self.rank)
