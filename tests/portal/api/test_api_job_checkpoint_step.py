"""`checkpoint_step` where a researcher reads a job in the API: on each attempt (the
last step it committed, the one its stop saved for a stopped attempt) and on the job
(its last committed step), not only on /preemption-events/; documented in the schema.
The job's cadence also says when the job is being stopped or was just reclaimed."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import yaml
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from preemption.models import Attempt, Checkpoint, Job, JobState, PreemptionEvent
from tests import builders

pytestmark = pytest.mark.django_db

NO_OWNER_WAITS = "no owner waits for it now"


def _checkpoint(job: Job, attempt: Attempt, step: int, minutes_ago: float) -> None:
    Checkpoint.objects.create(
        job=job,
        attempt=attempt,
        step=step,
        committed_at=timezone.now() - timedelta(minutes=minutes_ago),
    )


def _stopped(job: Job, attempt: Attempt, *, minutes_ago: float, **fields: Any) -> None:
    decided = timezone.now() - timedelta(minutes=minutes_ago)
    PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=job,
        reason=PreemptionEvent.Reason.RECLAIM,
        cause="reclaimed by nlp, 8 GPUs under its guarantee",
        decided_at=decided,
        grace_seconds=60,
        deadline=decided + timedelta(seconds=60),
        outcome="graceful",
        **fields,
    )


@pytest.fixture
def history(world: Any) -> Job:
    """A vision job on its fourth attempt.

    1: a regular save at step 100, then the reclaim's save at step 120;
    2: reclaimed; its checkpoint's row is gone, the stop recorded step 170;
    3: lost a rank before it committed anything;
    4: open, committed step 210 so far.
    """
    job = builders.job(world, world.vision, ranks=1, gpus_per_rank=8)
    first, second, _lost, fourth = (
        builders.attempt(job, ended_at=None if number == 4 else timezone.now())
        for number in range(1, 5)
    )
    _checkpoint(job, first, 100, minutes_ago=50)
    _checkpoint(job, first, 120, minutes_ago=40)
    _stopped(job, first, minutes_ago=41, checkpoint_step=120)
    _stopped(job, second, minutes_ago=30, checkpoint_step=170)
    _checkpoint(job, fourth, 210, minutes_ago=1)
    return job


def test_each_attempt_and_the_job_carry_their_checkpoint_step(world: Any, history: Job) -> None:
    detail = world.client("researcher").get(f"/api/v1/jobs/{history.pk}/")
    assert detail.status_code == 200
    body = detail.json()
    steps = {attempt["number"]: attempt["checkpoint_step"] for attempt in body["attempts"]}
    assert steps == {1: 120, 2: 170, 3: None, 4: 210}
    assert body["checkpoint_step"] == 210
    # The same numbers as the preemption events that already had them.
    events = world.client("researcher").get("/api/v1/preemption-events/", {"job": history.pk})
    assert {e["attempt_number"]: e["checkpoint_step"] for e in events.json()["results"]} == {
        1: 120,
        2: 170,
    }
    listed = world.client("researcher").get("/api/v1/attempts/", {"job": history.pk})
    assert {a["number"]: a["checkpoint_step"] for a in listed.json()["results"]} == steps
    one = world.client("researcher").get(f"/api/v1/attempts/{body['attempts'][0]['id']}/")
    assert one.json()["checkpoint_step"] == steps[one.json()["number"]]


def test_a_job_that_never_committed_has_no_checkpoint_step(world: Any) -> None:
    job = builders.running_job(world, world.vision, rank_fields={})
    body = world.client("researcher").get(f"/api/v1/jobs/{job.pk}/").json()
    assert body["checkpoint_step"] is None
    assert [attempt["checkpoint_step"] for attempt in body["attempts"]] == [None]


def test_checkpoint_steps_of_another_team_stay_hidden(world: Any, history: Job) -> None:
    outsider = world.client("other_researcher")
    assert outsider.get(f"/api/v1/jobs/{history.pk}/").status_code == 404
    assert outsider.get("/api/v1/attempts/", {"job": history.pk}).json()["count"] == 0


def test_the_attempts_list_reads_checkpoint_steps_in_a_fixed_number_of_queries(
    world: Any, history: Job
) -> None:
    client = world.client("admin")

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert client.get("/api/v1/attempts/").status_code == 200
        return len(captured.captured_queries)

    few = queries()
    more = builders.job(world, world.nlp)
    for _ in range(6):
        _checkpoint(more, builders.attempt(more, ended_at=timezone.now()), 5, minutes_ago=2)
    assert queries() == few


def test_the_schema_documents_checkpoint_step(world: Any) -> None:
    schema = yaml.safe_load(world.client("researcher").get("/api/schema/").content)
    components = schema["components"]["schemas"]
    attempt = components["Attempt"]["properties"]["checkpoint_step"]
    assert attempt["type"] == "integer" and attempt.get("nullable") is True
    assert "last checkpoint this attempt committed" in attempt["description"]
    job = components["JobDetail"]["properties"]["checkpoint_step"]
    assert "last committed checkpoint" in job["description"]


def test_the_cadence_of_a_job_being_reclaimed_does_not_say_no_owner_waits(world: Any) -> None:
    job = builders.running_job(world, world.vision, rank_fields={}, borrowed=8)
    attempt = job.attempts.get()
    reason = f"team vision holds 16 h100-80gb GPUs, 8 beyond its guarantee of 8; {NO_OWNER_WAITS}"
    Attempt.objects.filter(pk=attempt.pk).update(
        preemption_mtbp_seconds=4 * 3600.0, preemption_risk_reasons=[reason]
    )
    decided = timezone.now() - timedelta(seconds=79)
    PreemptionEvent.objects.create(
        victim_attempt=attempt,
        job=job,
        reason=PreemptionEvent.Reason.RECLAIM,
        cause="reclaimed by nlp, 8 GPUs under its guarantee",
        decided_at=decided,
        grace_seconds=120,
        deadline=decided + timedelta(seconds=120),
    )
    Job.objects.filter(pk=job.pk).update(state=JobState.PREEMPTING)
    cadence = world.client("researcher").get(f"/api/v1/jobs/{job.pk}/").json()["cadence"]
    assert cadence["stop_under_way"] is True and cadence["stop_attempt"] == 1
    assert cadence["stop_why"] == "reclaimed by nlp, 8 GPUs under its guarantee"
    assert cadence["reasons"] == [
        "team vision holds 16 h100-80gb GPUs, 8 beyond its guarantee of 8; "
        "it is being stopped now: reclaimed by nlp, 8 GPUs under its guarantee"
    ]
