"""Which victims' logs a reconcile pass reads before it decides their stop: only
those whose log can change the decision, so that every other victim is evicted
without waiting for a log read (an API call per rank on Kubernetes)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from preemption.models import Attempt, PreemptionEvent, TrapEvent
from preemption.reconcile.logs import _logs_awaited
from quotas.models import PriorityClass
from tests import builders

pytestmark = [pytest.mark.django_db]


def _victim(world: Any, *, notice_seconds: int, reason: str = "reclaim", **stop: Any) -> Attempt:
    """A launched 2-rank attempt whose stop was decided a second ago."""
    PriorityClass.objects.filter(pk=world.batch.pk).update(notice_seconds=notice_seconds)
    job = builders.job(world, world.vision, ranks=2, priority_class=world.batch)
    attempt = builders.attempt(job, launched_at=timezone.now() - timedelta(minutes=5))
    builders.ranks(attempt)
    now = timezone.now()
    PreemptionEvent.objects.create(
        job=job,
        victim_attempt=attempt,
        reason=reason,
        decided_at=now - timedelta(seconds=1),
        grace_seconds=60,
        deadline=now + timedelta(seconds=59),
        **stop,
    )
    return attempt


def _ready(attempt: Attempt, *ranks: int) -> None:
    for rank in ranks:
        TrapEvent.objects.create(
            job_id=attempt.job_id,
            attempt=attempt.number,
            rank=rank,
            event="trap_ready",
            at=timezone.now().timestamp(),
            payload={"notice_signal": "SIGUSR2"},
            fingerprint=f"{attempt.pk}-{rank}",
        )


def _awaited(*attempts: Attempt) -> set[int]:
    loaded = Attempt.objects.filter(pk__in=[a.pk for a in attempts]).select_related(
        "job__priority_class", "preemption"
    )
    return {attempt.pk for attempt in _logs_awaited(list(loaded))}


def test_a_victim_whose_class_gives_no_notice_is_not_read(world: Any) -> None:
    assert _awaited(_victim(world, notice_seconds=0)) == set()


def test_a_victim_stopped_by_the_gang_guard_is_not_read(world: Any) -> None:
    assert _awaited(_victim(world, notice_seconds=20, reason="gang-guard")) == set()


def test_a_noticed_victim_is_read_until_every_rank_announced_itself(world: Any) -> None:
    attempt = _victim(world, notice_seconds=20)
    assert _awaited(attempt) == {attempt.pk}
    _ready(attempt, 0)
    assert _awaited(attempt) == {attempt.pk}
    _ready(attempt, 1)
    assert _awaited(attempt) == set()


def test_a_victim_told_of_the_notice_is_read_for_its_commit(world: Any) -> None:
    now = timezone.now()
    attempt = _victim(
        world,
        notice_seconds=20,
        notice_deadline=now + timedelta(seconds=19),
        notice_sent_at=now,
    )
    _ready(attempt, 0, 1)
    assert _awaited(attempt) == {attempt.pk}


def test_a_victim_already_signalled_is_not_read(world: Any) -> None:
    now = timezone.now()
    attempt = _victim(
        world,
        notice_seconds=20,
        notice_deadline=now,
        notice_sent_at=now - timedelta(seconds=5),
        signal_sent_at=now,
    )
    assert _awaited(attempt) == set()
