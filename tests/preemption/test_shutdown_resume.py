"""A stop at the portal's shutdown ends with the checkpoint the ranks took on it.

The ranks get their SIGTERM after the web server has gone, so the trap's reports
by POST are lost and only the QM_EVENT lines in the rank logs say which step they
committed. Stopping the portal closes their attempts once they exit (the logs read
first), so the job reads as requeued from that step while the portal is down; a
portal killed before it could do so leaves it to the next start, which does the same.
Real rank processes on the local runtime, with the portal's URL pointing where no
web server listens."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from preemption.models import Checkpoint, Job, JobState, PreemptionEvent
from preemption.reasons import why_waiting
from preemption.reconcile import RankShutdown, live_rank_count, reconcile_jobs
from preemption.reconcile.logs import ingest_logs
from preemption.reconcile.shutdown import runtime_shutdown
from preemption.runtimes import GangId, iter_log_chunks, iter_trap_events_in_chunks
from preemption.services import job_submit
from tests.preemption.conftest import state_of, train_command

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]


def _nowhere() -> str:
    """An address where no web server listens: the portal's, once it has gone."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def _committed_in_logs(job: Job, runtime: Any) -> int:
    """The last step every rank's log says was committed."""
    steps = []
    for rank in range(job.ranks):
        log = iter_log_chunks(runtime, GangId(job.pk, 1), rank)
        steps.append(
            max(
                event["step"]
                for event in iter_trap_events_in_chunks(log)
                if event["event"] == "checkpoint_committed"
            )
        )
    assert len(set(steps)) == 1, steps
    return steps[0]


def _training_with_a_checkpoint(world: Any, drive: Any, runtime: Any) -> Job:
    """A two-rank job that trains on, with a regular checkpoint that the web server
    took in while it served (here: read from the logs, as its POST would have been)."""
    job = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=2,
        gpus_per_rank=2,
        command=train_command(100_000, step_sleep=0.02, save_every=10),
        priority_class=world.batch,
        name="trainer",
    )
    drive(lambda: state_of(job) == JobState.RUNNING, what="the job to run")
    attempt = job.attempts.get()

    def checkpointed() -> bool:
        ingest_logs(job, attempt, attempt.rank_set.all(), runtime)
        return Checkpoint.objects.filter(job=job).exists()

    drive(checkpointed, what="a regular checkpoint")
    return Job.objects.get(pk=job.pk)


def _assert_requeued_from(job: Job, committed: int) -> None:
    job.refresh_from_db()
    assert job.state == JobState.REQUEUED
    assert job.resume_step == committed + 1
    words = f"stopped when the portal shut down; checkpoint at step {committed}, resumes at step {committed + 1}"
    assert job.waiting_reason == words
    assert why_waiting(job) == words
    # What the job's preemption timeline tells.
    stop = PreemptionEvent.objects.get(job=job)
    assert stop.reason == PreemptionEvent.Reason.SHUTDOWN
    assert stop.outcome == PreemptionEvent.Outcome.GRACEFUL
    assert (stop.checkpoint_step, stop.resume_step) == (committed, committed + 1)
    assert stop.requeued_at is not None and stop.all_exited_at is not None
    attempt = job.attempts.get(number=1)
    assert attempt.end_reason == "preempted"


def test_stopping_the_portal_requeues_the_job_from_the_checkpoint_its_ranks_logged(
    world: Any, drive: Any, local_runtime: Any, settings: Any
) -> None:
    settings.QM_PUBLIC_URL = _nowhere()
    job = _training_with_a_checkpoint(world, drive, local_runtime)
    before = job.resume_step
    assert before is not None

    # Ctrl-C: the web server, worker and beat are gone; the ranks are told to stop.
    report = runtime_shutdown(grace_seconds=60.0, runtime=local_runtime)

    assert (report.jobs, report.ranks, report.killed) == (1, 2, 0)
    committed = _committed_in_logs(job, local_runtime)
    assert committed >= before, "the stop's own checkpoint came after the regular one"
    # Right away, not only once the portal starts again.
    _assert_requeued_from(job, committed)
    assert report.resumes == {job.pk: committed + 1}
    # The next start finds nothing left to do.
    reconcile_jobs(runtime=local_runtime)
    _assert_requeued_from(job, committed)


def test_a_portal_killed_during_its_stop_leaves_the_next_start_to_read_the_logs(
    world: Any, drive: Any, local_runtime: Any, settings: Any
) -> None:
    """A supervisor's SIGKILL after the ranks were told: they checkpoint and exit
    with nobody watching, and the next start's first pass closes the attempt."""
    settings.QM_PUBLIC_URL = _nowhere()
    job = _training_with_a_checkpoint(world, drive, local_runtime)
    before = job.resume_step

    RankShutdown(grace_seconds=60.0, runtime=local_runtime).signal_live()
    deadline = time.monotonic() + 60
    while live_rank_count(runtime=local_runtime) != (0, 0):
        assert time.monotonic() < deadline, "the ranks never exited on their SIGTERM"
        time.sleep(0.1)
    job.refresh_from_db()
    assert (job.state, job.resume_step) == (JobState.PREEMPTING, before)

    reconcile_jobs(runtime=local_runtime)

    _assert_requeued_from(job, _committed_in_logs(job, local_runtime))
