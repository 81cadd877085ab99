"""Stopping the portal stops the local runtime's ranks: a graceful stop
recorded on each open attempt, SIGTERM, the grace window, SIGKILL for what is
left, and at the next reconcile the job is requeued, not taken for finished."""

from __future__ import annotations

from typing import Any

import pytest

from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile import live_rank_count, runtime_shutdown
from preemption.services import job_submit
from tests.preemption.conftest import ignore_sigterm_command, sleeper_command, state_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


def _submit(world: Any, command: str, name: str) -> Job:
    return job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=2,
        gpus_per_rank=2,
        command=command,
        priority_class=world.batch,
        name=name,
    )


def test_shutdown_stops_every_rank_and_the_job_comes_back(
    world: Any, drive: Any, local_runtime: Any
) -> None:
    polite = _submit(world, sleeper_command(300), "polite")
    stubborn = _submit(world, ignore_sigterm_command(), "stubborn")
    drive(
        lambda: (
            Rank.objects.filter(attempt__job__in=[polite, stubborn], pid__isnull=False).count() == 4
        ),
        what="both jobs to run",
    )
    assert live_rank_count(runtime=local_runtime) == (2, 4)

    report = runtime_shutdown(grace_seconds=2.0, runtime=local_runtime)

    assert (report.jobs, report.ranks, report.killed) == (2, 4, 2)
    assert live_rank_count(runtime=local_runtime) == (0, 0)
    stops = {stop.job_id: stop for stop in PreemptionEvent.objects.all()}
    assert {stop.reason for stop in stops.values()} == {"shutdown"}
    assert stops[polite.pk].killed_at is None and stops[stubborn.pk].killed_at is not None
    # The next start's reconcile requeues both, to resume where they stopped.
    drive(
        lambda: (
            {state_of(polite), state_of(stubborn)}
            <= {JobState.REQUEUED, JobState.ADMITTED, JobState.RUNNING}
            and Attempt.objects.filter(job__in=[polite, stubborn], number=1, ended_at__isnull=False)
            .exclude(end_reason="")
            .count()
            == 2
        ),
        what="the requeue",
    )
    ended = Attempt.objects.filter(job__in=[polite, stubborn], number=1)
    assert set(ended.values_list("end_reason", flat=True)) == {"preempted"}


def test_shutdown_with_nothing_running_does_nothing(world: Any, local_runtime: Any) -> None:
    assert runtime_shutdown(grace_seconds=1.0, runtime=local_runtime).ranks == 0
    assert not PreemptionEvent.objects.exists()
