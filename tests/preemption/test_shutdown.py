"""Stopping the portal stops the local runtime's ranks: a graceful stop
recorded on each open attempt, SIGTERM, the grace window, SIGKILL for what is
left, and at the next reconcile the job is requeued, not taken for finished."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from preemption.cycle import schedule_cycle
from preemption.models import Attempt, Job, JobState, PreemptionEvent, Rank
from preemption.reconcile import (
    RankShutdown,
    hold_launches,
    launch_admitted,
    live_rank_count,
    reconcile_jobs,
)
from preemption.reconcile.hold import launches_held
from preemption.reconcile.shutdown import runtime_shutdown
from preemption.runtimes import GangId, processes
from preemption.runtimes.records import write_record
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


def test_a_gang_launched_after_the_first_signals_is_stopped_too_each_within_its_own_grace(
    world: Any, drive: Any, local_runtime: Any
) -> None:
    """The portal signals its ranks as soon as it is asked to stop, while the worker
    may still launch a gang; `finish` stops that one as well, and gives each gang
    the whole grace from its own signal before it kills."""
    grace = 15.0
    stubborn = _submit(world, ignore_sigterm_command(), "stubborn")
    drive(
        lambda: Rank.objects.filter(attempt__job=stubborn, pid__isnull=False).count() == 2,
        what="the first job to run",
    )
    shutdown = RankShutdown(grace_seconds=grace, runtime=local_runtime)
    assert shutdown.signal_live() == (1, 2)
    assert shutdown.signal_live() == (0, 0), "a gang is signalled once"
    late = _submit(world, sleeper_command(300), "late")
    drive(
        lambda: Rank.objects.filter(attempt__job=late, pid__isnull=False).count() == 2,
        what="the job launched after the first signals",
    )

    report = shutdown.finish()

    assert (report.jobs, report.ranks, report.killed) == (2, 4, 2)
    assert live_rank_count(runtime=local_runtime) == (0, 0)
    stops = {stop.job_id: stop for stop in PreemptionEvent.objects.all()}
    assert {stop.reason for stop in stops.values()} == {"shutdown"}
    first, second = stops[stubborn.pk], stops[late.pk]
    assert first.signal_sent_at is not None and first.killed_at is not None
    assert (first.killed_at - first.signal_sent_at).total_seconds() >= grace
    assert second.signal_sent_at is not None and second.killed_at is None


def test_launches_wait_while_a_live_process_holds_them_and_not_for_a_dead_one(
    world: Any, local_runtime: Any, settings: Any, tmp_path: Path
) -> None:
    """While the portal stops, a job requeued by its worker's last passes is not
    launched again; its recorded launch waits for the next start. A hold whose
    process died (a portal killed mid-stop) holds nothing."""
    settings.VAR_DIR = tmp_path
    job = _submit(world, sleeper_command(300), "held")
    schedule_cycle(act=False)
    hold_launches(True)
    assert launches_held()

    launch_admitted([job.pk], local_runtime)
    reconcile_jobs(runtime=local_runtime)

    attempt = Attempt.objects.get(job=job)
    assert attempt.launched_at is None and attempt.action == Attempt.Action.LAUNCH
    assert local_runtime.observe(GangId(job.pk, 1)) == []

    # The marker of a process that has exited since.
    gone = subprocess.Popen(["sleep", "30"])
    born = processes.created_at(gone.pid)
    gone.kill()
    gone.wait()
    write_record(tmp_path / "launches.held", {"pid": gone.pid, "created_at": born})
    assert not launches_held()
    reconcile_jobs(runtime=local_runtime)
    attempt.refresh_from_db()
    assert attempt.launched_at is not None
    assert local_runtime.observe(GangId(job.pk, 1)) != []

    hold_launches(True)
    hold_launches(False)
    assert not launches_held() and not (tmp_path / "launches.held").exists()
