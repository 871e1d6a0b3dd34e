"""Controller failover: how long a standby takes to lead and act after the leader dies, and
what a failover mid-remediation adds to a DBE's MTTR (not run in CI).

    .venv/bin/python bench/failover.py [--runs 5] [--lease-s 3] [--baselines 3]
        [--boundaries notify,checkpoint,drain,replace,restart] [--no-stop]

A local PostgreSQL server (tests/integration/postgres_proc.py: Debian's postgresql-15), two
controllers on it (ha.enabled, each its own advertise_url) and sim agents given both URLs
(tests/e2e/ha_cluster.py), real torchrun jobs (examples/train.py, 3 ranks).

Failover time, `--runs` times: a notify-only incident (a pending row remap) on an idle node,
its trigger held unanswered at the webhook receiver, the leader killed -9 while it waits on
it. Measured from the kill (unix time taken just before the signal) to the standby's
`event=leader` line (it leads) and to its first step that succeeded (the notify step it
resumed: it acts), both from its log stamps; and to every node reporting to it.

Added MTTR: the DBE remediation of a training job (notify, checkpoint, drain, replace,
restart) `--baselines` times with no failover, then with the leader killed -9 at each step
boundary (notify mid-delivery, checkpoint, drain, replace, restart with attempt 2 launched)
and once stopped (SIGSTOP) at the replace boundary until the standby leads, then woken.
MTTR: the DBE injected -> the restart step succeeded (the job trains again past its
checkpoint). Every run is checked as tests/e2e/test_e2e_failover.py checks it (one incident,
each step once, one live attempt, losses bitwise equal to an uninterrupted run's).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.e2e.chaos import reference_lines, start_reference
from tests.e2e.ha_cluster import HaCluster, remediate_through_failover, stop_job
from tests.e2e.test_e2e_crash import BOUNDARIES, Crash, Hook, write_rules
from tests.e2e.test_e2e_failover import FAULT_STEP, STEP_TIME_S, ha_config
from tests.integration.postgres_proc import start_postgres


def failover_time(world: Crash, *, node: str, gpu: int) -> dict[str, float]:
    """Kill -9 the leader while its notify step waits on the receiver; seconds from the kill
    to the standby leading, acting (the resumed step succeeded) and every node reporting."""
    c = world.cluster
    assert isinstance(c, HaCluster)
    world.hook.hold(node)
    c.inject(node, "remap_pending", gpu=gpu)
    c.wait(world.hook.held.is_set, timeout_s=60, what="the trigger notification")
    old, killed_at = c.signal_leader(signal.SIGKILL)
    world.hook.release()
    new = c.wait_leader(other_than=old)
    acquired_at = c.log_events(new, "lease_acquired")[-1][0]
    leads_at = c.log_events(new, "leader")[-1][0]
    acted = c.wait(
        lambda: [at for at, _ in c.log_events(new, "action_succeeded") if at >= acquired_at],
        timeout_s=60,
        what=f"{new} to finish the notify step",
    )
    names = set(c.agents)
    c.wait(
        lambda: (
            names <= {n["name"] for n in c.nodes() if (n.get("last_report_at") or 0) > killed_at}
        ),
        timeout_s=60,
        what="every node to report to the new leader",
    )
    reported_at = time.time()  # an upper bound: when this poll saw it
    c.inject(node, "clear")
    c.start_controller(old)
    c.wait(lambda: c.log_events(old, "leader_seen"), timeout_s=60, what=f"{old} as a standby")
    return {
        "lease_taken_s": acquired_at - killed_at,
        "leads_s": leads_at - killed_at,
        "acts_s": min(acted) - killed_at,
        "nodes_report_s_at_most": reported_at - killed_at,
    }


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "max": round(max(values), 2),
        "min": round(min(values), 2),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5, help="failover-time runs")
    p.add_argument("--baselines", type=int, default=3, help="remediations without a failover")
    p.add_argument("--lease-s", type=float, default=3.0)
    p.add_argument(
        "--boundaries",
        default=",".join(BOUNDARIES),
        help="comma-separated step boundaries to kill the leader at, in order (repeats allowed)",
    )
    p.add_argument("--no-stop", action="store_true", help="skip the SIGSTOP run")
    p.add_argument("--skip-mttr", action="store_true")
    args = p.parse_args(argv)
    boundaries = [b for b in args.boundaries.split(",") if b]
    unknown = sorted(set(boundaries) - set(BOUNDARIES))
    if unknown:
        p.error(f"unknown boundaries {unknown}; known: {BOUNDARIES}")
    kills = [] if args.skip_mttr else [("kill", b) for b in boundaries]
    plan = [("none", "restart")] * (0 if args.skip_mttr else args.baselines)
    plan += [*kills, *([] if args.skip_mttr or args.no_stop else [("stop", "replace")])]
    print(f"load average at start: {os.getloadavg()}", flush=True)
    pg = start_postgres()
    hook = Hook()
    try:
        database = pg.new_database()
        with tempfile.TemporaryDirectory(prefix="tgfo") as tmp:
            rules = Path(tmp) / "rules.yaml"
            write_rules(rules)
            # the row-remap warning opens at once (the shipped rule waits a minute)
            doc = yaml.safe_load(rules.read_text())
            for rule in doc["rules"]:
                if rule["name"] == "gpu_remap_pending":
                    rule["for"] = "0s"
            rules.write_text(yaml.safe_dump(doc, sort_keys=False))
            config = ha_config(rules, spares=max(1, len(plan)))
            with HaCluster(
                Path(tmp) / "cluster",
                config,
                store_url=pg.url(database),
                lease_s=args.lease_s,
                extra={"notify": {"webhooks": [{"name": "hook", "url": hook.url}]}},
            ) as c:
                c.start()
                world = Crash(c, hook)
                targets = [(n, g) for g in range(config.gpus) for n in config.active]
                times = []
                for i in range(args.runs):
                    node, gpu = targets[i % len(targets)]
                    t = failover_time(world, node=node, gpu=gpu)
                    times.append(t)
                    print(json.dumps({"failover": i + 1, **{k: round(v, 3) for k, v in t.items()}}),
                          flush=True)  # fmt: skip
                mttr: dict[str, list[float]] = {}
                if plan:
                    world.reference = reference_lines(c, start_reference(c, step_time_s=0.05))
                for i, (how, boundary) in enumerate(plan):
                    job = f"fo-{i}-{how}-{boundary}"
                    try:
                        r = remediate_through_failover(
                            world,
                            job=job,
                            boundary=boundary,
                            how=how,
                            step_time_s=STEP_TIME_S,
                            fault_step=FAULT_STEP,
                        )
                    finally:
                        stop_job(world, job)
                    key = "none" if how == "none" else f"{how}@{boundary}"
                    mttr.setdefault(key, []).append(r.restarted_at - r.injected_at)
                    row = {"run": key, "mttr_s": round(r.restarted_at - r.injected_at, 2)}
                    if r.signalled_at is not None and r.leads_at is not None:
                        row["leads_s"] = round(r.leads_at - r.signalled_at, 2)
                    print(json.dumps(row), flush=True)
        out: dict[str, object] = {
            "lease_s": args.lease_s,
            "cores": os.cpu_count(),
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
        }
        if times:
            out["failover"] = {k: summary([t[k] for t in times]) for k in times[0]}
        if mttr:
            base = statistics.median(mttr["none"]) if "none" in mttr else None
            out["mttr_s"] = {k: summary(v) for k, v in mttr.items()}
            if base is not None:
                out["added_mttr_s"] = {
                    k: round(statistics.median(v) - base, 2) for k, v in mttr.items() if k != "none"
                }
        print(json.dumps(out, indent=2), flush=True)
    finally:
        hook.close()
        pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
