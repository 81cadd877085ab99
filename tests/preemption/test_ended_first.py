"""A job whose every rank exited 0 before its stop reached it finished its work: it
succeeds and is not run again, and the stop (outcome `ended-first`) is no
preemption on any count or list. A stop that was tried, even one whose call
failed, may have reached a rank, whose trap stops the others at an agreed step,
so such a job is requeued to resume as any preempted job is."""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework.test import APIClient

from preemption.cycle import schedule_cycle
from preemption.models import Attempt, Job, JobState, PreemptionEvent
from preemption.reconcile import launch_admitted, passes, reconcile_jobs, request_stop
from preemption.runtimes import GangId, LocalRuntime
from preemption.services import job_submit
from tests.preemption.conftest import sleeper_command, state_of
from tests.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def ended_job(world: Any, runtime: LocalRuntime) -> Job:
    """A job whose two ranks ran to their end (code 0), not yet noticed by a pass."""
    job = job_submit(
        submitter=world.users["researcher"],
        team=world.vision,
        flavor=world.h100,
        ranks=2,
        gpus_per_rank=1,
        command=sleeper_command(0.2),
        priority_class=world.batch,
    )
    schedule_cycle(act=False)
    launch_admitted([job.pk], runtime=runtime)
    gang = GangId(job.pk, 1)
    wait_until(
        lambda: [(o.phase, o.exit_code) for o in runtime.observe(gang)] == [("exited", 0)] * 2,
        "both ranks to exit 0",
    )
    job.refresh_from_db()
    return job


def ended_before_the_stop(world: Any, runtime: LocalRuntime) -> tuple[Job, PreemptionEvent]:
    """A job that ran to its end (code 0) while the scheduler, not knowing yet,
    decided to preempt it; nothing has been sent to its ranks."""
    job = ended_job(world, runtime)
    event = request_stop(job=job, reason=PreemptionEvent.Reason.PRIORITY, cause="a critical job")
    assert event is not None
    assert state_of(job) == JobState.PREEMPTING
    return job, event


def test_a_job_that_ended_before_its_stop_succeeds_and_is_no_preemption(
    world: Any, local_runtime: LocalRuntime
) -> None:
    job, event = ended_before_the_stop(world, local_runtime)

    reconcile_jobs(runtime=local_runtime)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert job.finished_at is not None
    attempt = Attempt.objects.get(job=job)
    assert attempt.end_reason == Attempt.EndReason.SUCCEEDED
    assert Attempt.objects.filter(job=job).count() == 1, "it is not run again"
    event.refresh_from_db()
    assert event.outcome == PreemptionEvent.Outcome.ENDED_FIRST
    assert (event.lost_gpu_seconds, event.requeued_at, event.resume_step) == (0.0, None, None)
    assert event.signal_sent_at is None and event.killed_at is None
    assert event.all_exited_at is not None
    assert not PreemptionEvent.objects.preemptions().filter(pk=event.pk).exists()
    # Not in the API's list of preemptions, not on the metrics' counter.
    client = APIClient()
    client.force_login(world.users["admin"])
    listed = client.get("/api/v1/preemption-events/")
    assert listed.status_code == 200
    assert event.pk not in [row["id"] for row in listed.json()["results"]]
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    text = metrics.content.decode()
    assert "# TYPE qm_preemptions_total counter" in text
    assert "qm_preemptions_total{" not in text, "no preemption at all in this world"


def test_a_stop_that_was_tried_requeues_the_job_even_if_every_rank_exited_0(
    world: Any, local_runtime: LocalRuntime
) -> None:
    job, event = ended_before_the_stop(world, local_runtime)
    # A signal call was made and failed; it may have reached a rank all the same.
    Attempt.objects.filter(job=job).update(
        action=Attempt.Action.SIGNAL, action_tries=1, action_error="connection reset"
    )

    reconcile_jobs(runtime=local_runtime)

    job.refresh_from_db()
    assert job.state == JobState.REQUEUED
    assert Attempt.objects.get(job=job).end_reason == Attempt.EndReason.PREEMPTED
    event.refresh_from_db()
    assert event.outcome == PreemptionEvent.Outcome.GRACEFUL
    assert event.requeued_at is not None
    assert PreemptionEvent.objects.preemptions().filter(pk=event.pk).exists()


def test_a_stop_decided_after_the_pass_read_a_finished_job_is_ended_first_not_left_open(
    world: Any, local_runtime: LocalRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler records a stop between the reconcile pass's read of the attempts
    and its close of those that ended: the close still sees it, and the stop is
    `ended-first` instead of an open preemption that no count could ever drop."""
    job = ended_job(world, local_runtime)
    real_finish = passes.finish
    stops = []

    def finish_after_a_stop(steps: list[Any], runtime: Any) -> None:
        # The pass has read the attempt (no stop yet) and found every rank exited.
        assert [step.event for step in steps] == [None]
        job.refresh_from_db()
        stops.append(
            request_stop(job=job, reason=PreemptionEvent.Reason.PRIORITY, cause="a critical job")
        )
        real_finish(steps, runtime)

    monkeypatch.setattr(passes, "finish", finish_after_a_stop)
    reconcile_jobs(runtime=local_runtime)

    assert len(stops) == 1 and stops[0] is not None
    event = PreemptionEvent.objects.get(pk=stops[0].pk)
    assert event.outcome == PreemptionEvent.Outcome.ENDED_FIRST
    assert event.all_exited_at is not None and event.lost_gpu_seconds == 0.0
    assert not PreemptionEvent.objects.preemptions().exists()
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED
    assert Attempt.objects.get(job=job).end_reason == Attempt.EndReason.SUCCEEDED
