"""Tiered retention: the pure selection (on a fake clock, over simulated months) and its use
by the trainer on disk (a real job's checkpoints, milestones marked by the job)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.trainer.trainer_helpers import TinyJob
from trainguard.clock import FakeClock
from trainguard.trainer import RetentionPolicy
from trainguard.trainer.checkpoint_manager import CheckpointSettings
from trainguard.trainer.manifest import list_committed, read_manifest
from trainguard.trainer.retention import (
    CheckpointInfo,
    Tier,
    check_milestone_name,
    retention_from_env,
    select,
)

HOUR = 3600.0
DAY = 24 * HOUR
# Monday 2023-11-13 00:00 UTC
MONDAY = 1_699_833_600.0


def kept(tiers: dict[int, tuple[Tier, ...]]) -> set[int]:
    return {step for step, t in tiers.items() if t}


def every(hours: float, n: int, *, start: float = MONDAY) -> list[CheckpointInfo]:
    return [CheckpointInfo(step=i + 1, created_at=start + i * hours * HOUR) for i in range(n)]


def test_the_default_keeps_the_newest_three() -> None:
    cps = every(1, 10)
    tiers = select(
        policy=RetentionPolicy(), checkpoints=cps, now=cps[-1].created_at or 0, newest_good_step=10
    )
    assert kept(tiers) == {8, 9, 10}
    assert tiers[10] == (Tier.NEWEST, Tier.RECENT)


def test_the_newest_verified_checkpoint_and_anything_newer_are_never_deleted() -> None:
    cps = every(1, 10)
    tiers = select(
        policy=RetentionPolicy(recent_last=1), checkpoints=cps, now=MONDAY, newest_good_step=4
    )
    assert kept(tiers) == {4, 5, 6, 7, 8, 9, 10}
    assert tiers[4] == (Tier.NEWEST,)


def test_nothing_is_deleted_without_a_verified_checkpoint_or_with_every_tier_off() -> None:
    cps = every(1, 10)
    assert kept(
        select(policy=RetentionPolicy(), checkpoints=cps, now=MONDAY, newest_good_step=None)
    ) == set(range(1, 11))
    off = RetentionPolicy(recent_last=0)
    assert off.keeps_all
    tiers = select(policy=off, checkpoints=cps, now=MONDAY, newest_good_step=10)
    assert set(tiers.values()) == {(Tier.ALL,)}


def test_recent_hours_keeps_everything_from_the_last_hours() -> None:
    cps = every(1, 48)
    now = cps[-1].created_at or 0.0
    tiers = select(
        policy=RetentionPolicy(recent_last=0, recent_hours=6),
        checkpoints=cps,
        now=now,
        newest_good_step=48,
    )
    assert kept(tiers) == set(range(42, 49))


def test_daily_keeps_the_last_checkpoint_of_each_of_the_last_days() -> None:
    cps = every(6, 40)  # 10 days, 4 a day: 00, 06, 12, 18
    now = cps[-1].created_at or 0.0
    policy = RetentionPolicy(recent_last=0, daily_days=7)
    tiers = select(policy=policy, checkpoints=cps, now=now, newest_good_step=40)
    # days 4..10 (1-based), each one's 18:00 checkpoint: steps 16, 20, ..., 40
    assert kept(tiers) == {4 * d for d in range(4, 11)}
    assert tiers[36] == (Tier.DAILY,)


def test_weekly_keeps_the_last_checkpoint_of_each_iso_week() -> None:
    cps = [
        CheckpointInfo(step=1, created_at=MONDAY - 2 * HOUR),  # Sunday 22:00: last week
        CheckpointInfo(step=2, created_at=MONDAY + 1 * HOUR),  # Monday 01:00: this week
        CheckpointInfo(step=3, created_at=MONDAY + 3 * DAY),
    ]
    policy = RetentionPolicy(recent_last=0, weekly_weeks=2)
    tiers = select(policy=policy, checkpoints=cps, now=MONDAY + 3 * DAY, newest_good_step=3)
    assert kept(tiers) == {1, 3}
    one_week = dataclasses.replace(policy, weekly_weeks=1)
    assert kept(
        select(policy=one_week, checkpoints=cps, now=MONDAY + 3 * DAY, newest_good_step=3)
    ) == {3}


def test_milestones_are_kept_forever_the_newest_of_each_name() -> None:
    cps = every(24, 200)
    marked = {10: ("phase-1",), 50: ("best-val",), 90: ("best-val",)}
    cps = [dataclasses.replace(c, milestones=marked.get(c.step, ())) for c in cps]
    tiers = select(
        policy=RetentionPolicy(recent_last=1),
        checkpoints=cps,
        now=MONDAY + 400 * DAY,
        newest_good_step=200,
    )
    assert kept(tiers) == {10, 90, 200}
    assert tiers[90] == (Tier.MILESTONE,)


def test_an_unreadable_manifest_counts_only_towards_the_newest_k() -> None:
    cps = [
        CheckpointInfo(step=1, created_at=MONDAY),
        CheckpointInfo(step=2, created_at=None),
        CheckpointInfo(step=3, created_at=MONDAY + HOUR),
    ]
    policy = RetentionPolicy(recent_last=2, recent_hours=100)
    assert kept(select(policy=policy, checkpoints=cps, now=MONDAY + HOUR, newest_good_step=3)) == {
        1,
        2,
        3,
    }
    policy = RetentionPolicy(recent_last=1, recent_hours=100)
    assert kept(select(policy=policy, checkpoints=cps, now=MONDAY + HOUR, newest_good_step=3)) == {
        1,
        3,
    }


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"recent_last": -1}, "retention.recent_last"),
        ({"recent_last": 10_001}, "retention.recent_last"),
        ({"recent_hours": -0.5}, "retention.recent_hours"),
        ({"daily_days": 5000}, "retention.daily_days"),
        ({"weekly_weeks": 1.5}, "retention.weekly_weeks"),
        ({"daily_days": True}, "retention.daily_days"),
    ],
    ids=["negative", "unbounded", "negative-hours", "too-many-days", "fractional-weeks", "bool"],
)
def test_a_bad_policy_fails_naming_its_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        RetentionPolicy(**kwargs)  # type: ignore[arg-type]


def test_a_policy_from_json_is_strict() -> None:
    assert RetentionPolicy.from_json({"daily_days": 7}) == RetentionPolicy(daily_days=7)
    with pytest.raises(ValueError, match=r"job\.retention\.dayly_days: unknown key"):
        RetentionPolicy.from_json({"dayly_days": 7}, where="job.retention")
    with pytest.raises(ValueError, match=r"job\.retention\.weekly_weeks: must be"):
        RetentionPolicy.from_json({"weekly_weeks": -1}, where="job.retention")


@pytest.mark.parametrize(
    "name", ["", "-x", "a b", "x" * 65, "../up"], ids=["empty", "dash", "space", "long", "path"]
)
def test_a_bad_milestone_name_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="milestone name"):
        check_milestone_name(name)


def test_keep_last_and_retention_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"retention\.recent_last"):
        CheckpointSettings(ckpt_dir=tmp_path, keep_last=5, retention=RetentionPolicy())
    assert CheckpointSettings(ckpt_dir=tmp_path, keep_last=0).policy.keeps_all


policies = st.builds(
    RetentionPolicy,
    recent_last=st.integers(0, 5),
    recent_hours=st.sampled_from([0.0, 6.0, 36.0]),
    daily_days=st.integers(0, 10),
    weekly_weeks=st.integers(0, 8),
)
histories = st.lists(
    st.tuples(
        st.floats(0.5, 60.0),  # hours since the previous checkpoint
        st.sampled_from([(), (), (), (), ("best-val",), ("phase-1",)]),
    ),
    min_size=1,
    max_size=250,
)


@settings(max_examples=60, deadline=None)
@given(policy=policies, history=histories)
def test_pruning_at_every_commit_over_months_keeps_what_one_prune_of_the_whole_history_would(
    policy: RetentionPolicy, history: list[tuple[float, tuple[str, ...]]]
) -> None:
    now = MONDAY
    everything: list[CheckpointInfo] = []
    alive: dict[int, CheckpointInfo] = {}
    for step, (gap_h, names) in enumerate(history, start=1):
        now += gap_h * HOUR
        c = CheckpointInfo(step=step, created_at=now, milestones=names)
        everything.append(c)
        alive[step] = c
        tiers = select(policy=policy, checkpoints=alive.values(), now=now, newest_good_step=step)
        alive = {s: alive[s] for s in kept(tiers)}
        assert step in alive
        for name in {n for c in everything for n in c.milestones}:
            newest = max(c.step for c in everything if name in c.milestones)
            assert newest in alive
        days = {int((c.created_at or 0) // DAY) for c in everything}
        for day in days:
            if policy.daily_days and day > int(now // DAY) - policy.daily_days:
                last = max(c.step for c in everything if int((c.created_at or 0) // DAY) == day)
                assert last in alive
    once = select(policy=policy, checkpoints=everything, now=now, newest_good_step=len(history))
    assert set(alive) == kept(once)


def test_the_trainer_prunes_by_tier_and_keeps_a_marked_milestone(tmp_path: Path) -> None:
    clock = FakeClock(start=MONDAY)
    job = TinyJob()
    policy = RetentionPolicy(recent_last=2, daily_days=3)
    tg = job.guard(tmp_path, retention=policy, clock=clock, job="tiers")
    batches = job.sampler.batches(job.loader)
    for step in range(1, 13):  # one checkpoint every 8 hours: 4 days
        job.train_step(batches)
        if step == 2:
            tg.mark_milestone("best-val")
        assert tg.save(step, wait=True)
        clock.advance(8 * HOUR)
    tg.close()
    steps = [s for s, _ in list_committed(tmp_path)]
    # newest two (11, 12), the last of each of the last 3 days (6, 9, 12), the milestone (2)
    assert steps == [12, 11, 9, 6, 2]
    manifest = read_manifest(tmp_path / "step_000002")
    assert manifest.extra["milestones"] == ["best-val"]
    assert manifest.extra["retention"] == policy.to_json()
    assert "milestones" not in read_manifest(tmp_path / "step_000006").extra


def test_a_job_spec_sets_the_policy_through_its_environment_strictly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAINGUARD_RETENTION", '{"recent_last": 1, "daily_days": 7}')
    assert retention_from_env() == RetentionPolicy(recent_last=1, daily_days=7)
    tg = TinyJob().guard(tmp_path, job="env")
    assert tg.checkpoints.settings.policy == RetentionPolicy(recent_last=1, daily_days=7)
    tg.close()
    for raw, message in [
        ('{"dayly_days": 7}', r"TRAINGUARD_RETENTION\.dayly_days: unknown key"),
        ('{"daily_days": 99999}', r"TRAINGUARD_RETENTION\.daily_days: must be in \[0, 3660\]"),
        ("daily", r"TRAINGUARD_RETENTION: not a JSON object"),
        ("[1]", r"TRAINGUARD_RETENTION must be a mapping"),
    ]:
        monkeypatch.setenv("TRAINGUARD_RETENTION", raw)
        with pytest.raises(ValueError, match=message):
            TinyJob().guard(tmp_path / "x", job="env")
