"""A checkpoint written by 3 ranks resumes on 2 and on 4 (real gloo process groups, DDP on
CPU): model, optimizer and scheduler hold exactly what was saved on every rank, and the ranks
of the new world together see exactly the samples of the epoch not seen before, each once."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.gloo_ranks import Ranks, assert_same_state

WORKER = Path(__file__).with_name("trainer_elastic_worker.py")
SAMPLES = 480
WRITE_STEPS = 4  # 3 ranks x 2 samples x 4 steps = 24 seen; the 456 left divide by 2 and 4
pytestmark = pytest.mark.slow


@pytest.fixture
def ranks_left() -> Iterator[list[Ranks]]:
    started: list[Ranks] = []
    yield started
    for r in started:
        r.kill()


def launch(
    tmp_path: Path, started: list[Ranks], *, phase: str, world: int, out: Path
) -> list[dict[str, Any]]:
    ranks = Ranks(
        WORKER,
        ["--phase", phase, "--out", str(out), "--ckpt-dir", str(tmp_path / "ck"),
         "--steps", str(WRITE_STEPS)],
        world_size=world,
        workdir=tmp_path,
    )  # fmt: skip
    started.append(ranks)
    assert ranks.wait() == [0] * world, ranks.output()
    return [json.loads((out / f"{phase}-rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("new_world", [2, 4], ids=["3-to-2-ranks", "3-to-4-ranks"])
def test_checkpoint_of_three_ranks_resumes_on_another_world_size(
    tmp_path: Path, ranks_left: list[Ranks], new_world: int
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    written = launch(tmp_path, ranks_left, phase="write", world=3, out=out)
    seen_before = [i for w in written for i in w["seen"]]
    assert len(seen_before) == 3 * 2 * WRITE_STEPS
    assert {w["samples_done"] for w in written} == {len(seen_before)}

    resumed = launch(tmp_path, ranks_left, phase="resume", world=new_world, out=out)
    assert {r["start"] for r in resumed} == {WRITE_STEPS + 1}

    saved = torch.load(out / "write-state-rank0.pt", weights_only=True)
    for r in range(new_world):
        loaded = torch.load(out / f"resume-state-rank{r}.pt", weights_only=True)
        assert_same_state(loaded["model"], saved["model"], f"rank {r} model")
        assert_same_state(loaded["optim"], saved["optim"], f"rank {r} optimizer")
        assert loaded["sched"] == saved["sched"], f"rank {r} scheduler"

    # The rest of the epoch, on the new world: exactly the unseen samples, each once.
    seen_after = [i for r in resumed for i in r["seen"]]
    assert Counter(seen_before + seen_after) == Counter(range(SAMPLES))
    left = (SAMPLES - len(seen_before)) // new_world
    assert all(r["len_sampler_at_start"] == left for r in resumed)  # len() = rest of epoch
    assert all(r["epoch_at_start"] == 0 and r["epoch_at_end"] == 1 for r in resumed)
