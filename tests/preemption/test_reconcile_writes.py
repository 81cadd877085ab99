"""A reconcile pass reads and claims its attempts in a fixed number of queries,
however many. The gangs that start or end on their own are decided together, and
closed together, and each still gets what deciding and closing one by one gave it:
its ranks' new state, its job's move to running, its attempt ended as succeeded and
forgotten, its job succeeded, one webhook notice, and nothing for an attempt another
worker closed first. What grows with the attempts is only the writes of those that
need more (a savepoint each, their own ranks and job)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from django.db import OperationalError, connection, transaction
from django.db.models.signals import post_init, pre_init
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from psycopg.errors import DeadlockDetected

from preemption.cycle import schedule_cycle
from preemption.models import (
    Attempt,
    Job,
    JobState,
    PreemptionEvent,
    Rank,
    Webhook,
    WebhookDelivery,
)
from preemption.reconcile import decide as decide_stage
from preemption.reconcile import finish as finish_stage
from preemption.reconcile import passes as passes_stage
from preemption.reconcile import reconcile_jobs, request_stop
from preemption.reconcile.finish import ClosedTogether
from preemption.reconcile.steps import FINISH, Step, loaded
from preemption.runtimes import GangId
from preemption.runtimes.mimic import MimicRuntime
from tests import builders
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db

# How long a mimicked gang runs: long enough that the pass after the launch sees it
# running on a loaded machine, short enough to wait for its end.
SECONDS = 3
# Each more attempt of a pass costs at most its savepoint and its release, one
# write of its (one) rank and one of its job.
PER_ATTEMPT = 4


def submit(world: Any, teams: list[Any], seconds: float = SECONDS) -> list[Job]:
    return [
        builders.job(world, team, state=JobState.PENDING, command=f"sleep {seconds}")
        for team in teams
    ]


def queries(work: Any) -> int:
    with CaptureQueriesContext(connection) as captured:
        work()
    return len(captured)


def run_to_the_end(jobs: list[Job], runtime: MimicRuntime) -> tuple[int, int]:
    """Admit and launch the jobs, then the pass that sees them running and the
    one that sees them ended: the queries of those two passes."""
    schedule_cycle()
    gangs = [GangId(job.pk, 1) for job in jobs]
    assert all(runtime.observe(gang) for gang in gangs), "every job launched"
    running = queries(reconcile_jobs)
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {
        JobState.RUNNING
    }
    wait_until(
        lambda: all(o.phase == "exited" for gang in gangs for o in runtime.observe(gang)),
        "every gang's time over",
        timeout=30,
    )
    ended = queries(reconcile_jobs)
    return running, ended


def test_a_pass_over_many_attempts_costs_only_their_own_writes_more(
    world: Any, mimic: MimicRuntime
) -> None:
    hooks = [
        Webhook.objects.create(team=team, url=f"https://hooks.example.org/{team.slug}")
        for team in (world.vision, world.nlp)
    ]
    few = submit(world, [world.vision] * 2)
    few_running, few_ended = run_to_the_end(few, mimic)
    many = submit(world, [world.vision] * 6 + [world.nlp] * 6)
    many_running, many_ended = run_to_the_end(many, mimic)

    # Gangs seen running for the first time are decided together: twelve cost what two cost.
    assert many_running == few_running
    assert many_ended - few_ended <= 10 * PER_ATTEMPT
    for job in [*few, *many]:
        job.refresh_from_db()
        assert job.state == JobState.SUCCEEDED
        assert job.finished_at is not None
        attempt = Attempt.objects.get(job=job)
        assert (attempt.end_reason, attempt.action) == (
            Attempt.EndReason.SUCCEEDED,
            Attempt.Action.NONE,
        )
        assert attempt.ended_at == job.finished_at
        assert mimic.observe(GangId(job.pk, 1)) == [], "the gang is forgotten"
    notices = WebhookDelivery.objects.filter(webhook__in=hooks, event="finished")
    assert sorted(n.payload["job"]["id"] for n in notices) == sorted(j.pk for j in [*few, *many])
    assert all(n.payload["state"] == "succeeded" for n in notices)
    assert all(n.payload["exit_codes"] == [0] for n in notices)


def test_a_pass_builds_the_attempts_of_only_the_gangs_that_changed(
    world: Any, mimic: MimicRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steady gangs are told from plain rows: a pass over them builds no attempt,
    and one whose gang stopped on its own is read whole and closed."""
    jobs = [
        builders.job(world, world.vision, state=JobState.PENDING, command="sleep 60")
        for _ in range(3)
    ]
    schedule_cycle()
    reconcile_jobs()
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {
        JobState.RUNNING
    }
    built: list[int] = []
    read_whole = passes_stage.loaded

    def count(rows: Any, *related: str) -> list[Any]:
        objs = read_whole(rows, *related)
        built.extend(obj.pk for obj in objs if isinstance(obj, Attempt))
        return objs

    monkeypatch.setattr(passes_stage, "loaded", count)
    assert reconcile_jobs() == 3
    assert built == [], "every gang runs as recorded: no attempt is built"
    stopped = jobs[1]
    mimic.signal(GangId(stopped.pk, 1), grace_seconds=5)
    assert reconcile_jobs() == 3
    assert set(built) == {Attempt.objects.get(job=stopped).pk}
    states = dict(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("pk", "state"))
    assert states == {
        jobs[0].pk: JobState.RUNNING,
        stopped.pk: JobState.SUCCEEDED,
        jobs[2].pk: JobState.RUNNING,
    }


def three_ended(world: Any) -> tuple[list[Job], list[Attempt]]:
    """Three jobs of vision whose mimicked work is over, and their attempts."""
    jobs = submit(world, [world.vision] * 3)
    schedule_cycle()
    reconcile_jobs()
    time.sleep(SECONDS)
    attempts = list(Attempt.objects.filter(job__in=jobs).select_related("job").order_by("job_id"))
    return jobs, attempts


def test_an_attempt_closed_by_another_worker_first_is_left_alone(
    world: Any, mimic: MimicRuntime
) -> None:
    jobs, attempts = three_ended(world)
    # Another worker closed the first (and the job went on to a state of its own).
    other_end = timezone.now()
    Attempt.objects.filter(pk=attempts[0].pk).update(
        ended_at=other_end, end_reason=Attempt.EndReason.FAILED
    )
    Job.objects.filter(pk=jobs[0].pk).update(state=JobState.FAILED)
    steps = [Step(FINISH, attempt) for attempt in attempts]
    items = [(step, [], []) for step in steps]
    with transaction.atomic():
        closed = finish_stage._close_succeeded_together(items, timezone.now())
    assert closed == ClosedTogether({attempts[1].pk, attempts[2].pk}, set())
    assert Job.objects.get(pk=jobs[0].pk).state == JobState.FAILED
    first = Attempt.objects.get(pk=attempts[0].pk)
    assert (first.ended_at, first.end_reason) == (other_end, Attempt.EndReason.FAILED)
    for job in jobs[1:]:
        assert Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED


def test_an_attempt_whose_stop_was_decided_since_the_pass_read_it_is_not_closed_together(
    world: Any, mimic: MimicRuntime
) -> None:
    jobs, attempts = three_ended(world)
    # Read by the pass with no stop; the scheduler then decided to stop the second.
    steps = [Step(FINISH, attempt) for attempt in attempts]
    stop = request_stop(job=jobs[1], reason="priority", cause="a critical job")
    assert stop is not None
    items = [(step, [], []) for step in steps]
    with transaction.atomic():
        closed = finish_stage._close_succeeded_together(items, timezone.now())
    assert closed == ClosedTogether({attempts[0].pk, attempts[2].pk}, {attempts[1].pk})
    # Left for the close one by one, which judges the stop: nothing of it was written.
    second = Attempt.objects.get(pk=attempts[1].pk)
    assert second.ended_at is None and second.end_reason == ""
    assert Job.objects.get(pk=jobs[1].pk).state == JobState.PREEMPTING
    assert PreemptionEvent.objects.get(pk=stop.pk).outcome == ""
    for job in (jobs[0], jobs[2]):
        assert Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED


def test_when_closing_together_fails_each_attempt_is_closed_on_its_own(
    world: Any, mimic: MimicRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = submit(world, [world.vision] * 3)
    schedule_cycle()
    reconcile_jobs()

    def broken(*_: Any) -> set[int]:
        Job.objects.filter(pk=jobs[0].pk).update(failure_reason="written by the batch")
        raise ValueError("a row the batch could not take")

    monkeypatch.setattr(finish_stage, "_close_succeeded", broken)
    wait_until(
        lambda: all(o.phase == "exited" for j in jobs for o in mimic.observe(GangId(j.pk, 1))),
        "every gang's time over",
        timeout=30,
    )
    reconcile_jobs()
    # The batch's own write was undone, and every attempt was closed one by one.
    assert Job.objects.get(pk=jobs[0].pk).failure_reason == ""
    states = set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True))
    assert states == {JobState.SUCCEEDED}
    assert set(Attempt.objects.filter(job__in=jobs).values_list("end_reason", flat=True)) == {
        Attempt.EndReason.SUCCEEDED
    }


def test_plain_ends_are_decided_together_and_the_rest_one_by_one(
    world: Any, mimic: MimicRuntime
) -> None:
    """Gangs that ended the common way (every rank exited 0, nothing asked of them)
    are decided in a fixed number of queries: twelve cost what two cost. A failed
    rank and a job still marked admitted in the same pass get what `_decide` gives
    them one by one."""

    def ended_pass(count: int) -> tuple[list[Job], int]:
        jobs = submit(world, [world.vision, world.nlp] * (count // 2))
        schedule_cycle()
        reconcile_jobs()  # sees them running
        wait_until(
            lambda: all(o.phase == "exited" for j in jobs for o in mimic.observe(GangId(j.pk, 1))),
            "every gang's time over",
            timeout=30,
        )
        return jobs, queries(lambda: reconcile_jobs(job_ids=[j.pk for j in jobs], runtime=mimic))

    few, few_queries = ended_pass(2)
    many, many_queries = ended_pass(12)
    assert many_queries == few_queries
    for job in [*few, *many]:
        assert Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED
        assert set(Rank.objects.filter(attempt__job=job).values_list("state", "exit_code")) == {
            ("exited", 0)
        }

    # A failed gang, and a job whose running state no pass recorded yet, beside a plain end.
    plain, failed, fresh = submit(world, [world.vision, world.vision, world.nlp])
    Job.objects.filter(pk=failed.pk).update(command="sleep 60")
    schedule_cycle()
    assert Job.objects.get(pk=fresh.pk).state == JobState.ADMITTED
    mimic.kill(GangId(failed.pk, 1))
    wait_until(
        lambda: all(
            o.phase == "exited" for j in (plain, fresh) for o in mimic.observe(GangId(j.pk, 1))
        ),
        "the plain gangs' time over",
        timeout=30,
    )
    reconcile_jobs()
    outcomes = dict(
        Attempt.objects.filter(job__in=[plain, failed, fresh]).values_list("job_id", "end_reason")
    )
    assert outcomes == {
        plain.pk: Attempt.EndReason.SUCCEEDED,
        failed.pk: Attempt.EndReason.FAILED,
        fresh.pk: Attempt.EndReason.SUCCEEDED,
    }
    assert Job.objects.get(pk=fresh.pk).running_at is not None


def test_an_end_seen_before_its_launch_was_recorded_is_decided_with_the_rest(
    world: Any, mimic: MimicRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short job in a large batch of launches often ends before the worker that
    launched it records the launch. A pass that read the attempt before that record
    and observed the gang after its end still decides it with the plain ends: ranks
    that all exited ran, so the launch came first."""
    jobs = submit(world, [world.vision, world.nlp] * 3)
    schedule_cycle()
    reconcile_jobs()
    gangs = [GangId(job.pk, 1) for job in jobs]
    wait_until(
        lambda: all(o.phase == "exited" for gang in gangs for o in mimic.observe(gang)),
        "every gang's time over",
        timeout=30,
    )
    attempts = Attempt.objects.filter(job__in=jobs)
    launched = dict(attempts.values_list("pk", "launched_at"))
    # The launching worker's claim is under way and nothing of it is recorded yet.
    attempts.update(
        launched_at=None, action=Attempt.Action.LAUNCH, action_claimed_at=timezone.now()
    )
    observe = mimic.observe

    def observe_then_record(gang: GangId | None = None) -> list[Any]:
        seen = observe(gang)
        for pk, at in launched.items():
            Attempt.objects.filter(pk=pk).update(
                launched_at=at, action=Attempt.Action.NONE, action_claimed_at=None
            )
        return seen

    decided_alone: list[int] = []
    decide = decide_stage._decide

    def one_by_one(attempt: Attempt, *args: Any, **kwargs: Any) -> Any:
        decided_alone.append(attempt.job_id)
        return decide(attempt, *args, **kwargs)

    monkeypatch.setattr(mimic, "observe", observe_then_record)
    monkeypatch.setattr(decide_stage, "_decide", one_by_one)
    reconcile_jobs(job_ids=[job.pk for job in jobs], runtime=mimic)

    assert decided_alone == []
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {
        JobState.SUCCEEDED
    }
    assert dict(attempts.values_list("pk", "launched_at")) == launched
    assert set(attempts.values_list("end_reason", flat=True)) == {Attempt.EndReason.SUCCEEDED}


def test_when_deciding_plain_ends_together_fails_each_is_decided_on_its_own(
    world: Any, mimic: MimicRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = submit(world, [world.vision] * 3)
    schedule_cycle()
    reconcile_jobs()
    bulk_update = Rank.objects.bulk_update

    def broken(*args: Any, **kwargs: Any) -> int:
        bulk_update(*args, **kwargs)
        raise ValueError("a rank the batch could not take")

    monkeypatch.setattr(Rank.objects, "bulk_update", broken)
    wait_until(
        lambda: all(o.phase == "exited" for j in jobs for o in mimic.observe(GangId(j.pk, 1))),
        "every gang's time over",
        timeout=30,
    )
    reconcile_jobs()
    # The batch's write was undone and each attempt decided and closed one by one.
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {
        JobState.SUCCEEDED
    }
    assert set(Rank.objects.filter(attempt__job__in=jobs).values_list("state", "exit_code")) == {
        ("exited", 0)
    }


def test_a_pass_undone_by_a_deadlock_decides_again_at_the_next_pass(
    world: Any, mimic: MimicRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decide step locks a pass's jobs, then their ranks; a writer that locked
    the other way round (none of the project's own does) would deadlock with it.
    When the database breaks such a deadlock by undoing the pass, the pass keeps
    nothing and the next one decides again. The gangs run long enough that the
    second pass sees them running on a loaded machine too."""
    jobs = submit(world, [world.vision] * 2, seconds=600)
    schedule_cycle()
    lock_rows = decide_stage._lock_rows

    def deadlocked(attempts: list[Attempt]) -> Any:
        lock_rows(attempts)
        Job.objects.filter(pk=jobs[0].pk).update(failure_reason="written before the deadlock")
        raise OperationalError("deadlock detected") from DeadlockDetected("deadlock detected")

    monkeypatch.setattr(decide_stage, "_lock_rows", deadlocked)
    assert reconcile_jobs() == 0
    assert Job.objects.get(pk=jobs[0].pk).failure_reason == ""
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {
        JobState.ADMITTED
    }
    monkeypatch.setattr(decide_stage, "_lock_rows", lock_rows)
    assert reconcile_jobs() == 2
    assert set(Job.objects.filter(pk__in=[j.pk for j in jobs]).values_list("state", flat=True)) == {
        JobState.RUNNING
    }


@pytest.mark.parametrize(("side_by_side", "in_pool_threads"), [(1, False), (8, True)])
def test_a_runtime_says_how_many_of_its_calls_a_pass_makes_side_by_side(
    world: Any,
    mimic: MimicRuntime,
    monkeypatch: pytest.MonkeyPatch,
    side_by_side: int,
    in_pool_threads: bool,
) -> None:
    """The mimic's calls never wait, so a pass makes them in its own thread; a runtime
    whose calls wait on a launcher or an API server gets them made side by side."""
    monkeypatch.setattr(mimic, "calls_side_by_side", side_by_side)
    callers: list[int] = []
    launch = mimic.launch

    def recorded(spec: Any) -> None:
        callers.append(threading.get_ident())
        launch(spec)

    monkeypatch.setattr(mimic, "launch", recorded)
    jobs = submit(world, [world.vision] * 4)
    schedule_cycle()
    assert len(callers) == len(jobs), "every admitted job launched in the cycle"
    assert all(mimic.observe(GangId(job.pk, 1)) for job in jobs)
    main = threading.get_ident()
    assert all((caller != main) == in_pool_threads for caller in callers), callers


def test_objects_loaded_from_rows_are_those_django_builds(world: Any, mimic: MimicRuntime) -> None:
    """`loaded` builds the attempts a pass decides for, with their jobs, teams,
    classes, flavors and stops, from plain rows and not through `__init__`: each is
    what `select_related` gives, field for field, related object for related object
    (a stop or none), and can be saved as any other. Building them so skips the
    `pre_init` and `post_init` signals, so no receiver may listen for these models."""
    jobs = submit(world, [world.vision, world.vision, world.nlp])
    schedule_cycle()
    reconcile_jobs()
    request_stop(job=jobs[0], reason="manual", cause="by a test")
    related = ("job", "job__team", "job__priority_class", "job__flavor")
    ours = loaded(Attempt.objects.order_by("pk"), *related, "preemption")
    django = list(Attempt.objects.order_by("pk").select_related(*related, "preemption"))
    assert len(ours) == len(django) == 3

    def columns(obj: Any) -> dict[str, Any]:
        return {f.attname: getattr(obj, f.attname) for f in obj._meta.concrete_fields}

    for mine, theirs in zip(ours, django, strict=True):
        assert columns(mine) == columns(theirs)
        for path in related:
            a, b = mine, theirs
            for name in path.split("__"):
                a, b = getattr(a, name), getattr(b, name)
            assert (type(a), columns(a)) == (type(b), columns(b))
        stop = getattr(theirs, "preemption", None)
        if stop is None:
            with pytest.raises(PreemptionEvent.DoesNotExist):
                mine.preemption  # noqa: B018
        else:
            assert columns(mine.preemption) == columns(stop)
    with CaptureQueriesContext(connection) as captured:
        for mine in ours:
            mine.job.team.slug  # noqa: B018
            getattr(mine, "preemption", None)
    assert len(captured) == 0, "every related object is loaded along"
    ours[1].action_error = "saved"
    ours[1].save(update_fields=["action_error"])
    assert Attempt.objects.get(pk=ours[1].pk).action_error == "saved"
    for model in (Attempt, Job, Rank, PreemptionEvent):
        for signal in (pre_init, post_init):
            assert not signal.has_listeners(model), f"{model.__name__} has a {signal} receiver"
