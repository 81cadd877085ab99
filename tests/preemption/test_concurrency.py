"""Two processes run scheduling cycles at the same moment, 50 rounds, on
PostgreSQL: no job is admitted twice, (job, attempt, rank) stays unique and no
victim attempt gets a second PreemptionEvent. A cycle that finds another one
already waiting for the lock leaves the planning to that one."""

from __future__ import annotations

import multiprocessing
import random
import threading
import traceback
from datetime import timedelta
from typing import Any

import pytest
from django.db import IntegrityError, connection, connections, transaction
from django.db.models import Count
from django.utils import timezone

from preemption.cycle import CYCLE_LOCK_KEY, CycleResult, schedule_cycle
from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.services import job_submit
from tests import builders
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]
ROUNDS = 50


def _advance_world(rng: random.Random, world_ids: dict[str, Any]) -> None:
    """Play the runtime between rounds: victims exit and requeue, admitted jobs
    start, some jobs finish and new ones arrive."""
    now = timezone.now()
    for job in Job.objects.filter(state=JobState.PREEMPTING):
        Attempt.objects.filter(job=job, ended_at__isnull=True).update(
            ended_at=now, end_reason="preempted"
        )
        Job.objects.filter(pk=job.pk).update(state=JobState.REQUEUED, requeued_at=now)
    Job.objects.filter(state=JobState.ADMITTED).update(state=JobState.RUNNING, running_at=now)
    for job in Job.objects.filter(state=JobState.RUNNING).order_by("?")[: rng.randint(0, 2)]:
        Attempt.objects.filter(job=job, ended_at__isnull=True).update(
            ended_at=now, end_reason="succeeded"
        )
        Job.objects.filter(pk=job.pk).update(state=JobState.SUCCEEDED, finished_at=now)
    from django.contrib.auth import get_user_model

    from quotas.models import PriorityClass, ResourceFlavor, Team

    user = get_user_model().objects.get(pk=world_ids["user"])
    for _ in range(rng.randint(0, 3)):
        job_submit(
            submitter=user,
            team=Team.objects.get(pk=rng.choice(world_ids["teams"])),
            flavor=ResourceFlavor.objects.get(pk=world_ids["flavor"]),
            ranks=rng.choice([1, 1, 2, 3]),
            gpus_per_rank=rng.choice([1, 2, 4, 8]),
            command="true",
            priority_class=PriorityClass.objects.get(pk=rng.choice(world_ids["classes"])),
        )


def _cycler(index: int, barrier: Any, errors: Any, world_ids: dict[str, Any]) -> None:
    connections.close_all()
    rng = random.Random(index)
    try:
        for _ in range(ROUNDS):
            barrier.wait(timeout=60)
            schedule_cycle(act=False)
            barrier.wait(timeout=60)
            if index == 0:
                _advance_world(rng, world_ids)
    except IntegrityError:
        errors.put(f"process {index}: {traceback.format_exc()}")
    except Exception:
        errors.put(f"process {index}: {traceback.format_exc()}")
        barrier.abort()
    finally:
        connections.close_all()


def test_two_cycles_at_once_never_double_admit_or_double_preempt(world: Any) -> None:
    assert connection.vendor == "postgresql", "this test proves the PostgreSQL lock"
    for index in range(12):
        job_submit(
            submitter=world.users["researcher"],
            team=[world.vision, world.nlp, world.ops][index % 3],
            flavor=world.h100,
            ranks=1 + index % 2,
            gpus_per_rank=[2, 4, 8][index % 3],
            command="true",
            priority_class=world.batch if index % 4 else world.critical,
        )
    world_ids = {
        "user": world.users["researcher"].pk,
        "teams": [world.vision.pk, world.nlp.pk, world.ops.pk],
        "flavor": world.h100.pk,
        "classes": [world.batch.pk, world.critical.pk],
    }
    connections.close_all()
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(2)
    errors = context.Queue()
    processes = [
        context.Process(target=_cycler, args=(i, barrier, errors, world_ids)) for i in range(2)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=500)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in processes)

    assert Attempt.objects.count() > 20, "the rounds admitted work"
    assert PreemptionEvent.objects.exists(), "the rounds preempted work"
    duplicated_ranks = (
        Rank.objects.values("attempt_id", "index").annotate(n=Count("id")).filter(n__gt=1)
    )
    assert not duplicated_ranks.exists()
    per_attempt = (
        PreemptionEvent.objects.values("victim_attempt_id").annotate(n=Count("id")).filter(n__gt=1)
    )
    assert not per_attempt.exists()
    open_attempts = (
        Attempt.objects.filter(ended_at__isnull=True).values("job_id").annotate(n=Count("id"))
    )
    assert all(row["n"] == 1 for row in open_attempts)
    # Every attempt's ranks match its job's gang: admitted whole, once.
    for attempt in Attempt.objects.select_related("job"):
        assert attempt.rank_set.count() == attempt.job.ranks
    assert timezone.now() - Attempt.objects.latest("admitted_at").admitted_at < timedelta(
        minutes=10
    )


def _cycle_waiters() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s"
            " AND NOT granted",
            [CYCLE_LOCK_KEY],
        )
        return int(cursor.fetchone()[0])


def test_a_cycle_that_finds_another_waiting_for_the_lock_does_nothing(world: Any) -> None:
    assert connection.vendor == "postgresql", "this test proves the PostgreSQL lock"
    job = builders.job(world, world.vision, state=JobState.PENDING)
    holding, release = threading.Event(), threading.Event()
    waited: list[CycleResult] = []

    def running_cycle() -> None:  # holds the lock as a cycle in progress does
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [CYCLE_LOCK_KEY])
                holding.set()
                release.wait(timeout=60)
        finally:
            connection.close()

    def waiting_cycle() -> None:
        try:
            waited.append(schedule_cycle(act=False))
        finally:
            connection.close()

    threads = [threading.Thread(target=running_cycle), threading.Thread(target=waiting_cycle)]
    threads[0].start()
    try:
        assert holding.wait(timeout=30)
        threads[1].start()
        wait_until(lambda: _cycle_waiters() == 1, "the second cycle to wait for the lock")
        third = schedule_cycle(act=False)
        assert third.skipped and not third.admitted
        assert _cycle_waiters() == 1, "the third cycle did not wait"
        assert not Attempt.objects.filter(job=job).exists()
    finally:
        release.set()
        for thread in threads:
            thread.join(timeout=60)
    # The cycle that waited planned once the lock was free, and saw the job.
    assert [(r.skipped, r.admitted) for r in waited] == [(False, [job.pk])]
