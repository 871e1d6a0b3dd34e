"""A job that may shrink its world size (`shrink: world`) on a real local cluster: its node
dies with no spare free, it continues from the checkpoint on fewer ranks, grows back to its
full size once the spare is free again and finishes, and the sample indices every rank
consumed (examples/train.py --log-samples) cover each sample of an epoch exactly once across
both changes of world size."""

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
STEPS = 64
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


def test_node_death_with_no_spare_shrinks_the_world_grows_back_and_every_sample_is_seen_once(
    cluster: DevCluster,
) -> None:
    c = cluster
    # spare-1's preflight ahead of need first: the grow takes it through the spare gate, and
    # a passing preflight this fresh lets it in at once (else the grow would wait for one
    # while this short job trains on, maybe to its end)
    c.wait(
        lambda: bool((c.node("spare-1").get("last_preflight") or {}).get("passed")),
        timeout_s=180,
        what="spare-1's warm preflight",
    )
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
    shrunk = c.wait_job(
        "shrink",
        lambda j: j["state"] in ("running", "completed", "failed") and j["attempt"] == 2,
        timeout_s=90,
        what="the job running shrunk (attempt 2)",
    )
    assert shrunk["state"] == "running", shrunk
    assert (shrunk["world_size"], shrunk["full_world_size"]) == (1, 2), shrunk
    # the spare is free again: the controller grows the job back on its own
    c.api("POST", "/v1/nodes/spare-1/undrain")
    view = c.wait_job(
        "shrink",
        lambda j: j["state"] in ("completed", "failed"),
        timeout_s=120,
        what="the job to finish",
    )
    assert view["state"] == "completed", view
    assert view["last_step"] == STEPS and view["attempt"] == 3, view
    assert view["restarts"] == 1, view  # the grow is no restart
    assert (view["world_size"], view["full_world_size"]) == (2, 2), view
    assert view["nodes"] == ["node-1", "spare-1"], view

    # the incident says what it did
    incidents = new_incidents(c, since)
    messages = [e["message"] for i in incidents for e in c.incident(i["id"])["timeline"]]
    assert any("shrunk from 2 to 1 ranks" in m for m in messages), messages
    assert any("grown back to 2 ranks" in m for m in messages), messages

    # data position: attempt 1 ran at world 2, attempt 2 at world 1 from its checkpoint,
    # attempt 3 at world 2 again from the grow's checkpoint
    records = sample_records(samples_log)
    worlds = {r["attempt"]: r["world"] for r in records}
    assert worlds == {1: 2, 2: 1, 3: 2}, worlds
    used = consumed(records)
    steps = Counter(r["step"] for r in used)
    assert sorted(steps) == list(range(1, STEPS + 1))
    by_epoch: dict[int, Counter[int]] = {}
    for r in used:
        by_epoch.setdefault(r["epoch"], Counter()).update(r["indices"])
    epochs = sorted(by_epoch)
    assert epochs == list(range(len(epochs))) and len(epochs) >= 2, epochs
    # every epoch but the last complete, each sample once; the last partial, no sample twice.
    # The one exception is the trainer's documented drop_last: an epoch resumed at another
    # world size splits its unseen samples over the new ranks in whole batches, and drops a
    # tail shorter than one batch of the new world (world 2 resuming at an odd number of
    # world-1 steps: 16 samples). Worked out from the log, not assumed: 0 when it divides.
    for epoch in epochs[:-1]:
        rows = [r for r in used if r["epoch"] == epoch]
        final = max(r["attempt"] for r in rows)
        before = sum(len(r["indices"]) for r in rows if r["attempt"] != final)
        dropped = (SAMPLES - before) % (worlds[final] * BATCH)
        seen = by_epoch[epoch]
        assert max(seen.values()) == 1, (epoch, [i for i, n in seen.items() if n != 1][:10])
        assert set(seen) <= set(range(SAMPLES)) and SAMPLES - len(seen) == dropped, (
            epoch,
            len(seen),
            dropped,
        )
    assert max(by_epoch[epochs[-1]].values()) == 1
