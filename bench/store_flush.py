"""Store cost per tick at N nodes, SQLite vs PostgreSQL: the freshness flush (one UPDATE per
node that reported since the last tick, one transaction) that every tick of a busy controller
pays, timed in process on each store (not run in CI).

    .venv/bin/python bench/store_flush.py --nodes 1024 [--store-url postgresql://...]

Without --store-url only SQLite (a file in a temp dir) is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.controller.records import FreshNode
from trainguard.controller.store import Store


def time_flush(store: Store, *, nodes: int, rounds: int) -> dict[str, float]:
    names = [f"node-{i:04d}" for i in range(nodes)]
    for name in names:
        store.nodes.add(name, role="active", labels={})
    times = []
    for r in range(rounds):
        batch = [
            FreshNode(name=n, last_report_at=time.time(), instance=f"i{r}", agent_version="1",
                      labels={"rack": n[-2:]})
            for n in names
        ]  # fmt: skip
        started = time.perf_counter()
        store.nodes.flush_freshness(batch)
        times.append(time.perf_counter() - started)
    return {
        "median_ms": round(statistics.median(times) * 1e3, 2),
        "max_ms": round(max(times) * 1e3, 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--store-url", default=None)
    args = p.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory(prefix="tgflush") as tmp:
        sqlite = Store(Path(tmp) / "c.db", now=time.time)
        out["sqlite"] = time_flush(sqlite, nodes=args.nodes, rounds=args.rounds)
        sqlite.close()
    if args.store_url:
        pg = Store(args.store_url, now=time.time)
        out["postgresql"] = time_flush(pg, nodes=args.nodes, rounds=args.rounds)
        pg.close()
    print(json.dumps({"nodes": args.nodes, "flush_freshness": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
