"""The first reconcile pass after a restart, or after a cycle that admitted and
preempted many jobs, costs a fixed number of queries however many gangs it finds:
gangs to record as running, launches to carry out, victims to signal, and victims
that ignored their signal to kill at the deadline. Before, each victim cost about a
dozen queries (a savepoint and its release around its decision and around the
record of its signal, each rank's write, the action's), and a pass over the engine
benchmark's 2,400 running gangs ran 22,257 of them."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile import reconcile_jobs
from preemption.runtimes import GangId
from preemption.runtimes.mimic import MimicRuntime
from tests import builders
from tests.preemption.conftest import launched

pytestmark = pytest.mark.django_db

RANKS = 2


@dataclass
class Gangs:
    """One group of each kind a first pass meets, `count` gangs each."""

    starting: list[Job]
    admitted: list[Job]
    victims: list[Job]
    deaf: list[Job]


def stop(job: Job, *, signalled: bool) -> None:
    """A preemption of the job's attempt; with `signalled`, one whose signal was sent
    and whose deadline has passed (ranks that ignore the signal: the runtime was not
    told, so they run on)."""
    now = timezone.now()
    Job.objects.filter(pk=job.pk).update(state=JobState.PREEMPTING, preempting_at=now)
    PreemptionEvent.objects.create(
        victim_attempt=Attempt.objects.get(job=job),
        job=job,
        reason=PreemptionEvent.Reason.PRIORITY,
        decided_at=now - timedelta(seconds=60 if signalled else 0),
        grace_seconds=30,
        deadline=now - timedelta(seconds=30) if signalled else now + timedelta(seconds=30),
        signal_sent_at=now - timedelta(seconds=60) if signalled else None,
    )


def gangs(world: Any, mimic: MimicRuntime, count: int) -> Gangs:
    starting = [launched(world, mimic, ranks=RANKS) for _ in range(count)]
    admitted = []
    for _ in range(count):
        job = builders.job(world, world.nlp, state=JobState.ADMITTED, ranks=RANKS)
        attempt = builders.attempt(job, action=Attempt.Action.LAUNCH)
        builders.ranks(attempt, state=Rank.State.STARTING)
        admitted.append(job)
    victims = [launched(world, mimic, ranks=RANKS) for _ in range(count)]
    deaf = [launched(world, mimic, ranks=RANKS) for _ in range(count)]
    for job in victims:
        stop(job, signalled=False)
    for job in deaf:
        stop(job, signalled=True)
    return Gangs(starting, admitted, victims, deaf)


def first_pass(mimic: MimicRuntime, group: Gangs) -> int:
    """The queries of one pass over every open attempt, after which this group's
    attempts are closed and their gangs forgotten, so the next group's pass meets
    only its own."""
    with CaptureQueriesContext(connection) as captured:
        assert reconcile_jobs(runtime=mimic) == 4 * len(group.starting)
    check(mimic, group)
    jobs = [*group.starting, *group.admitted, *group.victims, *group.deaf]
    Attempt.objects.filter(job__in=jobs).update(
        ended_at=timezone.now(), end_reason=Attempt.EndReason.SUCCEEDED
    )
    Job.objects.filter(pk__in=[job.pk for job in jobs]).update(state=JobState.SUCCEEDED)
    for job in jobs:
        mimic.kill(GangId(job.pk, 1))
        mimic.forget(GangId(job.pk, 1))
    return len(captured)


def check(mimic: MimicRuntime, group: Gangs) -> None:
    """What deciding and acting one by one gave each gang."""
    for job in group.starting:
        assert Job.objects.get(pk=job.pk).state == JobState.RUNNING
        assert set(Rank.objects.filter(attempt__job=job).values_list("state", flat=True)) == {
            Rank.State.RUNNING
        }
    for job in group.admitted:
        attempt = Attempt.objects.get(job=job)
        assert attempt.launched_at is not None
        assert attempt.action == Attempt.Action.NONE
        assert [o.phase for o in mimic.observe(GangId(job.pk, 1))] == ["running"] * RANKS
    for job in group.victims:
        attempt = Attempt.objects.get(job=job)
        event = PreemptionEvent.objects.get(victim_attempt=attempt)
        assert (attempt.action, attempt.action_claimed_at) == (Attempt.Action.NONE, None)
        assert event.signal_sent_at is not None and event.killed_at is None
        ranks = Rank.objects.filter(attempt=attempt)
        assert set(ranks.values_list("signal_sent_at", flat=True)) == {event.signal_sent_at}
        assert set(ranks.values_list("state", flat=True)) == {Rank.State.RUNNING}
        assert Job.objects.get(pk=job.pk).state == JobState.PREEMPTING
        record = mimic.record(GangId(job.pk, 1))
        assert record is not None and "signal_sent_at" in record
    for job in group.deaf:
        attempt = Attempt.objects.get(job=job)
        event = PreemptionEvent.objects.get(victim_attempt=attempt)
        assert attempt.action == Attempt.Action.NONE
        assert event.killed_at is not None
        assert event.outcome == ""
        record = mimic.record(GangId(job.pk, 1))
        assert record is not None and "killed_at" in record


def test_a_first_pass_costs_the_same_queries_over_five_gangs_of_each_kind_as_over_fifty(
    world: Any, mimic: MimicRuntime
) -> None:
    few = first_pass(mimic, gangs(world, mimic, 5))
    many = first_pass(mimic, gangs(world, mimic, 50))
    assert many == few
    assert few < 60, "a few dozen queries, not a dozen per gang"


def test_a_victim_whose_stop_waits_for_a_claim_is_decided_on_its_own(
    world: Any, mimic: MimicRuntime
) -> None:
    """A stop whose signal another worker has claimed is that worker's: the pass
    neither signals it again nor records anything of it, beside the ones it signals."""
    group = gangs(world, mimic, 2)
    claimed_job = group.victims[0]
    claimed_at = timezone.now()
    Attempt.objects.filter(job=claimed_job).update(
        action=Attempt.Action.SIGNAL, action_claimed_at=claimed_at
    )
    reconcile_jobs(runtime=mimic)
    attempt = Attempt.objects.get(job=claimed_job)
    assert (attempt.action, attempt.action_claimed_at) == (Attempt.Action.SIGNAL, claimed_at)
    assert PreemptionEvent.objects.get(victim_attempt=attempt).signal_sent_at is None
    record = mimic.record(GangId(claimed_job.pk, 1))
    assert record is not None and "signal_sent_at" not in record
    other = Attempt.objects.get(job=group.victims[1])
    assert PreemptionEvent.objects.get(victim_attempt=other).signal_sent_at is not None
