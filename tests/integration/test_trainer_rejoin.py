"""In-process rejoin with real processes (2 gloo ranks, DDP on CPU): rank 1 is killed -9 mid
training; rank 0 detects the broken collective, stays in its process and re-forms the world
under the next attempt epoch with a warm standby, which takes model, optimizer, scheduler and
data position from rank 0 by broadcast. Every loss after the recovery equals the
uninterrupted run's, bitwise."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_for
from tests.integration.rejoin_world import World
from trainguard.trainer.fence import read_epoch

pytestmark = pytest.mark.slow

STEPS = 30
PAUSE_AT = 12  # rank 1 completes step 12 and is killed; a checkpoint is at step 10


@pytest.fixture
def worlds(tmp_path: Path) -> Iterator[list[World]]:
    made: list[World] = []
    yield made
    for w in made:
        w.close()


def test_survivor_rejoins_in_process_and_standby_gets_state_from_it(
    tmp_path: Path, worlds: list[World]
) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir()
    run_dir.mkdir()
    ref = World(ref_dir, job="ref", port=free_port(), steps=STEPS)
    run = World(run_dir, job="run", port=free_port(), steps=STEPS)
    worlds += [ref, run]
    for r in range(2):
        ref.start(f"r{r}", membership=ref.membership(rank=r, world_size=2, epoch=1))
    survivor = run.start("r0", membership=run.membership(rank=0, world_size=2, epoch=1))
    run.start(
        "r1",
        membership=run.membership(rank=1, world_size=2, epoch=1),
        extra=["--pause-at", str(PAUSE_AT)],
    )
    standby = run.start("standby", membership=None)  # warm: torch imported, waiting

    wait_for(lambda: PAUSE_AT in run.losses("r1"), timeout_s=60, what="rank 1 at its last step")
    killed_at = time.time()
    run.kill("r1")
    run.publish(survivor, run.membership(rank=0, world_size=2, epoch=2))
    run.publish(standby, run.membership(rank=1, world_size=2, epoch=2))

    assert run.wait("r0", 60) == 0, run.output()
    assert run.wait("standby", 60) == 0, run.output()
    assert ref.wait("r0", 60) == 0 and ref.wait("r1", 60) == 0, ref.output()

    rows = run.rows("r0")
    assert {r["pid"] for r in rows} == {survivor}  # one process from first step to last
    assert [r["step"] for r in rows] == list(range(STEPS))  # no step lost, none repeated
    assert run.losses("r0") == ref.losses("r0")
    replaced = run.losses("r1") | run.losses("standby")
    assert sorted(run.losses("standby")) == list(range(PAUSE_AT + 1, STEPS))
    assert replaced == ref.losses("r1")
    log = run.log("standby").read_text()
    assert "event=state_from_peer" in log and "source=0" in log, log
    # The new epoch is the directory's: a rank of epoch 1 can never commit again.
    assert read_epoch(run.ckpt_dir) == 2
    first_after = next(r["time"] for r in rows if r["step"] == PAUSE_AT + 1)
    print(f"kill -> first step after in-process recovery: {first_after - killed_at:.2f} s")
