"""What one warm standby costs on a spare node: start to ready, resident memory and CPU while
it waits for an assignment (agent/standby.py, trainer/standby_child.py).

    .venv/bin/python bench/standby_cost.py [--module trainer_ddp_rejoin] [--idle-s 20]

The default entry module is examples/trainer_ddp_rejoin.py (imports torch and trainguard's
trainer). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from trainguard.agent.config import StandbyConfig
from trainguard.agent.standby import ProcessLauncher, StandbyPool

REPO = Path(__file__).resolve().parents[1]
TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S  # utime + stime


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--module", default="trainer_ddp_rejoin")
    p.add_argument("--cwd", default=str(REPO / "examples"))
    p.add_argument("--idle-s", type=float, default=20.0)
    args = p.parse_args()
    with TemporaryDirectory() as tmp:
        config = StandbyConfig(enabled=True, module=args.module, cwd=args.cwd)
        launcher = ProcessLauncher(work_dir=Path(tmp))
        pool = StandbyPool(config=config, launcher=launcher)
        try:
            pool.tick(spare=True)
            deadline = time.monotonic() + 120
            while not pool.is_ready:
                if time.monotonic() > deadline:
                    raise SystemExit(f"not ready: {launcher.output_tail()}")
                time.sleep(0.05)
                pool.tick(spare=True)
            assert launcher.proc is not None
            pid = launcher.proc.pid
            cpu0 = cpu_s(pid)
            time.sleep(args.idle_s)
            idle_cpu = (cpu_s(pid) - cpu0) / args.idle_s
            print(
                json.dumps(
                    {
                        "module": args.module,
                        "ready_s": round(pool.ready_s or 0.0, 2),
                        "rss_mib": round(rss_bytes(pid) / 2**20, 1),
                        "idle_cpu_percent": round(100 * idle_cpu, 3),
                        "idle_s": args.idle_s,
                    }
                )
            )
        finally:
            pool.close()


if __name__ == "__main__":
    main()
