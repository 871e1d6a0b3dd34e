"""Failover mid-remediation on real processes: PostgreSQL, two controllers (ha.enabled, one
database, a 3 s lease), sim agents given both URLs, real torchrun jobs. A DBE on a node of a
training job; the leader is killed -9 at a step boundary of the remediation, or stopped
(SIGSTOP) past its lease and woken (SIGCONT): the standby takes over (epoch + 1) and the
remediation completes exactly once (one incident, each of checkpoint, drain, replace and
restart once and succeeded, the sick node the one new drain, attempt 1 -> 2, every trigger
notification with the same idempotency key), no two attempts of the job alive together (the
agents' records), every loss equal to an uninterrupted run's bitwise; the woken leader steps
down and answers as a standby.

In CI: kill -9 at the drain and the restart boundary (attempt 2 launched, the step waiting
for it to train), SIGSTOP at the replace boundary (the woken leader was about to restart the
job the new leader restarts). bench/failover.py runs all five boundaries (notify
mid-delivery, checkpoint, drain, replace, restart) and the SIGSTOP, and times them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.ha_cluster import HaCluster, remediate_through_failover, stop_job
from tests.e2e.reference import Reference
from tests.e2e.test_e2e_crash import Crash, Hook, write_rules
from tests.integration.postgres_proc import PgServer
from trainguard.devkit.devcluster import ClusterConfig

pytestmark = pytest.mark.slow

LEASE_S = 3.0
# 40 steps of 0.5 s: a fault at step 8 leaves the job 16 s of training, room for a failover
# (lease, takeover, the agents finding the new leader) before the remediation stops it
STEP_TIME_S = 0.5
FAULT_STEP = 8
SCENARIOS = [("kill", "drain"), ("kill", "restart"), ("stop", "replace")]


def ha_config(rules_file: Path, *, spares: int) -> ClusterConfig:
    return ClusterConfig(
        active=("node-1", "node-2", "node-3"),
        spares=tuple(f"spare-{i}" for i in range(1, spares + 1)),
        rules=(str(rules_file),),
        safety={"drain_budget": 100, "breaker_threshold": 100},
        # the sick node stays drained, as these checks expect: the node lifecycle after a
        # drain (lifecycle.auto_repair) is test_e2e_chaos.py's and the unit tests'
        lifecycle={"auto_repair": False},
        jobs={
            "checkpoint_timeout_s": 5,
            "stop_grace_s": 5,
            "stop_timeout_s": 10,
            "progress_timeout_s": 90,
        },
    )


@pytest.fixture(scope="module")
def failover(
    tmp_path_factory: pytest.TempPathFactory, pg_server: PgServer, reference: Reference
) -> Iterator[Crash]:
    reference.start()  # trains while the cluster comes up (the crash module may have run it)
    base = Path(tmp_path_factory.mktemp("failover"))
    rules_file = base / "rules.yaml"
    write_rules(rules_file)
    database = pg_server.new_database()
    hook = Hook()
    try:
        with HaCluster(
            base / "cluster",
            # one spare per remediation
            ha_config(rules_file, spares=len(SCENARIOS)),
            store_url=pg_server.url(database),
            lease_s=LEASE_S,
            extra={"notify": {"webhooks": [{"name": "hook", "url": hook.url}]}},
        ) as cluster:
            cluster.start()
            world = Crash(cluster, hook)
            world.reference = reference.lines()
            yield world
        assert cluster.leftover_pids() == set()
    finally:
        hook.close()
        pg_server.drop_database(database)


@pytest.mark.parametrize(("how", "boundary"), SCENARIOS, ids=[f"{h}-{b}" for h, b in SCENARIOS])
def test_a_leader_lost_mid_remediation_is_replaced_and_the_remediation_completes_once(
    failover: Crash, how: str, boundary: str
) -> None:
    job = f"ha-{how}-{boundary}"
    try:
        result = remediate_through_failover(
            failover,
            job=job,
            boundary=boundary,
            how=how,
            step_time_s=STEP_TIME_S,
            fault_step=FAULT_STEP,
        )
    finally:
        stop_job(failover, job)
    assert result.new is not None and result.new != result.old
