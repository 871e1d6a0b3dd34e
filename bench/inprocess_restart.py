"""Recovery from a killed rank: in-process rejoin with state from a peer vs a full restart.

A 2-rank gloo DDP job (examples/trainer_ddp_rejoin.py, CPU) trains; rank 1 completes step K
and is killed -9. In-process: rank 0 stays in its process, a warm standby (interpreter, torch
and the job's model already loaded) takes rank 1's place under the next attempt epoch and
gets the state from rank 0 by broadcast. Full restart (today's path): both ranks end and two
fresh processes resume from the newest checkpoint. The world is re-formed the moment the
kill is done (detection by the controller is not part of this figure). Reported per case:
the time from the kill to the first step completed after recovery (median over --runs),
the steps lost, and for in-process where the time goes (detect, rejoin, state, first step).

    .venv/bin/python bench/inprocess_restart.py --runs 5
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.helpers import free_port, wait_for
from tests.integration.rejoin_world import World

PAUSE_AT = 12
STEPS = 20
_TS = re.compile(r"^(\d+\.\d+) (.*)$")


def stamps(log: Path) -> list[tuple[float, str]]:
    out = []
    for line in log.read_text().splitlines():
        m = _TS.match(line)
        if m:
            out.append((float(m.group(1)), m.group(2)))
    return out


def first(events: list[tuple[float, str]], text: str) -> float:
    return next(t for t, line in events if text in line)


def in_process(workdir: Path) -> dict[str, float]:
    w = World(workdir, job="bench", port=free_port(), steps=STEPS)
    try:
        survivor = w.start("r0", membership=w.membership(rank=0, world_size=2, epoch=1))
        w.start(
            "r1",
            membership=w.membership(rank=1, world_size=2, epoch=1),
            extra=["--pause-at", str(PAUSE_AT)],
        )
        standby = w.start("standby", membership=None)
        wait_for(lambda: PAUSE_AT in w.losses("r1"), timeout_s=120, what="rank 1 at step K")
        killed = time.time()
        w.kill("r1")
        w.publish(survivor, w.membership(rank=0, world_size=2, epoch=2))
        w.publish(standby, w.membership(rank=1, world_size=2, epoch=2))
        assert w.wait("r0", 120) == 0 and w.wait("standby", 120) == 0, w.output()
        rows = w.rows("r0")
        resumed = min(r["step"] for r in rows if r["time"] > killed)
        first_step = next(r["time"] for r in rows if r["step"] == resumed)
        ev = stamps(w.log("r0"))
        detected = first(ev, "peer lost")
        rejoined = first(ev, "event=rejoined")
        state = first(ev, "event=state_from_peer")
        return {
            "mttr_s": first_step - killed,
            "lost_steps": PAUSE_AT + 1 - resumed,
            "detect_s": detected - killed,
            "rejoin_s": rejoined - detected,
            "state_s": state - rejoined,
            "first_step_s": first_step - state,
        }
    finally:
        w.close()


def full_restart(workdir: Path) -> dict[str, float]:
    w = World(workdir, job="bench", port=free_port(), steps=STEPS)
    try:
        full = ["--full-restart"]
        w.start("r0", membership=w.membership(rank=0, world_size=2, epoch=1), extra=full)
        w.start(
            "r1",
            membership=w.membership(rank=1, world_size=2, epoch=1),
            extra=[*full, "--pause-at", str(PAUSE_AT)],
        )
        wait_for(lambda: PAUSE_AT in w.losses("r1"), timeout_s=120, what="rank 1 at step K")
        killed = time.time()
        w.kill("r1")
        w.kill("r0")  # a full restart stops every rank of the attempt
        for r in range(2):
            w.start(f"new{r}", membership=w.membership(rank=r, world_size=2, epoch=2), extra=full)
        assert w.wait("new0", 120) == 0 and w.wait("new1", 120) == 0, w.output()
        rows = w.rows("new0")
        return {
            "mttr_s": rows[0]["time"] - killed,
            "lost_steps": PAUSE_AT + 1 - rows[0]["step"],
        }
    finally:
        w.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    results: dict[str, list[dict[str, float]]] = {"in_process": [], "full_restart": []}
    for i in range(args.runs):
        for name, case in (("in_process", in_process), ("full_restart", full_restart)):
            with tempfile.TemporaryDirectory(prefix=f"tg-ipr-{name}-{i}-") as d:
                r = case(Path(d))
            results[name].append(r)
            print(json.dumps({"case": name, "run": i, **{k: round(v, 3) for k, v in r.items()}}))
    for name, runs in results.items():
        med = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
        print(json.dumps({"case": name, "median_of": len(runs), **med}))


if __name__ == "__main__":
    main()
