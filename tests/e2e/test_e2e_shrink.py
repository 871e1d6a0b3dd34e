"""A job that may shrink its world size (`shrink: world`) on a real local cluster: its node
dies with no spare free, it continues from the checkpoint on fewer ranks and finishes, and the
sample indices every rank consumed (examples/train.py --log-samples) cover each sample of an
epoch exactly once across the change of world size."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.chaos import new_incidents, now
from trainguard.devkit.devcluster import REPO_ROOT, ClusterConfig, DevCluster

pytestmark = pytest.mark.slow
SAMPLES = 512
BATCH = 16
STEPS = 40
FAULT_STEP = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevCluster]:
    config = ClusterConfig(
        active=("node-1", "node-2"),
        spares=("spare-1",),
        safety={"drain_budget": 100, "breaker_threshold": 100},
        jobs={
            "checkpoint_timeout_s": 5,
            "stop_grace_s": 5,
            "stop_timeout_s": 10,
            "progress_timeout_s": 90,
        },
    )
    base = Path(tmp_path_factory.mktemp("shrink"))
    with DevCluster(base / "cluster", config) as c:
        c.start()
        yield c
    assert c.leftover_pids() == set()


def sample_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def consumed(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps whose samples count: every attempt's steps up to the step the next attempt
    resumed after (steps a later attempt re-did from the checkpoint are not consumed)."""
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_attempt.setdefault(r["attempt"], []).append(r)
    attempts = sorted(by_attempt)
    out = []
    for i, a in enumerate(attempts):
        later = [min(r["step"] for r in by_attempt[b]) for b in attempts[i + 1 :]]
        limit = min(later) if later else STEPS + 1
        out += [r for r in by_attempt[a] if r["step"] < limit]
    return out


def test_node_death_with_no_spare_shrinks_the_world_and_every_sample_is_seen_once(
    cluster: DevCluster,
) -> None:
    c = cluster
    c.api("POST", "/v1/nodes/spare-1/drain", json={"reason": "no spare free for this test"})
    samples_log = c.run_dir / "samples.jsonl"
    spec = {
        "name": "shrink",
        "command": [
            "examples/train.py", "--steps", str(STEPS), "--checkpoint-every", "5",
            "--step-time-s", "0.2", "--seed", "0", "--samples", str(SAMPLES),
            "--batch-size", str(BATCH), "--log-samples", str(samples_log),
        ],
        "nodes": ["node-1", "node-2"],
        "nproc_per_node": 1,
        "min_nodes": 1,
        "shrink": "world",
        "ckpt_dir": str(c.run_dir / "ckpt" / "shrink"),
        "cwd": str(REPO_ROOT),
        "max_restarts": 3,
    }  # fmt: skip
    c.submit_job(spec)
    c.wait_job(
        "shrink",
        lambda j: j["state"] == "running" and (j.get("last_step") or 0) >= FAULT_STEP,
        timeout_s=90,
        what=f"job at step {FAULT_STEP}",
    )
    since = now()
    c.kill_node("node-2")
    view = c.wait_job(
        "shrink",
        lambda j: j["state"] in ("completed", "failed"),
        timeout_s=150,
        what="the job to finish",
    )
    assert view["state"] == "completed", view
    assert view["last_step"] == STEPS and view["restarts"] == 1, view
    assert (view["world_size"], view["full_world_size"]) == (1, 2), view
    assert view["nodes"] == ["node-1"], view

    # the incident says what it did
    incidents = new_incidents(c, since)
    messages = [e["message"] for i in incidents for e in c.incident(i["id"])["timeline"]]
    assert any("shrunk from 2 to 1 ranks" in m for m in messages), messages

    # data position: attempt 1 ran at world 2, attempt 2 at world 1 from its checkpoint
    records = sample_records(samples_log)
    worlds = {r["attempt"]: r["world"] for r in records}
    assert worlds == {1: 2, 2: 1}, worlds
    used = consumed(records)
    steps = Counter(r["step"] for r in used)
    assert sorted(steps) == list(range(1, STEPS + 1))
    by_epoch: dict[int, Counter[int]] = {}
    for r in used:
        by_epoch.setdefault(r["epoch"], Counter()).update(r["indices"])
    assert sorted(by_epoch) == [0, 1], sorted(by_epoch)
    # epoch 0 complete, each sample once; epoch 1 partial, no sample twice
    assert by_epoch[0] == Counter(range(SAMPLES)), sorted(
        (i, n) for i, n in by_epoch[0].items() if n != 1
    )[:10]
    assert max(by_epoch[1].values()) == 1
