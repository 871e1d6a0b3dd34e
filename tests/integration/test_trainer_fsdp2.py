"""FSDP2 (`fully_shard`, DTensor state) checkpoints end to end, on real gloo process groups
over a CPU device mesh: periodic checkpoints commit; a job killed with SIGKILL mid-run
resumes from the newest committed step and its losses from there equal the uninterrupted
run's bitwise; a checkpoint of 2 ranks resumes on 3 and that one on 2 again with the whole
state and the data position kept. And a tensor-parallel job (DTensor parameters without
FSDP) commits and resumes bitwise at the same world size."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import wait_for
from tests.integration.gloo_ranks import Ranks, assert_same_state
from trainguard.trainer.manifest import find_latest_good

WORKER = Path(__file__).with_name("trainer_fsdp2_worker.py")
pytestmark = pytest.mark.slow


@pytest.fixture
def ranks_left() -> Iterator[list[Ranks]]:
    started: list[Ranks] = []
    yield started
    for r in started:
        r.kill()


def start(
    tmp_path: Path, started: list[Ranks], *, world: int, ckpt: str, tag: str, args: list[str]
) -> Ranks:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    ranks = Ranks(
        WORKER,
        ["--out", str(out), "--ckpt-dir", str(tmp_path / ckpt), "--tag", tag, *args],
        world_size=world,
        workdir=tmp_path,
    )
    started.append(ranks)
    return ranks


def finish(tmp_path: Path, ranks: Ranks, *, tag: str, world: int) -> dict[str, Any]:
    assert ranks.wait() == [0] * world, ranks.output()
    return dict(json.loads((tmp_path / "out" / f"{tag}.json").read_text()))


def losses(tmp_path: Path, tag: str, rank: int) -> dict[int, float]:
    path = tmp_path / "out" / f"losses-{tag}-rank{rank}.jsonl"
    if not path.exists():
        return {}
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        if line.endswith("}"):  # a line cut by the kill is not a step
            row = json.loads(line)
            out[int(row["step"])] = float(row["loss"])
    return out


def test_fsdp2_job_commits_periodic_checkpoints(tmp_path: Path, ranks_left: list[Ranks]) -> None:
    ranks = start(
        tmp_path, ranks_left, world=2, ckpt="ck", tag="a",
        args=["--phase", "run", "--steps", "8", "--every", "4"],
    )  # fmt: skip
    finish(tmp_path, ranks, tag="a", world=2)
    logs = ranks.output()
    assert "checkpoint_failed" not in logs, logs
    assert logs.count("event=checkpoint_committed") == 4, logs  # steps 4 and 8, both ranks
    found = find_latest_good(tmp_path / "ck")
    assert found is not None
    step, _, manifest = found
    assert (step, manifest.format, manifest.world_size) == (8, "dcp", 2)
    assert any(name.startswith("dcp/__1_") for name in manifest.files)  # rank 1's own shard


def test_fsdp2_job_killed_mid_run_resumes_bitwise(tmp_path: Path, ranks_left: list[Ranks]) -> None:
    steps = ["--phase", "run", "--steps", "24", "--every", "4"]
    whole = start(tmp_path, ranks_left, world=2, ckpt="ck-whole", tag="whole", args=steps)
    finish(tmp_path, whole, tag="whole", world=2)
    want = [losses(tmp_path, "whole", r) for r in range(2)]
    assert all(sorted(w) == list(range(1, 25)) for w in want)

    killed = start(
        tmp_path, ranks_left, world=2, ckpt="ck", tag="killed",
        args=[*steps, "--step-sleep-s", "0.1"],
    )  # fmt: skip

    def past_step_17() -> bool:
        assert all(p.poll() is None for p in killed.procs), killed.output()
        return max(losses(tmp_path, "killed", 0), default=0) >= 17

    wait_for(past_step_17, timeout_s=240, what="rank 0 past step 17", interval_s=0.02)
    killed.kill()  # SIGKILL to every rank, wherever it is (a save may be in flight)
    assert [p.returncode for p in killed.procs] == [-9, -9], killed.output()
    found = find_latest_good(tmp_path / "ck")
    assert found is not None and found[0] >= 12, killed.output()  # save 16 waited for 12

    resumed = start(
        tmp_path, ranks_left, world=2, ckpt="ck", tag="resumed", args=[*steps, "--seed", "7"]
    )
    info = finish(tmp_path, resumed, tag="resumed", world=2)
    assert info["start"] == found[0] + 1, resumed.output()
    for r in range(2):
        got = losses(tmp_path, "resumed", r)
        assert sorted(got) == list(range(found[0] + 1, 25)), f"rank {r}: {sorted(got)}"
        # bitwise: the floats compare equal
        assert got == {s: want[r][s] for s in got}, f"rank {r}: {got} != {want[r]}"
        before = losses(tmp_path, "killed", r)
        assert before == {s: want[r][s] for s in before}, f"rank {r} before the kill"


def test_fsdp2_checkpoint_resumes_on_three_ranks_and_back_on_two(
    tmp_path: Path, ranks_left: list[Ranks]
) -> None:
    out = tmp_path / "out"
    infos: list[dict[str, Any]] = []
    saved_by: tuple[str, int] | None = None
    for tag, world, steps in (("w2", 2, 4), ("s3", 3, 3), ("s2", 2, 3)):
        ranks = start(
            tmp_path, ranks_left, world=world, ckpt="ck", tag=tag,
            args=["--phase", "switch", "--steps", str(steps), "--seed", str(len(infos))],
        )  # fmt: skip
        info = finish(tmp_path, ranks, tag=tag, world=world)
        assert "checkpoint_failed" not in ranks.output(), ranks.output()
        if saved_by is not None:
            prev_tag, prev_world = saved_by
            assert info["start"] == infos[-1]["start"] + int(infos[-1]["steps"])
            assert info["samples_done_at_start"] == infos[-1]["samples_done"]
            saved = torch.load(out / f"{prev_tag}-saved-rank0.pt", weights_only=True)
            for r in range(prev_world):  # every rank of the saving job held the same state
                other = torch.load(out / f"{prev_tag}-saved-rank{r}.pt", weights_only=True)
                assert_same_state(other, saved, f"{prev_tag} rank {r}")
            for r in range(world):
                loaded = torch.load(out / f"{tag}-loaded-rank{r}.pt", weights_only=True)
                assert_same_state(loaded["model"], saved["model"], f"{tag} rank {r} model")
                assert_same_state(loaded["optim"], saved["optim"], f"{tag} rank {r} optimizer")
                assert loaded["sched"] == saved["sched"], f"{tag} rank {r} scheduler"
        info["steps"] = steps
        infos.append(info)
        saved_by = (tag, world)
    # The data position: each job went on with the samples of the epoch not yet seen.
    seen = [i for info in infos for rank_seen in info["seen"] for i in rank_seen]
    assert len(seen) == 2 * 2 * 4 + 3 * 2 * 3 + 2 * 2 * 3
    assert len(set(seen)) == len(seen)
    assert infos[-1]["samples_done"] == len(seen)


def test_tensor_parallel_job_commits_and_resumes_bitwise(
    tmp_path: Path, ranks_left: list[Ranks]
) -> None:
    tp = ["--phase", "run", "--parallel", "tp", "--every", "4"]
    whole = start(
        tmp_path, ranks_left, world=2, ckpt="ck-whole", tag="whole", args=[*tp, "--steps", "12"]
    )
    finish(tmp_path, whole, tag="whole", world=2)
    first = start(tmp_path, ranks_left, world=2, ckpt="ck", tag="part", args=[*tp, "--steps", "8"])
    finish(tmp_path, first, tag="part", world=2)
    assert "checkpoint_failed" not in first.output(), first.output()
    found = find_latest_good(tmp_path / "ck")
    assert found is not None and found[0] == 8 and found[2].format == "dcp"
    again = start(
        tmp_path, ranks_left, world=2, ckpt="ck", tag="again",
        args=[*tp, "--steps", "12", "--seed", "7"],
    )  # fmt: skip
    assert finish(tmp_path, again, tag="again", world=2)["start"] == 9
    for r in range(2):
        want = losses(tmp_path, "whole", r)
        got = losses(tmp_path, "again", r)
        assert sorted(got) == [9, 10, 11, 12]
        assert got == {s: want[s] for s in got}, f"rank {r}"
