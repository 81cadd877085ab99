"""Elastic jobs through the API: `"ranks": {"min": 2, "max": 8}` (optionally with
`sizes`) is stored as the job's range, shown back on the job and its attempts, and a
bad range is a 400 naming `ranks` and why, with nothing stored. The world: three
h100-80gb nodes of 8 GPUs (24 in all)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from preemption.event_tokens import attempt_events_token
from preemption.models import Attempt, Job, TrapEvent
from tests import builders
from tests.conftest import database_state

JOB = {"team": "vision", "flavor": "h100-80gb", "gpus_per_rank": 1, "command": "python train.py"}


@pytest.fixture(autouse=True)
def _fast_passwords(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.mark.parametrize(
    ("ranks", "stored"),
    [
        (8, (8, None, [])),
        ({"min": 2, "max": 8}, (8, 2, [])),
        ({"min": 2, "max": 8, "sizes": [8, 2, 4]}, (8, 2, [2, 4, 8])),
        ({"sizes": [2, 4, 8]}, (8, 2, [2, 4, 8])),
        # A range of one size is a fixed-size job.
        ({"min": 8, "max": 8}, (8, None, [])),
        ({"min": "2", "max": 8}, (8, 2, [])),
    ],
)
def test_a_job_says_how_far_it_can_bend(world: Any, ranks: Any, stored: tuple[Any, ...]) -> None:
    response = world.client("researcher").post(
        "/api/v1/jobs/", {**JOB, "ranks": ranks}, format="json"
    )
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    assert (job.ranks, job.ranks_min, job.rank_sizes) == stored
    body = response.json()
    assert (body["ranks"], body["ranks_min"], body["rank_sizes"]) == stored


@pytest.mark.parametrize(
    ("ranks", "reasons"),
    [
        ({"min": 9, "max": 8}, ["min (9) must not be more than max (8)."]),
        ({"min": 0, "max": 8}, ["min must be at least 1 (got 0)."]),
        ({"min": -3, "max": 8}, ["min must be at least 1 (got -3)."]),
        ({"min": 2, "max": 0}, ["Must be a whole number from 1 to 4096 (got 0)."]),
        (
            {"min": 2, "max": 8, "sizes": [2, 5, 12]},
            ["Sizes must lie from min 2 to max 8 (got 12)."],
        ),
        ({"min": 2, "max": 8, "sizes": [4, 8]}, ["Sizes must include min 2 and max 8."]),
        ({"min": "two", "max": 8}, ["min must be a whole number (got 'two')."]),
        ({"min": 2.5, "max": 8}, ["min must be a whole number (got 2.5)."]),
        (
            {"min": 2, "max": 8, "sizes": [2, "four", 8]},
            ["sizes must be whole numbers (got [2, 'four', 8])."],
        ),
        ({"min": 2, "max": 8, "sizes": "2,4,8"}, ["sizes must be a list of whole numbers."]),
        ({"min": 2, "max": 8, "sizes": []}, ["sizes must be a list of whole numbers."]),
        ({"max": 8}, ['An elastic job gives both min and max (or sizes): {"min": 2, "max": 8}.']),
        (
            {"min": 2, "max": 8, "step": 2},
            ["Unknown key 'step': an elastic job's ranks take min, max and sizes."],
        ),
        ({"min": 2, "max": 30}, ["Needs 30 h100-80gb GPUs (30 × 1); the cluster has 24."]),
        ([2, 8], ["A valid integer is required."]),
    ],
)
def test_a_bad_range_is_400_naming_ranks_and_stores_nothing(
    world: Any, ranks: Any, reasons: list[str]
) -> None:
    before = database_state()
    response = world.client("researcher").post(
        "/api/v1/jobs/", {**JOB, "ranks": ranks}, format="json"
    )
    assert response.status_code == 400, response.content
    assert response.json() == {"ranks": reasons}
    assert database_state() == before


def test_an_elastic_job_asks_for_no_topology(world: Any, settings: Any) -> None:
    settings.QM_TOPOLOGY_LABELS = {"rack": "example.org/rack"}
    before = database_state()
    response = world.client("researcher").post(
        "/api/v1/jobs/",
        {**JOB, "ranks": {"min": 2, "max": 8}, "topology_level": "rack"},
        format="json",
    )
    assert response.status_code == 400, response.content
    assert response.json() == {
        "topology_level": [
            "An elastic job cannot ask for a topology yet; give it a fixed number of ranks."
        ]
    }
    assert database_state() == before


def test_a_batch_takes_elastic_jobs_and_names_the_place_of_a_bad_range(world: Any) -> None:
    client = world.client("researcher")
    good = {**JOB, "ranks": {"min": 2, "max": 4}}
    before = database_state()
    refused = client.post(
        "/api/v1/jobs/batch/",
        {"jobs": [good, {**JOB, "ranks": {"min": 5, "max": 4}}]},
        format="json",
    )
    assert refused.status_code == 400, refused.content
    assert refused.json() == {"jobs": {"1": {"ranks": ["min (5) must not be more than max (4)."]}}}
    assert database_state() == before
    queued = client.post("/api/v1/jobs/batch/", {"jobs": [good, good]}, format="json")
    assert queued.status_code == 201, queued.content
    assert sorted(Job.objects.values_list("ranks", "ranks_min")) == [(4, 2), (4, 2)]


def test_each_attempt_shows_its_own_world_size(world: Any) -> None:
    job = builders.running_job(
        world,
        world.vision,
        priority_class=world.batch,
        ranks=8,
        ranks_min=2,
        gpus_per_rank=1,
        attempt_fields={"ranks": 4},
        admitted_at=timezone.now(),
    )
    body = world.client("researcher").get(f"/api/v1/jobs/{job.pk}/").json()
    assert (body["ranks"], body["ranks_min"], body["rank_sizes"]) == (8, 2, [])
    assert [attempt["world_size"] for attempt in body["attempts"]] == [4]


def test_a_waiting_elastic_job_cannot_be_given_a_topology(world: Any, settings: Any) -> None:
    settings.QM_TOPOLOGY_LABELS = {"rack": "example.org/rack"}
    job = builders.job(world, world.vision, state="pending", ranks=8, ranks_min=2)
    before = database_state()
    response = world.client("researcher").post(
        f"/api/v1/jobs/{job.pk}/topology/", {"topology_level": "rack"}, format="json"
    )
    assert response.status_code == 400, response.content
    assert response.json() == {
        "topology_level": [
            "An elastic job cannot ask for a topology yet; give it a fixed number of ranks."
        ]
    }
    assert database_state() == before


def test_a_rank_outside_the_attempts_size_is_refused_its_events(world: Any) -> None:
    """An elastic job of up to 8 ranks running at 4: rank 5 of that attempt does not
    exist, and the events endpoint says so, while rank 3's event is stored."""
    job = builders.running_job(
        world,
        world.vision,
        priority_class=world.batch,
        ranks=8,
        ranks_min=2,
        gpus_per_rank=1,
        attempt_fields={"ranks": 4},
        rank_fields={},
        admitted_at=timezone.now(),
    )
    attempt = Attempt.objects.get(job=job)
    client = APIClient()
    headers = {"HTTP_AUTHORIZATION": f"Bearer {attempt_events_token(attempt)}"}

    def event(rank: int) -> dict[str, Any]:
        return {"event": "trap_ready", "attempt": 1, "rank": rank, "at": time.time()}

    refused = client.post(f"/api/v1/jobs/{job.pk}/events/", event(5), format="json", **headers)
    assert refused.status_code == 400, refused.content
    assert refused.json() == {"rank": [f"Job {job.pk} has ranks 0 to 3 (got 5)."]}
    stored = client.post(f"/api/v1/jobs/{job.pk}/events/", event(3), format="json", **headers)
    assert stored.status_code == 202, stored.content
    assert list(TrapEvent.objects.filter(job=job).values_list("rank", flat=True)) == [3]
