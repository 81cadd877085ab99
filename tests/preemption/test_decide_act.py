"""Reconcile decides in a short transaction and calls the runtime after commit:
a launch in progress leaves the jobs table writable (on PostgreSQL and on the
embedded default's SQLite), a permanent runtime error fails only its own
attempt, and a temporary one is retried with backoff and shown on the job page.

The runtime is the real local runtime, with real processes; the held launch
only waits on an Event before launching, so the test can write the database
while the reconciler is inside a runtime call."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.db import connection, transaction
from django.utils import timezone

from preemption.cycle import schedule_cycle
from preemption.models import Attempt, Job, JobState, Rank
from preemption.reconcile import decide as decide_stage
from preemption.reconcile import launch_admitted, reconcile_jobs
from preemption.runtimes import GangId, GangSpec, LocalRuntime
from preemption.services import job_submit
from tests.preemption.conftest import sleeper_command, state_of
from tests.waiting import wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]
LOCK_WAIT_SECONDS = 2.0


def submit(world: Any, team: Any, *, seconds: float = 0.5, name: str = "") -> Job:
    return job_submit(
        submitter=world.users["researcher"],
        team=team,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=1,
        command=sleeper_command(seconds),
        priority_class=world.batch,
        name=name,
    )


def admitted_pair(world: Any, first: str, second: str) -> tuple[Job, Job]:
    """Two jobs of two teams, admitted by one cycle and not launched yet."""
    jobs = submit(world, world.vision, name=first), submit(world, world.ops, name=second)
    schedule_cycle(act=False)
    assert [state_of(job) for job in jobs] == [JobState.ADMITTED] * 2
    return jobs


class HeldLaunch(LocalRuntime):
    """The local runtime, whose launches (or only the launch of `held_job`) first wait
    until the test lets them go; it notes when each launch returned."""

    def __init__(self, *args: Any, held_job: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held_job = held_job
        self.launching = threading.Event()
        self.release = threading.Event()
        self.returned: dict[int, datetime] = {}

    def launch(self, spec: GangSpec) -> None:
        if self.held_job in (None, spec.job_id):
            self.launching.set()
            if not self.release.wait(60):
                raise AssertionError("the test never released the launch")
        super().launch(spec)
        self.returned[spec.job_id] = timezone.now()


def in_thread(work: Callable[[], object]) -> tuple[threading.Thread, list[BaseException]]:
    """Start `work` in a thread of its own (with its own database connection); what it
    raises is kept for the test to report."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # reported by the test's thread
            failures.append(error)
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, failures


def _short_lock_wait() -> None:
    """Make a write that waits on a lock fail after LOCK_WAIT_SECONDS instead of
    the connection's usual 30 s, so a lock held across the launch fails the test."""
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            cursor.execute(f"SET lock_timeout = '{int(LOCK_WAIT_SECONDS * 1000)}ms'")
        else:
            cursor.execute(f"PRAGMA busy_timeout = {int(LOCK_WAIT_SECONDS * 1000)}")


def test_jobs_table_stays_writable_while_a_launch_is_in_progress(
    world: Any, local_runtime: LocalRuntime, drive: Any
) -> None:
    job, other = admitted_pair(world, "held", "other")
    runtime = HeldLaunch(root=local_runtime.root, inventory=local_runtime.inventory)
    reconciler, failures = in_thread(lambda: reconcile_jobs(job_ids=[job.pk], runtime=runtime))
    try:
        assert runtime.launching.wait(30), "the reconciler never called launch"
        _short_lock_wait()
        started = time.monotonic()
        # The launching job's own rows and another job's, in one transaction.
        with transaction.atomic():
            Job.objects.filter(pk=job.pk).update(name="renamed while launching")
            Rank.objects.filter(attempt__job=job).update(
                node=Rank.objects.get(attempt__job=job).node
            )
            Attempt.objects.filter(job=job).update(borrowed_gpus=0)
            Job.objects.filter(pk=other.pk).update(name="written while launching")
            submit(world, world.nlp, name="submitted while launching")
        waited = time.monotonic() - started
        assert runtime.launching.is_set() and not runtime.release.is_set()
    finally:
        runtime.release.set()
        reconciler.join(60)
    assert not failures, failures
    assert connection.vendor == ("sqlite" if "QM_SQLITE_TEST_NAME" in os.environ else "postgresql")
    assert waited < LOCK_WAIT_SECONDS
    assert Job.objects.get(pk=job.pk).name == "renamed while launching"
    assert Job.objects.filter(name="submitted while launching").exists()
    attempt = Attempt.objects.get(job=job)
    assert attempt.launched_at is not None and attempt.action == ""
    assert [o.phase for o in runtime.observe(GangId(job.pk, 1))] != []
    # The launched gang is real: it runs to its end like any other.
    drive(lambda: state_of(job) == JobState.SUCCEEDED, what="the held job to succeed")


def test_each_launch_is_recorded_when_it_returned_not_when_the_last_of_its_pass_did(
    world: Any, local_runtime: LocalRuntime, drive: Any
) -> None:
    # The launches of one pass go out side by side; a gang's work (and what a
    # preemption costs it) counts from its own launch, so a quick launch must not
    # be stamped with the moment a slow one beside it finally returned.
    quick, slow = admitted_pair(world, "quick", "slow")
    runtime = HeldLaunch(
        root=local_runtime.root, inventory=local_runtime.inventory, held_job=slow.pk
    )
    launcher, failures = in_thread(lambda: launch_admitted([quick.pk, slow.pk], runtime))
    try:
        wait_until(lambda: quick.pk in runtime.returned, timeout=30, what="the quick launch")
        released = timezone.now()
    finally:
        runtime.release.set()
        launcher.join(60)
    assert not failures, failures
    quick_launched = Attempt.objects.get(job=quick).launched_at
    slow_launched = Attempt.objects.get(job=slow).launched_at
    assert runtime.returned[quick.pk] <= quick_launched <= released
    assert released <= runtime.returned[slow.pk] <= slow_launched
    drive(
        lambda: state_of(quick) == state_of(slow) == JobState.SUCCEEDED,
        what="both jobs to succeed",
    )


def test_a_permanent_error_fails_its_attempt_and_the_next_gang_is_reconciled(
    world: Any, local_runtime: LocalRuntime, drive: Any
) -> None:
    broken = submit(world, world.vision, name="broken")
    fine = submit(world, world.ops, name="fine")
    schedule_cycle(act=False)
    # A placement the runtime has never heard of can never launch.
    Rank.objects.filter(attempt__job=broken).update(node="no-such-node")
    assert Attempt.objects.get(job=broken).pk < Attempt.objects.get(job=fine).pk

    reconcile_jobs(runtime=local_runtime)

    broken.refresh_from_db()
    assert broken.state == JobState.FAILED
    assert "not in the inventory" in broken.failure_reason
    assert "no-such-node" in broken.failure_reason
    assert Attempt.objects.get(job=broken).end_reason == Attempt.EndReason.FAILED
    # The same pass launched the next gang.
    assert Attempt.objects.get(job=fine).launched_at is not None
    assert local_runtime.observe(GangId(fine.pk, 1)) != []
    assert local_runtime.observe(GangId(broken.pk, 1)) == []
    drive(lambda: state_of(fine) == JobState.SUCCEEDED, what="the next job to succeed")


def test_a_temporary_error_is_retried_with_backoff_and_shown_on_the_job_page(
    world: Any, local_runtime: LocalRuntime, drive: Any, settings: Any, client: Any, tmp_path: Path
) -> None:
    # A backoff far longer than a pass on a loaded machine, so that "not before its
    # time" holds however slow the page below is; its time comes when the test says so
    # (`due`), rather than by sleeping through it.
    settings.QM_RUNTIME_RETRY_SECONDS = 20.0
    job = submit(world, world.vision, name="flaky")
    schedule_cycle(act=False)
    # The launcher's interpreter is missing for a while: starting it fails with an OSError.
    local_runtime.python = str(tmp_path / "no-such-python")

    def tried() -> tuple[Attempt, float]:
        """One pass; the attempt after it and the seconds until its next try."""
        before = timezone.now()
        reconcile_jobs(runtime=local_runtime)
        attempt = Attempt.objects.get(job=job)
        assert attempt.launched_at is None and attempt.action == Attempt.Action.LAUNCH
        assert "cannot start the launcher" in attempt.action_error
        assert attempt.action_not_before is not None
        return attempt, (attempt.action_not_before - before).total_seconds()

    def due(attempt: Attempt) -> None:
        """Its next try's time has come."""
        Attempt.objects.filter(pk=attempt.pk).update(action_not_before=timezone.now())

    first, backoff = tried()
    assert first.action_tries == 1
    assert 20.0 <= backoff < 22.0
    client.force_login(world.users["researcher"])
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "Launch failed 1 time with a temporary runtime error: " in page
    assert "cannot start the launcher" in page
    assert "next try at" in page

    # Not before its time: a pass now leaves the count alone.
    assert tried()[0].action_tries == 1
    due(first)
    second, backoff = tried()
    assert second.action_tries == 2
    assert 40.0 <= backoff < 42.0  # doubled
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert "Launch failed 2 times with a temporary runtime error" in page

    # The interpreter is back: the next due try launches, and the job runs.
    local_runtime.python = sys.executable
    # Not before its time here either, then due.
    reconcile_jobs(runtime=local_runtime)
    assert Attempt.objects.get(job=job).action_tries == 2
    due(second)
    reconcile_jobs(runtime=local_runtime)
    attempt = Attempt.objects.get(job=job)
    assert attempt.launched_at is not None
    assert (attempt.action, attempt.action_tries, attempt.action_error) == ("", 0, "")
    assert "temporary runtime error" not in client.get(f"/jobs/{job.pk}/").content.decode()
    drive(lambda: state_of(job) == JobState.SUCCEEDED, what="the job to succeed")


def test_a_launch_that_keeps_failing_gives_up_after_its_tries(
    world: Any, local_runtime: LocalRuntime, settings: Any, tmp_path: Path
) -> None:
    settings.QM_RUNTIME_RETRY_SECONDS = 0.0
    settings.QM_RUNTIME_TRIES = 3
    job = submit(world, world.vision, name="hopeless")
    schedule_cycle(act=False)
    local_runtime.python = str(tmp_path / "no-such-python")
    for _ in range(3):
        reconcile_jobs(runtime=local_runtime)
    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.failure_reason.startswith("launch gave up after 3 tries: ")
    assert "cannot start the launcher" in job.failure_reason
    assert Attempt.objects.get(job=job).end_reason == Attempt.EndReason.FAILED


def test_the_task_time_limit_ends_the_pass_and_undoes_its_decisions(
    world: Any, local_runtime: LocalRuntime, monkeypatch: Any
) -> None:
    """The soft time limit is the pass's, not one attempt's: it must not be logged
    and skipped like an attempt's error (the pass would run on into the hard limit
    and be killed without recording anything), and the decisions made so far in the
    pass's transaction are undone, for the next pass to make again."""
    first = submit(world, world.vision, seconds=30, name="first")
    second = submit(world, world.ops, name="second")
    schedule_cycle(act=False)
    assert state_of(first) == state_of(second) == JobState.ADMITTED
    # The first is launched; the pass's decision for it moves its job on to running.
    launch_admitted([first.pk], runtime=local_runtime)
    wait_until(
        lambda: [o.phase for o in local_runtime.observe(GangId(first.pk, 1))] == ["running"],
        "the first job's rank running",
    )
    decide = decide_stage._decide

    def decide_until_the_limit(attempt: Attempt, *args: Any, **kwargs: Any) -> Any:
        if attempt.job_id == second.pk:
            raise SoftTimeLimitExceeded()
        return decide(attempt, *args, **kwargs)

    monkeypatch.setattr(decide_stage, "_decide", decide_until_the_limit)
    with pytest.raises(SoftTimeLimitExceeded):
        reconcile_jobs(job_ids=[first.pk, second.pk], runtime=local_runtime)
    assert state_of(first) == JobState.ADMITTED
    assert list(Rank.objects.filter(attempt__job=first).values_list("state", flat=True)) == [
        Rank.State.STARTING
    ]
    assert Attempt.objects.get(job=second).launched_at is None
    assert local_runtime.observe(GangId(second.pk, 1)) == []
