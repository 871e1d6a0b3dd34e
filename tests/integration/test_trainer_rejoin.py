"""In-process rejoin with real processes (2 gloo ranks, DDP on CPU, and a warm standby): one
rank is killed -9 mid training; the other detects the broken collective, stays in its process
and re-forms the world under the next attempt epoch with the standby, which takes model,
optimizer, scheduler and data position from the survivor by broadcast. Every loss after the
recovery equals the uninterrupted run's, bitwise, for the rank that computes it.

Killing rank 1: the survivor stays rank 0, its membership comes through the harness's store.
Killing rank 0: the survivor (rank 1) becomes rank 0 and runs the new world's store itself,
its membership a `rejoin` Control on its control socket (sent before the loss is seen, as
the agent may relay it); its heartbeats name the new rank and epoch from the first step of
the healed job."""

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
PAUSE_AT = 12  # the killed rank completes step 12 and is killed; a checkpoint is at step 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The uninterrupted run, started once for the module: every test compares with it."""
    ref = World(tmp_path_factory.mktemp("ref"), job="ref", port=free_port(), steps=STEPS)
    for r in range(2):
        ref.start(f"r{r}", membership=ref.membership(rank=r, world_size=2, epoch=1))
    yield ref
    ref.close()


def finished(ref: World) -> World:
    assert ref.wait("r0", 120) == 0 and ref.wait("r1", 120) == 0, ref.output()
    return ref


def after(losses: dict[int, str], step: int) -> dict[int, str]:
    return {s: loss for s, loss in losses.items() if s > step}


@pytest.fixture
def worlds() -> Iterator[list[World]]:
    made: list[World] = []
    yield made
    for w in made:
        w.close()


def test_survivor_rejoins_in_process_and_standby_gets_state_from_it(
    tmp_path: Path, worlds: list[World], reference: World
) -> None:
    run = World(tmp_path, job="run", port=free_port(), steps=STEPS)
    worlds.append(run)
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
    ref = finished(reference)

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


def test_rank_0_killed_the_survivor_becomes_rank_0_runs_the_store_and_feeds_the_standby(
    tmp_path: Path, worlds: list[World], reference: World
) -> None:
    run = World(tmp_path, job="run0", port=free_port(), steps=STEPS, agent=True)
    worlds.append(run)
    run.start(
        "r0",
        membership=run.membership(rank=0, world_size=2, epoch=1),
        extra=["--pause-at", str(PAUSE_AT)],
    )
    survivor = run.start(
        "r1",
        membership=run.membership(rank=1, world_size=2, epoch=1),
        extra=["--rejoin-via", "control"],
    )
    standby = run.start("standby", membership=None)

    wait_for(lambda: PAUSE_AT in run.losses("r0"), timeout_s=60, what="rank 0 at its last step")
    store_port = free_port()  # the new world's store: the survivor's own, nothing outside
    # The decision reaches the survivor before it sees the loss: kept until it waits.
    run.send_rejoin(
        survivor,
        run.membership(rank=0, world_size=2, epoch=2, port=store_port, host_store=True),
        request_id="rejoin-2",
    )
    run.kill("r0")
    run.publish(standby, run.membership(rank=1, world_size=2, epoch=2, port=store_port))

    assert run.wait("r1", 60) == 0, run.output()
    assert run.wait("standby", 60) == 0, run.output()
    ref = finished(reference)

    rows = run.rows("r1")
    assert {r["pid"] for r in rows} == {survivor}
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert {(r["rank"], r["epoch"]) for r in rows if r["step"] > PAUSE_AT} == {(0, 2)}
    # Before: rank 1's losses; after: rank 0's, whose data the renumbered survivor now reads.
    assert {s: v for s, v in run.losses("r1").items() if s <= PAUSE_AT} == {
        s: v for s, v in ref.losses("r1").items() if s <= PAUSE_AT
    }
    assert after(run.losses("r1"), PAUSE_AT) == after(ref.losses("r0"), PAUSE_AT)
    assert run.losses("standby") == after(ref.losses("r1"), PAUSE_AT)
    log = run.log("standby").read_text()
    assert "event=state_from_peer" in log and "source=0" in log, log
    assert "event=rejoin_received" in run.log("r1").read_text()
    assert read_epoch(run.ckpt_dir) == 2
    # What the controller will see: the first step of the healed job, under the new epoch.
    first = next(h for h in run.heartbeats(survivor) if h.epoch == 2 and h.phase == "train")
    assert (first.rank, first.world_size, first.step) == (0, 2, PAUSE_AT + 1)
    assert {h.epoch for h in run.heartbeats(survivor) if h.step <= PAUSE_AT} == {1}
