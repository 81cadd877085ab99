"""POST /api/v1/jobs/batch/: a sweep queued whole or not at all, each job checked as
POST /jobs/ checks one, refusals naming the job by its place and the field."""

from __future__ import annotations

import math
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from portal.services import api_token_create
from preemption import services
from preemption.models import Job, JobState
from quotas.models import PriorityClass

BATCH = "/api/v1/jobs/batch/"


def spec(**values: Any) -> dict[str, Any]:
    return {
        "team": "vision",
        "flavor": "h100-80gb",
        "ranks": 1,
        "gpus_per_rank": 1,
        "command": "python sweep.py",
        **values,
    }


def post(client: Any, body: Any) -> Any:
    return client.post(BATCH, body, format="json")


def test_a_batch_queues_every_job_in_order_as_single_submissions_would(world: Any) -> None:
    client = world.client("researcher")
    jobs = [
        spec(name="lr-0.1", env={"LR": "0.1"}),
        spec(name="lr-0.2", ranks=2, gpus_per_rank=4, priority_class="ai-prod-critical"),
        spec(name="lr-0.3", retries=2, topology_required=False),
    ]
    response = post(client, {"jobs": jobs})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert [row["name"] for row in body] == ["lr-0.1", "lr-0.2", "lr-0.3"]
    stored = {job.pk: job for job in Job.objects.filter(pk__in=[row["id"] for row in body])}
    assert len(stored) == 3
    single = client.post("/api/v1/jobs/", spec(name="lr-0.1", env={"LR": "0.1"}), format="json")
    assert single.status_code == 201
    ignored = {"id", "submitted_at", "checkpoint_dir", "name"}
    for row in body:
        job = stored[row["id"]]
        assert (job.state, job.submitter, job.team) == (
            JobState.PENDING,
            world.users["researcher"],
            world.vision,
        )
        # Each job has a folder of its own, named by its own number.
        assert (
            f"job-{job.pk}-" in job.checkpoint_dir and row["checkpoint_dir"] == job.checkpoint_dir
        )
    assert len({job.checkpoint_dir for job in stored.values()}) == 3
    first = body[0]
    assert {k: v for k, v in first.items() if k not in ignored} == {
        k: v for k, v in single.json().items() if k not in ignored
    }
    assert body[1]["priority_class"] == "ai-prod-critical" and body[1]["gpus"] == 8
    assert body[0]["priority_class"] == "ai-batch-preemptible"
    assert (body[2]["retries"], body[2]["topology_required"]) == (2, False)


def test_a_batch_costs_the_same_queries_whatever_its_size(world: Any) -> None:
    _, token = api_token_create(user=world.users["researcher"], name="sweep")
    client = world.client("anonymous")
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert post(client, {"jobs": [spec()]}).status_code == 201
    counted = {}
    for size in (2, 60):
        with CaptureQueriesContext(connection) as queries:
            response = post(client, {"jobs": [spec(name=f"n{i}") for i in range(size)]})
        assert response.status_code == 201, response.json()
        counted[size] = len(queries)
    # The same statements, apart from the INSERT that the database splits where its
    # limit on one statement's parameters is below 60 jobs' (SQLite's: 999).
    fields = [field for field in Job._meta.concrete_fields if not field.primary_key]
    per_insert = connection.ops.bulk_batch_size(fields, [Job()] * 60)
    assert counted[60] == counted[2] + math.ceil(60 / per_insert) - 1, counted
    assert Job.objects.count() == 1 + 2 + 60


def test_one_refused_job_refuses_the_batch_naming_its_place_and_field(world: Any) -> None:
    client = world.client("researcher")
    before = Job.objects.count()
    response = post(
        client,
        {"jobs": [spec(), spec(gpus_per_rank=9), spec(), spec(env={"QM_JOB_ID": "7"})]},
    )
    assert response.status_code == 400
    errors = response.json()["jobs"]
    assert set(errors) == {"1", "3"}
    assert errors["1"] == {
        "gpus_per_rank": ["Each rank needs 9 GPUs; the largest h100-80gb node has 8."]
    }
    assert set(errors["3"]) == {"env"}
    assert Job.objects.count() == before


def test_a_class_the_team_may_not_use_refuses_the_batch(world: Any) -> None:
    PriorityClass.objects.create(name="not-granted", value=5)
    before = Job.objects.count()
    response = post(
        world.client("researcher"), {"jobs": [spec(), spec(), spec(priority_class="not-granted")]}
    )
    assert response.status_code == 400
    assert set(response.json()["jobs"]) == {"2"}
    assert "may not use not-granted" in response.json()["jobs"]["2"]["priority_class"][0]
    assert Job.objects.count() == before


def test_unknown_names_and_wrong_types_are_400_by_place(world: Any) -> None:
    response = post(
        world.client("researcher"),
        # An unknown team is refused as a hidden one is (403, tests/security/test_security_names.py).
        {"jobs": [spec(flavor="no-such-flavor"), spec(), spec(ranks="two")]},
    )
    assert response.status_code == 400
    errors = response.json()["jobs"]
    assert (
        set(errors) == {"0", "2"}
        and set(errors["0"]) == {"flavor"}
        and set(errors["2"]) == {"ranks"}
    )
    assert not Job.objects.exists()


def test_another_tenants_team_in_the_batch_is_403_and_queues_nothing(world: Any) -> None:
    response = post(world.client("researcher"), {"jobs": [spec(), spec(team="ops"), spec()]})
    assert response.status_code == 403
    assert response.json()["detail"] == "You may not submit jobs to team ops."
    assert not Job.objects.exists()


def test_a_parent_team_is_refused_as_in_a_single_submission(world: Any) -> None:
    response = post(world.client("manager"), {"jobs": [spec(team="nlp"), spec(team="ml")]})
    assert response.status_code == 400
    assert response.json()["jobs"] == {
        "1": {"team": ["Team ml has sub-teams; jobs are submitted to leaf teams."]}
    }
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"jobs": []},
        {"jobs": "all of them"},
        {"jobs": [spec()] * (services.MAX_BATCH + 1)},
        [spec()],
    ],
    ids=["missing", "empty", "not-a-list", "too-many", "bare-list"],
)
def test_a_malformed_batch_is_400_and_queues_nothing(world: Any, body: Any) -> None:
    response = post(world.client("admin"), body)
    assert response.status_code == 400, response.content[:300]
    errors = response.json()
    assert set(errors) <= {"jobs", "non_field_errors"} and errors
    reasons = str(errors)
    assert any(
        words in reasons
        for words in (
            "required",
            "may not be empty",
            "Expected a list",
            "no more than",
            "Invalid data",
        )
    ), reasons
    assert not Job.objects.exists()


def test_fields_a_submitter_may_not_set_are_ignored(world: Any) -> None:
    # State, owner and the folder are the control plane's: a batch cannot set them
    # any more than a single submission can.
    response = post(
        world.client("researcher"),
        {
            "jobs": [
                spec(
                    state="running",
                    submitter="admin",
                    checkpoint_dir="/var/lib/quartermaster/checkpoints/job-1-aaaaaaaaaaaa",
                    resume_step=1000,
                )
            ]
        },
    )
    assert response.status_code == 201, response.json()
    job = Job.objects.get()
    assert (job.state, job.submitter, job.resume_step) == (
        JobState.PENDING,
        world.users["researcher"],
        None,
    )
    assert job.checkpoint_dir.rsplit("/", 1)[-1].startswith(f"job-{job.pk}-")


def test_signed_out_callers_get_401(world: Any) -> None:
    assert post(world.client("anonymous"), {"jobs": [spec()]}).status_code == 401
    assert not Job.objects.exists()


def test_a_body_over_the_limit_is_413_before_it_is_read(world: Any, settings: Any) -> None:
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    jobs = [spec(name=f"big-{i}", command="x" * 900) for i in range(10)]
    response = post(world.client("researcher"), {"jobs": jobs})
    assert response.status_code == 413
    assert "at most 4,096 are accepted" in response.json()["detail"]
    assert not Job.objects.exists()
    # The same jobs in smaller batches go in.
    for start in range(0, 10, 3):
        part = jobs[start : start + 3]
        assert post(world.client("researcher"), {"jobs": part}).status_code == 201
    assert Job.objects.count() == 10
    page = world.client("researcher").post(
        "/teams/", data="x" * 5000, content_type="application/octet-stream"
    )
    assert page.status_code == 413 and b"at most 4,096" in page.content
