"""A requeued victim names the waiting job it gave way to, and the cycle plans that job
first: the GPUs freed for a job reach it even once its victims have exited, however old
the victim is. The world: 3 h100 nodes of 8, vision, nlp and ops guaranteed 8 each."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from preemption.cycle import schedule_cycle
from preemption.models import Attempt, Job, JobState, PreemptionEvent
from preemption.snapshot import read_snapshot, workload_id
from tests import builders

pytestmark = pytest.mark.django_db


def full_but_four(world: Any) -> None:
    """Non-preemptible work on all but 4 GPUs of node 2: vision and nlp run 4 each
    (inside their guarantees with 4 more), ops 12; nothing can be taken."""
    for team, node, gpus in (
        (world.ops, "h100-node-0", 8),
        (world.ops, "h100-node-1", 4),
        (world.vision, "h100-node-1", 4),
        (world.nlp, "h100-node-2", 4),
    ):
        builders.running_job(
            world, team, node=node, priority_class=world.critical, gpus_per_rank=gpus
        )


def victim_and_preemptor(world: Any, reason: str = "consolidate") -> tuple[Job, Job]:
    """Vision's 4-GPU job, submitted two hours ago and requeued after a stop `reason`
    for nlp's 4-GPU job, which still waits (submitted ten minutes ago)."""
    now = timezone.now()
    preemptor = builders.job(world, world.nlp, state=JobState.PENDING, gpus_per_rank=4)
    victim = builders.job(world, world.vision, state=JobState.REQUEUED, gpus_per_rank=4)
    # Submission times are the database's own on creation.
    Job.objects.filter(pk=preemptor.pk).update(submitted_at=now - timedelta(minutes=10))
    Job.objects.filter(pk=victim.pk).update(submitted_at=now - timedelta(hours=2))
    decided = now - timedelta(minutes=5)
    stopped = builders.attempt(
        victim,
        node="h100-node-2",
        admitted_at=now - timedelta(hours=1),
        ended_at=decided + timedelta(seconds=20),
        end_reason=Attempt.EndReason.PREEMPTED,
    )
    PreemptionEvent.objects.create(
        victim_attempt=stopped,
        job=victim,
        preemptor=preemptor,
        reason=reason,
        decided_at=decided,
        grace_seconds=30,
        deadline=decided + timedelta(seconds=30),
    )
    return victim, preemptor


def ran(job: Job, *, minutes_ago: float, reason: str) -> None:
    """An attempt of `job` on node 2, admitted `minutes_ago` and ended a minute later."""
    admitted = timezone.now() - timedelta(minutes=minutes_ago)
    builders.attempt(
        job,
        node="h100-node-2",
        admitted_at=admitted,
        ended_at=admitted + timedelta(minutes=1),
        end_reason=reason,
    )


def named(job: Job) -> str | None:
    """The job its workload in the cycle's snapshot names as the one it gave way to."""
    snapshot, _, _ = read_snapshot(reuse=False)
    [workload] = [w for w in snapshot.workloads if w.id == workload_id(job.pk)]
    return workload.preemptor


def test_a_requeued_victim_is_planned_after_the_job_it_gave_way_to(world: Any) -> None:
    full_but_four(world)
    victim, preemptor = victim_and_preemptor(world)
    assert named(victim) == workload_id(preemptor.pk)
    result = schedule_cycle(act=False)
    # Both fit inside their team's guarantee, the victim the older by far: by age it
    # would take the 4 GPUs it had freed for the other.
    assert result.admitted == [preemptor.pk]
    victim.refresh_from_db()
    assert victim.state == JobState.REQUEUED
    assert "no node of flavor h100" in victim.waiting_reason


def test_a_victim_whose_preemptor_started_since_goes_in_its_turn(world: Any) -> None:
    full_but_four(world)
    victim, preemptor = victim_and_preemptor(world)
    # The preemptor ran after the decision and was requeued in turn: it owes nothing.
    ran(preemptor, minutes_ago=4, reason=Attempt.EndReason.PREEMPTED)
    Job.objects.filter(pk=preemptor.pk).update(state=JobState.REQUEUED)
    assert named(victim) is None
    assert schedule_cycle(act=False).admitted == [victim.pk]


@pytest.mark.parametrize("later", ["an attempt", "a resize"])
def test_only_the_stop_that_requeued_the_victim_names_a_preemptor(world: Any, later: str) -> None:
    full_but_four(world)
    victim, preemptor = victim_and_preemptor(
        world, reason="resize" if later == "a resize" else "consolidate"
    )
    if later == "an attempt":
        # The victim ran again since (and was stopped by its own failure).
        ran(victim, minutes_ago=3, reason=Attempt.EndReason.FAILED)
    assert named(victim) is None
    assert named(preemptor) is None
    assert schedule_cycle(act=False).admitted == [victim.pk]
