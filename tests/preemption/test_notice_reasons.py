"""Why waiting, with the checkpoint notice: a job that waits for its victims is told
when their GPUs are free at the latest, notice window included."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from preemption.cycle import schedule_cycle
from preemption.models import Job, JobState, PreemptionEvent, Rank
from preemption.reasons import free_by, release_words
from tests import builders

NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def event(**fields: Any) -> PreemptionEvent:
    values: dict[str, Any] = {
        "job_id": 7,
        "reason": "reclaim",
        "decided_at": NOW,
        "grace_seconds": 60,
        "deadline": NOW + timedelta(seconds=60),
    }
    values.update(fields)
    return PreemptionEvent(**values)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (
            {"notice_deadline": NOW + timedelta(seconds=20), "notice_sent_at": NOW},
            "job 7 is checkpointing on notice until 12:00:20 UTC at the latest, then stops; "
            "its GPUs are free by 12:01:00 UTC at the latest",
        ),
        (
            {"notice_deadline": NOW + timedelta(seconds=20)},
            "job 7 is checkpointing on notice until 12:00:20 UTC at the latest, then stops; "
            "its GPUs are free by 12:01:00 UTC at the latest",
        ),
        (
            {
                "notice_deadline": NOW + timedelta(seconds=20),
                "notice_sent_at": NOW,
                "signal_sent_at": NOW + timedelta(seconds=4),
            },
            "job 7 is stopping; its GPUs are free by 12:01:00 UTC at the latest",
        ),
        ({}, "job 7 is stopping; its GPUs are free by 12:01:00 UTC at the latest"),
        (
            {"notice_deadline": NOW - timedelta(seconds=1)},
            "job 7 is stopping; its GPUs are free by 12:01:00 UTC at the latest",
        ),
    ],
)
def test_release_words(fields: dict[str, Any], words: str) -> None:
    assert release_words(event(**fields), NOW) == words


def test_the_notice_window_never_frees_the_gpus_later_than_the_grace_window() -> None:
    with_notice = event(notice_deadline=NOW + timedelta(seconds=59), notice_sent_at=NOW)
    assert free_by(with_notice) == free_by(event()) == NOW + timedelta(seconds=60)


@pytest.mark.django_db
def test_a_preemptor_waiting_for_a_noticed_victim_is_told_when_its_gpus_are_free(
    world: Any,
) -> None:
    victim = builders.job(world, world.ops, state=JobState.PREEMPTING, ranks=3, gpus_per_rank=8)
    nodes = [f"h100-node-{i}" for i in range(3)]
    attempt = builders.attempt(
        victim, placement=[{"node": node, "ranks": 1} for node in nodes], borrowed_gpus=16
    )
    for index, node in enumerate(nodes):
        Rank.objects.create(attempt=attempt, index=index, node=node, state=Rank.State.RUNNING)
    preemptor = builders.job(world, world.vision, state=JobState.PENDING, gpus_per_rank=8)
    now = datetime.now(UTC)
    PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=victim,
        preemptor=preemptor,
        reason="reclaim",
        decided_at=now,
        grace_seconds=60,
        deadline=now + timedelta(seconds=60),
        notice_deadline=now + timedelta(seconds=20),
        notice_sent_at=now,
    )
    schedule_cycle(act=False)
    reason = Job.objects.get(pk=preemptor.pk).waiting_reason
    assert f"job {victim.pk} is checkpointing on notice until" in reason, reason
    assert "its GPUs are free by" in reason
