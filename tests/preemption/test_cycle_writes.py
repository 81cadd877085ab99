"""The scheduling cycle records its decisions in a fixed number of queries,
however many jobs it admits or preempts, and records each decision as before:
attempts numbered after the job's last, one rank per placed rank, one
preemption and one webhook notice per victim, waiting reasons where they
changed, and nothing for a job that left its state since the snapshot."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

import fairshare
from preemption.cycle import CycleResult, _apply, schedule_cycle
from preemption.models import (
    Attempt,
    Checkpoint,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    Webhook,
    WebhookDelivery,
)
from preemption.snapshot import build_snapshot, held_jobs, read_snapshot, workload_id
from quotas.models import PriorityClass
from tests import builders

pytestmark = pytest.mark.django_db


def submit(world: Any, team: Any, count: int, **fields: Any) -> list[Job]:
    return [
        builders.job(world, team, state=JobState.PENDING, command="true", **fields)
        for _ in range(count)
    ]


def cycle_queries() -> tuple[int, CycleResult]:
    with CaptureQueriesContext(connection) as queries:
        result = schedule_cycle(act=False)
    return len(queries), result


def test_admitting_many_jobs_takes_as_many_queries_as_admitting_two(world: Any) -> None:
    # A first cycle, so that both measured ones read running jobs too.
    first = submit(world, world.vision, 1)
    schedule_cycle(act=False)
    two = submit(world, world.vision, 2)
    few_queries, few = cycle_queries()
    assert sorted(few.admitted) == sorted(job.pk for job in two)

    # A job that ran before gets the next attempt number, not 1.
    again = builders.job(world, world.nlp, state=JobState.REQUEUED, command="true", ranks=2)
    builders.attempt(again, ended_at=timezone.now(), end_reason=Attempt.EndReason.PREEMPTED)
    many = [*submit(world, world.nlp, 13), again]
    many_queries, most = cycle_queries()
    assert sorted(most.admitted) == sorted(job.pk for job in many)
    assert many_queries == few_queries

    for job in [*first, *two, *many]:
        job.refresh_from_db()
        assert (job.state, job.waiting_reason) == (JobState.ADMITTED, "")
        opened = Attempt.objects.get(job=job, ended_at__isnull=True)
        assert opened.number == (2 if job == again else 1)
        assert opened.admitted_at == job.admitted_at
        placed = sum(entry["ranks"] for entry in opened.placement)
        assert placed == job.ranks
        assert sorted(Rank.objects.filter(attempt=opened).values_list("index", flat=True)) == list(
            range(job.ranks)
        )


def test_a_job_cancelled_after_the_snapshot_is_not_admitted(world: Any) -> None:
    kept, cancelled = submit(world, world.vision, 2)
    now = timezone.now()
    snapshot, held, shown = read_snapshot(now=now)
    plan = fairshare.plan(snapshot)
    assert {int(a.id) for a in plan.admit} == {kept.pk, cancelled.pk}
    Job.objects.filter(pk=cancelled.pk).update(state=JobState.CANCELLED, finished_at=now)

    result = CycleResult()
    _apply(plan, now=now, result=result, held=held, shown=shown)

    assert result.admitted == [kept.pk]
    assert not Attempt.objects.filter(job=cancelled).exists()
    cancelled.refresh_from_db()
    assert cancelled.state == JobState.CANCELLED


def test_a_job_cancelled_after_the_snapshot_keeps_its_own_waiting_reason(world: Any) -> None:
    # 24 GPUs: three jobs of 8 run, the fourth waits.
    jobs = submit(world, world.vision, 4, ranks=1, gpus_per_rank=8)
    now = timezone.now()
    snapshot, held, shown = read_snapshot(now=now)
    plan = fairshare.plan(snapshot)
    (waiting,) = [job for job in jobs if job.pk in {int(w.id) for w in plan.waiting}]
    Job.objects.filter(pk=waiting.pk).update(
        state=JobState.CANCELLED, finished_at=now, waiting_reason=""
    )

    _apply(plan, now=now, result=CycleResult(), held=held, shown=shown)

    waiting.refresh_from_db()
    assert (waiting.state, waiting.waiting_reason) == (JobState.CANCELLED, "")


def test_every_victim_of_a_cycle_gets_one_preemption_and_one_notice(world: Any) -> None:
    long_ago = timezone.now() - timedelta(days=1)
    victims = [
        builders.running_job(world, world.ops, node=f"h100-node-{n}", admitted_at=long_ago)
        for n in range(3)
        for _ in range(8)
    ]
    hook = Webhook.objects.create(team=world.ops, url="https://hooks.example.org/ops")
    urgent = submit(world, world.vision, 1, priority_class=world.critical, ranks=1, gpus_per_rank=8)

    _, result = cycle_queries()

    assert len(result.preempted) == 8
    assert set(result.preempted) <= {job.pk for job in victims}
    events = PreemptionEvent.objects.filter(job_id__in=result.preempted)
    assert sorted(events.values_list("job_id", flat=True)) == sorted(result.preempted)
    for event in events.select_related("victim_attempt", "preemptor"):
        assert event.victim_attempt.job_id == event.job_id
        assert event.victim_attempt.ended_at is None
        assert event.preemptor == urgent[0]
        assert event.cause
        assert event.deadline == event.decided_at + timedelta(seconds=event.grace_seconds)
    assert set(Job.objects.filter(pk__in=result.preempted).values_list("state", flat=True)) == {
        JobState.PREEMPTING
    }
    notices = WebhookDelivery.objects.filter(webhook=hook, event="preempted")
    assert sorted(notice.payload["job"]["id"] for notice in notices) == sorted(result.preempted)
    assert {notice.payload["job"]["state"] for notice in notices} == {JobState.PREEMPTING}

    # The snapshot says whom each victim's GPUs are freed for, and the next cycle keeps
    # them for that job: it waits for its own victims and stops no victim twice.
    victims_read = [w for w in build_snapshot().workloads if w.state == "terminating"]
    assert sorted(int(w.id) for w in victims_read) == sorted(result.preempted)
    assert {w.preemptor for w in victims_read} == {workload_id(urgent[0].pk)}
    _, again = cycle_queries()
    assert not set(again.preempted) & set(result.preempted)
    assert PreemptionEvent.objects.filter(job_id__in=result.preempted).count() == 8
    urgent[0].refresh_from_db()
    assert urgent[0].waiting_reason.startswith("waiting for 8 GPUs being released by jobs ")


def test_only_the_jobs_of_a_class_their_team_lost_are_held(world: Any) -> None:
    # Ops may now use the batch class only; vision keeps both.
    world.other.priority_classes.set([world.batch])
    barred = submit(world, world.ops, 2, priority_class=world.critical)
    submit(world, world.ops, 1, priority_class=world.batch)
    submit(world, world.vision, 3, priority_class=world.critical)
    # A running job of the lost class is left to finish, not held.
    builders.job(world, world.ops, state=JobState.RUNNING, priority_class=world.critical)
    with CaptureQueriesContext(connection) as few:
        held = held_jobs()
    assert set(held) == {job.pk for job in barred}
    assert all(
        reason.startswith("held: team ops may no longer use ai-prod-critical")
        for reason in held.values()
    )

    # The waiting jobs are read as (team, class) pairs: ten times as many jobs of the
    # same pairs cost the same queries.
    more = submit(world, world.ops, 20, priority_class=world.critical)
    submit(world, world.vision, 30, priority_class=world.critical)
    with CaptureQueriesContext(connection) as many:
        held = held_jobs()
    assert set(held) == {job.pk for job in [*barred, *more]}
    assert len(many) == len(few)

    # A cycle finds the same among the rows its snapshot reads, and plans none of them;
    # a barred job backing off is held too, though not planned while it backs off.
    backing_off = submit(
        world,
        world.ops,
        1,
        priority_class=world.critical,
        not_before=timezone.now() + timedelta(minutes=5),
    )
    snapshot, found, _ = read_snapshot()
    assert found == held_jobs()
    assert set(found) == {job.pk for job in [*barred, *more, *backing_off]}
    assert not {w.id for w in snapshot.workloads} & {str(job_id) for job_id in found}

    # Nothing barred: no job is read one by one.
    world.other.priority_classes.set([world.batch, world.critical])
    assert held_jobs() == {}


def test_waiting_reasons_are_written_where_they_changed(world: Any) -> None:
    # 24 GPUs: three jobs of 8 fit, the other twelve wait with one shared reason,
    # and a held job (a class its team may no longer use) waits with its own.
    waiting = submit(world, world.vision, 15, ranks=1, gpus_per_rank=8)
    held = builders.job(
        world, world.ops, state=JobState.PENDING, command="true", priority_class=world.critical
    )
    world.other.priority_classes.set([world.batch])
    _, result = cycle_queries()
    assert len(result.admitted) == 3
    reasons = dict(
        Job.objects.filter(
            pk__in=[job.pk for job in waiting if job.pk not in result.admitted]
        ).values_list("pk", "waiting_reason")
    )
    assert len(reasons) == 12
    assert len(set(reasons.values())) == 1
    assert next(iter(reasons.values())).startswith(("no node", "waiting", "not enough"))
    held.refresh_from_db()
    assert held.waiting_reason.startswith("held: team ops may no longer use ai-prod-critical")
    # What the next cycle compares its reasons with: every waiting job's row as it is.
    assert read_snapshot()[2] == {
        pk: (reason, until)
        for pk, reason, until in Job.objects.filter(
            state__in=[JobState.PENDING, JobState.REQUEUED]
        ).values_list("pk", "waiting_reason", "protected_until")
    }

    # Nothing changed: the next cycle writes no reason.
    with CaptureQueriesContext(connection) as queries:
        schedule_cycle(act=False)
    assert not [
        q for q in queries.captured_queries if "waiting_reason" in q["sql"] and "UPDATE" in q["sql"]
    ]


def test_every_waiting_reason_is_written_as_worded_and_only_while_its_job_waits(
    world: Any,
) -> None:
    """The reasons go in one statement on PostgreSQL (the distinct reasons as one
    array beside each job's number in it) and by shared reason on SQLite: either way
    each job gets its own words, quotes, commas, braces, backslashes and all, with its
    protection moment or none, cut at 300 characters; a job cancelled since the
    snapshot keeps its own, and one whose words did not change is left alone. Here
    every reason is shared by fewer than SHARED_REASON_JOBS jobs, so SQLite writes
    them in one statement too."""
    jobs = submit(world, world.vision, 6, ranks=1, gpus_per_rank=8)
    now = timezone.now()
    shown = read_snapshot(now=now)[2]
    odd = "a \"quoted\", {braced} reason \\ with a comma, 'apostrophe' and ümlaut"
    moment = now.timestamp() + 600.5
    words = {
        jobs[0].pk: ("no node of flavor h100 has 8 free GPUs", None),
        jobs[1].pk: ("no node of flavor h100 has 8 free GPUs", None),
        jobs[2].pk: (odd, moment),
        jobs[3].pk: ("x" * 400, None),
        jobs[4].pk: ("cancelled meanwhile", None),
        jobs[5].pk: (shown[jobs[5].pk][0], None),
    }
    Job.objects.filter(pk=jobs[4].pk).update(
        state=JobState.CANCELLED, waiting_reason="cancelled by its owner"
    )
    plan = fairshare.Plan(
        admit=(),
        preempt=(),
        waiting=tuple(
            fairshare.Waiting(workload_id(pk), reason, until)
            for pk, (reason, until) in words.items()
        ),
        queues={},
    )
    with CaptureQueriesContext(connection) as queries:
        _apply(plan, now=now, result=CycleResult(), held={}, shown=shown)
    written = [q for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    assert len(written) == 1
    rows = dict(Job.objects.filter(pk__in=words).values_list("pk", "waiting_reason"))
    assert rows[jobs[0].pk] == rows[jobs[1].pk] == "no node of flavor h100 has 8 free GPUs"
    assert rows[jobs[2].pk] == odd
    assert rows[jobs[3].pk] == "x" * 300
    assert rows[jobs[4].pk] == "cancelled by its owner"
    assert rows[jobs[5].pk] == shown[jobs[5].pk][0]
    until = Job.objects.get(pk=jobs[2].pk).protected_until
    assert until is not None and abs(until.timestamp() - moment) < 1e-3
    assert Job.objects.get(pk=jobs[0].pk).protected_until is None


def test_a_job_committed_while_the_cycle_read_its_snapshot_is_not_admitted_before_it_was_submitted(
    world: Any,
) -> None:
    # The cycle's clock was read before the job was committed, as when a submission
    # lands while the snapshot is being built.
    cycle_began = timezone.now()
    (job,) = submit(world, world.vision, 1)
    assert job.submitted_at > cycle_began
    snapshot, held, shown = read_snapshot(now=cycle_began)
    plan = fairshare.plan(snapshot)
    with transaction.atomic():
        _apply(plan, now=cycle_began, result=CycleResult(), held=held, shown=shown)
    job.refresh_from_db()
    assert job.state == JobState.ADMITTED
    assert job.admitted_at >= job.submitted_at
    assert Attempt.objects.get(job=job).admitted_at == job.admitted_at


def test_the_snapshot_reads_each_submission_time_to_the_microsecond(world: Any) -> None:
    # PostgreSQL answers the seconds since the epoch itself; the engine must see the
    # very number Python's own conversion gives, or equal jobs could swap places.
    moments = [
        timezone.now().replace(microsecond=m) - timedelta(days=d)
        for d, m in ((0, 1), (3, 999_999), (400, 123_457), (0, 0))
    ]
    jobs = []
    for index, moment in enumerate(moments):
        job = builders.job(world, world.vision, state=JobState.PENDING, name=f"at-{index}")
        Job.objects.filter(pk=job.pk).update(submitted_at=moment)
        jobs.append(job)
    seen = {w.id: w.submitted_at for w in build_snapshot().workloads}
    assert [seen[str(job.pk)] for job in jobs] == [moment.timestamp() for moment in moments]
    assert all(type(seen[str(job.pk)]) is float for job in jobs)
    # A moment is one number whatever time zone is current where the snapshot is built.
    with timezone.override("America/St_Johns"):
        seen = {w.id: w.submitted_at for w in build_snapshot().workloads}
    assert [seen[str(job.pk)] for job in jobs] == [moment.timestamp() for moment in moments]
    if connection.vendor == "postgresql":
        # Nor does the database session's own time zone change it.
        with connection.cursor() as cursor:
            cursor.execute("SET LOCAL TIME ZONE 'Asia/Kathmandu'")
        seen = {w.id: w.submitted_at for w in build_snapshot().workloads}
        assert [seen[str(job.pk)] for job in jobs] == [moment.timestamp() for moment in moments]


def test_the_snapshot_reads_each_admission_and_last_checkpoint_to_the_microsecond(
    world: Any,
) -> None:
    # The running jobs' admissions and checkpoints are answered as seconds too: R9
    # ranks victims by the work each would lose, the time since its last checkpoint.
    admitted = timezone.now().replace(microsecond=999_999) - timedelta(hours=3)
    checkpoints = [admitted + timedelta(minutes=m, microseconds=u) for m, u in ((5, 1), (40, 7))]
    saved = builders.running_job(world, world.vision, admitted_at=admitted)
    attempt = Attempt.objects.get(job=saved)
    for step, moment in enumerate(checkpoints, start=1):
        Checkpoint.objects.create(job=saved, attempt=attempt, step=step, committed_at=moment)
    # A checkpoint of an earlier attempt saves nothing of this one.
    stale = builders.running_job(world, world.vision, node="h100-node-1", admitted_at=admitted)
    Checkpoint.objects.create(job=stale, step=1, committed_at=admitted - timedelta(microseconds=1))
    never = builders.running_job(world, world.vision, node="h100-node-2", admitted_at=admitted)
    with timezone.override("America/St_Johns"):
        seen = {w.id: w for w in build_snapshot().workloads}
    assert seen[str(saved.pk)].admitted_at == admitted.timestamp()
    assert seen[str(saved.pk)].last_checkpoint_at == checkpoints[-1].timestamp()
    assert seen[str(stale.pk)].last_checkpoint_at is None
    assert seen[str(never.pk)].admitted_at == admitted.timestamp()
    assert seen[str(never.pk)].last_checkpoint_at is None
    assert all(type(seen[str(job.pk)].admitted_at) is float for job in (saved, stale, never))


def test_a_snapshot_reuses_a_workload_only_while_what_it_was_built_from_is_unchanged(
    world: Any,
) -> None:
    # A process that runs cycles keeps the workloads of its last snapshot and reuses the
    # unchanged ones (they are immutable); anything that changed is built again.
    edited, backing_off, same = submit(world, world.vision, 3)
    running = builders.running_job(world, world.nlp)
    first = {w.id: w for w in read_snapshot()[0].workloads}
    again = {w.id: w for w in read_snapshot()[0].workloads}
    assert all(again[key] is first[key] for key in first)
    # A look from a page builds its own and keeps none.
    looked = {w.id: w for w in build_snapshot().workloads}
    assert looked == first
    assert not any(looked[key] is first[key] for key in first)
    assert all(w is first[w.id] for w in read_snapshot()[0].workloads)

    Job.objects.filter(pk=edited.pk).update(ranks=2, priority_class=world.critical)
    Job.objects.filter(pk=backing_off.pk).update(not_before=timezone.now() + timedelta(hours=1))
    committed = timezone.now()
    Checkpoint.objects.create(
        job=running, attempt=Attempt.objects.get(job=running), step=1, committed_at=committed
    )
    later = {w.id: w for w in read_snapshot()[0].workloads}
    assert (later[str(edited.pk)].ranks, later[str(edited.pk)].priority_class) == (
        2,
        world.critical.name,
    )
    assert str(backing_off.pk) not in later
    assert later[str(running.pk)].last_checkpoint_at == committed.timestamp()
    assert later[str(running.pk)].placement == first[str(running.pk)].placement
    assert later[str(same.pk)] is first[str(same.pk)]

    # A renamed class is a new name for every job of it, changed row or not.
    PriorityClass.objects.filter(pk=world.batch.pk).update(name="batch-renamed")
    renamed = {w.id: w for w in read_snapshot()[0].workloads}
    assert renamed[str(same.pk)].priority_class == "batch-renamed"
    assert {pc.name for pc in read_snapshot()[0].priority_classes} >= {"batch-renamed"}

    # Admitted: the same job is a running workload now, on its attempt's placement.
    builders.attempt(same, placement=[{"node": "h100-node-3", "ranks": 1}])
    Job.objects.filter(pk=same.pk).update(state=JobState.RUNNING)
    admitted = {w.id: w for w in read_snapshot()[0].workloads}[str(same.pk)]
    assert (admitted.state, admitted.placement) == ("running", (("h100-node-3", 1),))
