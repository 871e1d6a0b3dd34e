"""Reaction bounded in time: with real gloo process groups (3 ranks, DDP on CPU), a checkpoint
request, a stop request, a NaN and a SIGTERM that reach one rank only are acted on by every
rank at the same step, within max(2 steps, 1 s) of their arrival.

The bound is checked in steps: the library keeps an agreement interval of at most
(1 s / 2) / step time, and an event waits at most two intervals, so with steps of at least
STEP_S seconds it is acted on within max(2, floor(1 s / STEP_S)) step() calls.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.gloo_ranks import Ranks
from trainguard.trainer.manifest import find_latest_good

WORKER = Path(__file__).with_name("trainer_reaction_worker.py")
STEP_S = 0.1
BOUND_CALLS = max(2, math.floor(1.0 / STEP_S))
WORLD = 3
pytestmark = pytest.mark.slow


@pytest.fixture
def ranks_left() -> Iterator[list[Ranks]]:
    started: list[Ranks] = []
    yield started
    for r in started:
        r.kill()


def run(tmp_path: Path, plan: str, started: list[Ranks]) -> list[list[dict[str, Any]]]:
    out = tmp_path / "out"
    out.mkdir()
    ranks = Ranks(
        WORKER,
        ["--out", str(out), "--ckpt-dir", str(tmp_path / "ck"), "--step-s", str(STEP_S),
         "--plan", plan],
        world_size=WORLD,
        workdir=tmp_path,
    )  # fmt: skip
    started.append(ranks)
    assert ranks.wait() == [0] * WORLD, ranks.output()
    return [
        [json.loads(ln) for ln in (out / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(WORLD)
    ]


def acted(records: list[dict[str, Any]], after_call: int, what: str) -> dict[str, Any]:
    """The first call after `after_call` whose result is `what`."""
    for rec in records:
        if rec["call"] <= after_call:
            continue
        if (
            (what == "rollback" and rec["rollback"])
            or (what == "checkpoint" and rec["checkpoint_started"] and rec["request_id"])
            or (what in ("stop", "sigterm") and rec["stop"] and rec["reason"] == what)
        ):
            return rec
    raise AssertionError(f"no {what} after call {after_call}: {records[-3:]}")


def assert_same_call_within_bound(
    per_rank: list[list[dict[str, Any]]], *, injected: int, what: str
) -> dict[str, Any]:
    got = [acted(records, injected, what) for records in per_rank]
    assert len({(g["call"], g["step"]) for g in got}) == 1, f"{what} at different steps: {got}"
    delay = got[0]["call"] - injected
    assert 1 <= delay <= BOUND_CALLS, f"{what} acted {delay} calls after it arrived: {got[0]}"
    return got[0]


def test_checkpoint_nan_and_stop_reaching_one_rank_are_acted_on_by_all_at_one_step_within_bound(
    tmp_path: Path, ranks_left: list[Ranks]
) -> None:
    per_rank = run(tmp_path, "checkpoint@14:2,nan@27:1,stop@44:1", ranks_left)
    ckpt = assert_same_call_within_bound(per_rank, injected=14, what="checkpoint")
    assert ckpt["request_id"] == "checkpoint-14"
    rb = assert_same_call_within_bound(per_rank, injected=27, what="rollback")
    assert rb["reason"] == "nan"
    stop = assert_same_call_within_bound(per_rank, injected=44, what="stop")
    assert stop["request_id"] == "stop-44"
    # Every rank ran exactly the same calls at the same steps, and stopped together.
    assert len({tuple((r["call"], r["step"]) for r in records) for records in per_rank}) == 1
    # The requested checkpoint committed (nothing after it is newer than the rollback target).
    assert (tmp_path / "ck" / f"step_{ckpt['step']:06d}" / "manifest.json").exists()


def test_sigterm_reaching_one_rank_stops_all_at_one_step_within_bound(
    tmp_path: Path, ranks_left: list[Ranks]
) -> None:
    per_rank = run(tmp_path, "sigterm@23:1", ranks_left)
    stop = assert_same_call_within_bound(per_rank, injected=23, what="sigterm")
    assert all(records[-1]["call"] == stop["call"] for records in per_rank)
    found = find_latest_good(tmp_path / "ck")
    assert found is not None and found[0] == stop["step"]  # the emergency checkpoint
