"""A job that fails on its own is retried only as often as its submitter asked,
with real rank processes on the local runtime; a preemption or a lost gang
requeues it whatever its retries, and uses none of them."""

from __future__ import annotations

import shlex
import sys
import time
from typing import Any

import pytest

from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.runtimes import GangId
from preemption.services import job_submit
from tests.preemption.conftest import sleeper_command, state_of, train_command

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

EXIT_3 = f"{shlex.quote(sys.executable)} -c 'import sys; sys.exit(3)'"


def submit(world: Any, team: Any, *, command: str, retries: int = 0, name: str = "j") -> Job:
    return job_submit(
        submitter=world.users["researcher"],
        team=team,
        flavor=world.h100,
        ranks=1,
        gpus_per_rank=8,
        command=command,
        priority_class=world.batch,
        name=name,
        retries=retries,
    )


def test_a_job_that_fails_on_its_own_fails_after_one_attempt(world: Any, drive: Any) -> None:
    job = submit(world, world.vision, command=EXIT_3)
    drive(lambda: state_of(job) == JobState.FAILED, what="the job to fail")
    job.refresh_from_db()
    assert job.failure_reason == (
        "rank 0 exited with code 3; not retried: the job asked for no retries"
    )
    assert list(Attempt.objects.filter(job=job).values_list("end_reason", flat=True)) == ["failed"]
    assert job.retries_used == 0


def test_retries_run_the_job_again_then_it_fails(world: Any, drive: Any) -> None:
    job = submit(world, world.vision, command=EXIT_3, retries=2)
    drive(lambda: state_of(job) == JobState.FAILED, what="the job to fail")
    job.refresh_from_db()
    assert job.failure_reason == "rank 0 exited with code 3; gave up after 2 retries"
    assert job.retries_used == 2
    attempts = Attempt.objects.filter(job=job).order_by("number")
    assert [(a.number, a.end_reason) for a in attempts] == [
        (1, "failed"),
        (2, "failed"),
        (3, "failed"),
    ]


def test_a_preempted_job_requeues_without_using_its_retries(world: Any, drive: Any) -> None:
    # ops borrows 16 GPUs beyond its guarantee; vision reclaims 8 of them.
    borrower = job_submit(
        submitter=world.users["researcher"],
        team=world.ops,
        flavor=world.h100,
        ranks=3,
        gpus_per_rank=8,
        command=train_command(400, step_sleep=0.05),
        priority_class=world.batch,
        name="borrower",
        retries=1,
    )
    drive(lambda: state_of(borrower) == JobState.RUNNING, what="the borrower to run")
    submit(world, world.vision, command=sleeper_command(30), name="owner")
    drive(
        lambda: Attempt.objects.filter(job=borrower, number=1, end_reason="preempted").exists(),
        what="the reclaim to end the borrower's attempt",
    )
    borrower.refresh_from_db()
    assert borrower.state in (JobState.REQUEUED, JobState.ADMITTED, JobState.RUNNING)
    assert borrower.retries_used == 0
    assert PreemptionEvent.objects.get(job=borrower).reason == "reclaim"


def test_lost_ranks_requeue_without_using_retries(
    world: Any, drive: Any, local_runtime: Any
) -> None:
    job = submit(world, world.vision, command=sleeper_command(600), name="lost")
    drive(lambda: state_of(job) == JobState.RUNNING, what="the job to run")
    # The runtime loses the gang: its ranks are gone without an exit to read.
    gang = GangId(job.pk, 1)
    local_runtime.kill(gang)
    deadline = time.monotonic() + 30
    while any(o.phase not in ("exited", "lost") for o in local_runtime.observe(gang)):
        assert time.monotonic() < deadline, "the killed rank did not exit"
        time.sleep(0.05)
    local_runtime.forget(gang)
    drive(
        lambda: Attempt.objects.filter(job=job, number=1, ended_at__isnull=False).exists(),
        what="the lost attempt to end",
    )
    job.refresh_from_db()
    assert job.state in (JobState.REQUEUED, JobState.ADMITTED, JobState.RUNNING)
    assert job.retries_used == 0 and job.failure_reason == ""
    assert set(
        Rank.objects.filter(attempt__job=job, attempt__number=1).values_list("state", flat=True)
    ) == {"lost"}
