"""`checkpoint_every="auto"` with real gloo process groups (2 ranks): the controller's
`set_interval` reaching one rank switches both at the same step, once, even when the same
request (one decision, one id) arrives again on either rank."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.integration.gloo_ranks import Ranks

WORKER = Path(__file__).with_name("trainer_auto_interval_worker.py")
WORLD = 2
pytestmark = pytest.mark.slow


def test_a_set_interval_reaching_one_rank_switches_every_rank_at_the_same_step_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # the controller's launch environment: auto, every 5 steps until it says otherwise
    monkeypatch.setitem(os.environ, "TRAINGUARD_CHECKPOINT_INTERVAL", "auto:5")
    ranks = Ranks(
        WORKER,
        ["--out", str(out), "--ckpt-dir", str(tmp_path / "ck")],
        world_size=WORLD,
        workdir=tmp_path,
    )
    try:
        assert ranks.wait(60) == [0] * WORLD, ranks.output()
    finally:
        ranks.kill()
    per_rank = [
        [json.loads(ln) for ln in (out / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(WORLD)
    ]
    assert per_rank[0] == per_rank[1], "the ranks disagree on the interval or the saves"
    records = per_rank[0]
    switched = [r["call"] for r in records if r["every"] == 4]
    assert switched, records
    first = switched[0]
    # sent after call 6 (rank 1 only): acted on at the next agreement, and never undone
    assert 7 <= first <= 8, records
    assert switched == list(range(first, len(records) + 1))
    assert all(r["every"] == 5 for r in records if r["call"] < first)
    saves = [r["call"] for r in records if r["checkpoint_started"]]
    assert saves == [c for c in range(1, len(records) + 1) if c % (4 if c > first else 5) == 0]
