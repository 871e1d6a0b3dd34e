"""Store size over a simulated month of a large cluster, with the maintenance jobs' bodies
(retention, incremental vacuum, WAL checkpoint) run on their schedule.

Fast-forward on a fake clock, straight store calls (no API, no rules): per simulated hour,
agent events (a few per node per day, as XIDs, exits and NaN reports arrive; now and then an
agent restarts and starts a new instance), job restarts (each job once a day at its own
hour: a stop and a start command per node of the job, completed by command_result events),
incidents with their timelines and action steps (most resolved within hours, one in twenty
left open for ten days, so its node's events are kept as evidence), operator drains with
their audit entries, and the freshness flush of every node. Retention runs every
`--retention-interval-h` hours (the controller's default: hourly), followed by an
incremental vacuum; a truncating WAL checkpoint ends every simulated hour (the controller
checkpoints every 5 minutes).

Usage: .venv/bin/python bench/store_growth.py [--nodes 2048] [--days 30] [--events-days 7]
       [--commands-days 7] [--incidents-days 14] [--actions-days 14] [--audit-days 21]
       [--no-retention] [--db PATH]
The retention defaults here are shorter than the controller's (14/14/90/90/180 days) so
that every table reaches its limit inside the simulated month; pass the controller's
values to see those (events and commands level off after two weeks, incidents and audit
keep growing slowly until theirs). Prints one line per simulated day; nothing is asserted.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.clock import FakeClock
from trainguard.controller.config import RetentionConfig
from trainguard.controller.maintenance import run_checkpoint, run_retention, run_vacuum
from trainguard.controller.records import CommandResultRow, FreshNode, NewAction
from trainguard.controller.store import Store

HOUR_S = 3600.0
DAY_S = 24 * HOUR_S
TABLES = ("events", "commands", "incidents", "incident_timeline", "actions", "audit_log")
EVENT_KINDS = ("xid", "process_exit", "nan_loss", "ib_link_flap", "gpu_throttle")


@dataclass
class OpenIncident:
    id: int
    node: str
    resolve_at: float
    action_ids: list[int] = field(default_factory=list)


@dataclass
class Cluster:
    """What the simulated cluster carries from one hour to the next."""

    nodes: list[str]
    instance: dict[str, str]
    next_event_id: dict[str, int]
    jobs: dict[str, list[str]]
    open_incidents: list[OpenIncident] = field(default_factory=list)
    incident_seq: int = 0
    command_seq: int = 0
    audit_seq: int = 0


def _events(store: Store, cluster: Cluster, node: str, kinds: list[str], ts: float) -> None:
    rows = []
    for kind in kinds:
        cluster.next_event_id[node] += 1
        body = {"kind": kind, "node": node, "detail": {"gpu": 3, "code": 79, "msg": "x" * 80}}
        rows.append((cluster.next_event_id[node], kind, ts, body))
    store.events.insert(node, cluster.instance[node], rows)


def _restart_job(store: Store, cluster: Cluster, clock: FakeClock, job: str) -> None:
    """A stop and a start command per node of the job, each completed by the agent's
    command_result event a few seconds later."""
    nodes = cluster.jobs[job]
    for kind in ("stop_job", "start_job"):
        ids = {}
        for node in nodes:
            cluster.command_seq += 1
            ids[node] = f"{kind}-{job}-{cluster.command_seq}"
            store.commands.add(ids[node], node=node, kind=kind, args={"job": job, "attempt": 7})
        clock.advance(5.0)
        for node in nodes:
            cluster.next_event_id[node] += 1
            result = CommandResultRow(command_id=ids[node], ok=True, message=f"{kind} done")
            body = {"command_id": ids[node], "ok": True, "message": result.message}
            store.events.insert(
                node,
                cluster.instance[node],
                [(cluster.next_event_id[node], "command_result", clock.now(), body)],
                command_results=[result],
            )


def _open_incident(store: Store, cluster: Cluster, rng: random.Random, now: float) -> None:
    node = rng.choice(cluster.nodes)
    cluster.incident_seq += 1
    incident_id = store.incidents.create(
        rule="gpu_dbe",
        target_key=f"gpu:{node}:{cluster.incident_seq % 8}:{cluster.incident_seq}",
        target={"scope": "gpu", "node": node, "gpu": cluster.incident_seq % 8},
        target_text=f"{node} gpu {cluster.incident_seq % 8}",
        severity="critical",
        summary="uncorrectable ECC errors",
        node=node,
        job=None,
        ts=now,
        timeline=[
            ("opened", "gpu_dbe fired", {"value": 1.0, "signals": {"ecc": 1}}),
            ("planned", "notify, checkpoint, drain, replace", {}),
        ],
    )
    steps = ("notify", "checkpoint", "drain", "replace")
    ids = store.actions.add(
        incident_id,
        [
            NewAction(kind=k, target=node, idempotency_key=f"{incident_id}:{i}:{k}", seq=i)
            for i, k in enumerate(steps)
        ],
        ts=now,
        timeline=[("queued", f"{len(steps)} steps", {})],
    )
    for action_id, kind in zip(ids, steps, strict=True):
        store.actions.update(
            action_id,
            state="succeeded",
            ts=now + 30.0,
            result=f"{kind} done",
            output={"took_s": 12.5},
            attempts_delta=1,
            timeline=(incident_id, kind, f"{kind} succeeded", {"took_s": 12.5}),
        )
    store.incidents.set_state(
        incident_id,
        "mitigated",
        ts=now + 120.0,
        kind="mitigated",
        message="training past the checkpoint",
    )
    # most clear within hours; one in twenty stays open for ten days (its evidence is kept)
    stay_s = 10 * DAY_S if rng.random() < 0.05 else rng.uniform(1, 6) * HOUR_S
    cluster.open_incidents.append(OpenIncident(incident_id, node, now + stay_s, ids))


def _resolve_due(store: Store, cluster: Cluster, now: float) -> None:
    still = []
    for inc in cluster.open_incidents:
        if inc.resolve_at <= now:
            store.incidents.set_state(inc.id, "resolved", ts=now, kind="resolved", message="ok")
        else:
            still.append(inc)
    cluster.open_incidents = still


def _operator(store: Store, cluster: Cluster, rng: random.Random, now: float) -> None:
    cluster.audit_seq += 1
    node = rng.choice(cluster.nodes)
    audit_id = store.audit.record(
        ts=now, actor="ops", action="drain", target=node, detail={"reason": "maintenance window"}
    )
    (action_id,) = store.actions.add(
        None,
        [NewAction(kind="drain", target=node, idempotency_key=f"operator:drain:{node}:{audit_id}")],
        ts=now,
    )
    store.actions.update(action_id, state="succeeded", ts=now + 10.0, result="drained")


def _rows(store: Store) -> dict[str, int]:
    return {t: int(store.db.query(f"SELECT COUNT(*) FROM {t}")[0][0]) for t in TABLES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--days", type=int, default=30)
    p.add_argument("--events-per-node-day", type=float, default=4.0)
    p.add_argument("--jobs", type=int, default=16, help="jobs, each on nodes/jobs nodes")
    p.add_argument("--restarts-per-job-day", type=float, default=1.0)
    p.add_argument("--incidents-per-day", type=float, default=40.0)
    p.add_argument("--operator-actions-per-day", type=float, default=50.0)
    p.add_argument("--events-days", type=float, default=7.0)
    p.add_argument("--commands-days", type=float, default=7.0)
    p.add_argument("--incidents-days", type=float, default=14.0)
    p.add_argument("--actions-days", type=float, default=14.0)
    p.add_argument("--audit-days", type=float, default=21.0)
    p.add_argument("--retention-interval-h", type=int, default=1)
    p.add_argument("--no-retention", action="store_true", help="checkpoints only: the baseline")
    p.add_argument("--db", default="", help="store file (default: a temporary directory)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()

    policy = RetentionConfig(
        events_days=args.events_days,
        commands_days=args.commands_days,
        incidents_days=args.incidents_days,
        operator_actions_days=args.actions_days,
        audit_days=args.audit_days,
    )
    rng = random.Random(args.seed)
    clock = FakeClock()
    tmp = tempfile.TemporaryDirectory()
    path = Path(args.db) if args.db else Path(tmp.name) / "controller.db"
    store = Store(path, now=clock.now)
    nodes = [f"node-{i:04d}" for i in range(args.nodes)]
    per_job = max(1, args.nodes // max(1, args.jobs))
    cluster = Cluster(
        nodes=nodes,
        instance={n: f"{n}-boot-0" for n in nodes},
        next_event_id=dict.fromkeys(nodes, 0),
        jobs={f"job-{j}": nodes[j * per_job : (j + 1) * per_job] for j in range(args.jobs)},
    )
    for n in nodes:
        store.nodes.add(n, role="active", labels={"rack": n[:8], "pool": "default"})

    print(
        f"nodes={args.nodes} days={args.days} events/node/day={args.events_per_node_day} "
        f"jobs={args.jobs} restarts/job/day={args.restarts_per_job_day} "
        f"incidents/day={args.incidents_per_day} operator actions/day="
        f"{args.operator_actions_per_day} retention="
        + (
            "off"
            if args.no_retention
            else f"events {args.events_days}d, commands {args.commands_days}d, incidents "
            f"{args.incidents_days}d, operator actions {args.actions_days}d, audit "
            f"{args.audit_days}d every {args.retention_interval_h}h"
        )
    )
    print(
        f"{'day':>3} {'db MiB':>7} {'wal MiB':>7} {'events':>8} {'commands':>8} "
        f"{'incidents':>9} {'timeline':>8} {'actions':>7} {'audit':>6} {'deleted':>8} "
        f"{'batches':>7} {'run max s':>9}"
    )
    started = time.monotonic()
    hourly_events = args.nodes * args.events_per_node_day / 24.0
    restart_every_h = max(1, round(24.0 / args.restarts_per_job_day))
    deleted_today = batches_today = 0
    max_run_s = 0.0
    for hour in range(args.days * 24):
        hour_start = clock.now()
        # agent events, spread over the nodes (some restart their agent: a new instance)
        n_events = int(hourly_events) + (rng.random() < hourly_events % 1)
        for node in rng.sample(nodes, min(len(nodes), n_events)):
            if rng.random() < 0.01:
                cluster.instance[node] = f"{node}-boot-{hour}"
                cluster.next_event_id[node] = 0
            _events(store, cluster, node, [rng.choice(EVENT_KINDS)], clock.now())
        for j, job in enumerate(cluster.jobs):  # evenly spaced, each job at its own hour
            if (hour + j) % restart_every_h == 0:
                _restart_job(store, cluster, clock, job)
        for _ in range(int(args.incidents_per_day / 24.0 + rng.random())):
            _open_incident(store, cluster, rng, clock.now())
        for _ in range(int(args.operator_actions_per_day / 24.0 + rng.random())):
            _operator(store, cluster, rng, clock.now())
        _resolve_due(store, cluster, clock.now())
        store.nodes.flush_freshness(
            FreshNode(
                name=n,
                last_report_at=clock.now(),
                instance=cluster.instance[n],
                agent_version="0.1.0",
                labels={"rack": n[:8], "pool": "default"},
            )
            for n in nodes
        )
        clock.advance(hour_start + HOUR_S - clock.now())

        if not args.no_retention and (hour + 1) % args.retention_interval_h == 0:
            t0 = time.monotonic()
            result = run_retention(store, now=clock.now(), policy=policy)
            run_vacuum(store, max_pages=65536)
            max_run_s = max(max_run_s, time.monotonic() - t0)
            deleted_today += result.total
            batches_today += result.batches
        run_checkpoint(store)

        if (hour + 1) % 24 == 0:
            db_bytes, wal_bytes = store.space.file_sizes()
            rows = _rows(store)
            print(
                f"{(hour + 1) // 24:>3} {db_bytes / 2**20:>7.1f} {wal_bytes / 2**20:>7.1f} "
                f"{rows['events']:>8} {rows['commands']:>8} {rows['incidents']:>9} "
                f"{rows['incident_timeline']:>8} {rows['actions']:>7} {rows['audit_log']:>6} "
                f"{deleted_today:>8} {batches_today:>7} {max_run_s:>9.3f}",
                flush=True,
            )
            deleted_today = batches_today = 0
            max_run_s = 0.0
    store.close()
    print(f"simulated {args.days} days in {time.monotonic() - started:.0f} s (wall)")
    tmp.cleanup()


if __name__ == "__main__":
    main()
