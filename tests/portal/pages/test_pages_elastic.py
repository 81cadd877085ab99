"""Elastic jobs in the browser: the submit form takes "2:8" and "2,4,8" as the API
takes a range, and the job page, the jobs table and "Submit again" show the range
beside the size the job runs at."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import reverse
from django.utils import timezone

from preemption.models import Job
from tests import builders
from tests.portal.pages.conftest import page_client

pytestmark = pytest.mark.django_db

SUBMIT = reverse("job-submit")


def form_post(world: Any, ranks: str) -> dict[str, str]:
    return {
        "team": "vision",
        "name": "elastic",
        "flavor": world.h100.name,
        "ranks": ranks,
        "gpus_per_rank": "1",
        "priority_class": "",
        "command": "python train.py",
    }


@pytest.mark.parametrize(
    ("typed", "stored", "shown"),
    [
        ("2:8", (8, 2, []), "8 ranks (elastic 2–8)"),
        ("2,4,8", (8, 2, [2, 4, 8]), "8 ranks (elastic 2, 4, 8)"),
        ("8", (8, None, []), "8 ranks"),
    ],
)
def test_the_form_takes_a_range_and_the_job_page_shows_it(
    world: Any, typed: str, stored: tuple[Any, ...], shown: str
) -> None:
    client = page_client(world, "researcher")
    response = client.post(SUBMIT, form_post(world, typed))
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.get()
    assert (job.ranks, job.ranks_min, job.rank_sizes) == stored
    page = client.get(response["Location"]).content.decode()
    assert f"· {shown} × 1 h100-80gb = 8 GPUs" in page
    again = client.get(SUBMIT, {"from": job.pk}).content.decode()
    assert f'name="ranks" value="{typed}"' in again


def test_a_running_elastic_job_shows_the_size_of_its_attempt(world: Any) -> None:
    job = builders.running_job(
        world,
        world.vision,
        priority_class=world.batch,
        ranks=8,
        ranks_min=2,
        gpus_per_rank=2,
        attempt_fields={"ranks": 4},
        rank_fields={},
        admitted_at=timezone.now(),
    )
    client = page_client(world, "researcher")
    page = client.get(reverse("job-detail", args=[job.pk])).content.decode()
    assert "· 4 ranks (elastic 2–8) × 2 h100-80gb = 8 GPUs" in page
    assert re.search(r"Attempt 1 <span[^>]*>.*· 4 ranks", page)
    listed = client.get(reverse("job-list")).content.decode()
    assert '<span title="elastic">2–8</span> × 2' in listed
    # Its rank logs are those of the attempt's 4 ranks.
    assert client.get(reverse("rank-log", args=[job.pk, 1, 3])).status_code != 404
    assert client.get(reverse("rank-log", args=[job.pk, 1, 4])).status_code == 404
