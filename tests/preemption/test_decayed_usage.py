"""Decayed usage from the attempts on the test database: the GPU-seconds each team used
per flavor, weighed down by the half-life, and the settings that bring them to the
engine (only with a strength above 0)."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from preemption.cycle import schedule_cycle
from preemption.models import Attempt, Job, JobState
from preemption.services import job_submit
from preemption.snapshot import build_snapshot, decayed_usage

pytestmark = pytest.mark.django_db

HOUR = 3600.0


def _attempt(world: Any, team: Any, gpus: int, since: float, until: float | None) -> Job:
    """A job whose one attempt held ``gpus`` GPUs from ``since`` to ``until`` seconds ago
    (still running when None)."""
    job = job_submit(
        submitter=world.users["admin"],
        team=team,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=gpus,
        command="true",
        priority_class=world.batch,
        name=f"{team.slug}-{since}",
    )
    schedule_cycle(act=False)
    now = timezone.now()
    Attempt.objects.filter(job=job).update(
        admitted_at=now - timedelta(seconds=since),
        ended_at=None if until is None else now - timedelta(seconds=until),
        placement=[{"node": "h100-node-0", "ranks": 1}],
    )
    state = JobState.RUNNING if until is None else JobState.SUCCEEDED
    Job.objects.filter(pk=job.pk).update(state=state)
    return job


def test_usage_decays_with_the_half_life(world: Any) -> None:
    # ops: 8 GPUs for the last hour (running); nlp: 4 GPUs from 3 to 2 hours ago.
    _attempt(world, world.ops, 8, HOUR, None)
    _attempt(world, world.nlp, 4, 3 * HOUR, 2 * HOUR)
    usage = decayed_usage(now=timezone.now(), half_life_seconds=HOUR)
    horizon = HOUR / math.log(2)
    # The last hour counts half of a full hour's worth of decayed GPU-seconds...
    assert usage["ops"]["h100-80gb"] == pytest.approx(8 * horizon * (1 - 0.5), rel=1e-3)
    # ...an hour two hours ago an eighth of it (0.25 - 0.125).
    assert usage["nlp"]["h100-80gb"] == pytest.approx(4 * horizon * 0.125, rel=1e-3)
    assert "vision" not in usage
    # Far beyond the kept half-lives an attempt no longer counts.
    later = timezone.now() + timedelta(seconds=20 * HOUR)
    Job.objects.filter(team=world.ops).update(state=JobState.SUCCEEDED)
    Attempt.objects.filter(job__team=world.ops).update(ended_at=timezone.now())
    assert "ops" not in decayed_usage(now=later, half_life_seconds=HOUR)


def test_usage_reaches_the_engine_only_with_a_strength(world: Any, settings: Any) -> None:
    _attempt(world, world.ops, 8, HOUR, None)
    snapshot = build_snapshot()
    assert snapshot.usage_strength == 0.0
    assert all(not queue.recent_usage for queue in snapshot.queues)

    settings.QM_USAGE_STRENGTH = 1.0
    settings.QM_USAGE_HALF_LIFE_SECONDS = HOUR
    snapshot = build_snapshot()
    assert snapshot.usage_strength == 1.0
    assert snapshot.usage_half_life_seconds == HOUR
    recent = {queue.name: dict(queue.recent_usage) for queue in snapshot.queues}
    assert recent["ops"]["h100-80gb"] == pytest.approx(8 * HOUR / math.log(2) * 0.5, rel=1e-3)
    assert recent["vision"] == {}
