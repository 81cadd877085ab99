"""A user's own jobs: the "My jobs" list (`/jobs/?mine=1`, linked from the
navigation) and the dashboard's "My jobs" panel, from each persona."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import reverse

from preemption.models import ACTIVE_STATES, WAITING_STATES, Job
from tests.portal.pages.conftest import page_client, seed_jobs

pytestmark = pytest.mark.django_db


def _listed_jobs(body: str, region: str = "") -> list[int]:
    """The job ids of the table rows, in page order, inside `region` when given."""
    if region:
        match = re.search(rf'<section class="panel" id="{region}">(.*?)</section>', body, re.S)
        assert match, f"no {region} panel"
        body = match.group(1)
    return [int(pk) for pk in re.findall(r'<tr data-job="(\d+)"', body)]


@pytest.mark.parametrize(
    "persona", ["admin", "manager", "other_manager", "researcher", "other_researcher"]
)
def test_my_jobs_lists_exactly_the_users_own_jobs(world: Any, persona: str) -> None:
    seed_jobs(world, 24)
    user = world.users[persona]
    client = page_client(world, persona)
    body = client.get(reverse("job-list"), {"mine": "1"}).content.decode()
    own = set(Job.objects.filter(submitter=user).values_list("pk", flat=True))
    assert set(_listed_jobs(body)) == own
    assert "<h1>My jobs</h1>" in body
    # The navigation's "My jobs" is the current page, not "Jobs".
    assert '<a href="/jobs/?mine=1" aria-current="page">My jobs</a>' in body
    assert '<a href="/jobs/" aria-current="page">Jobs</a>' not in body
    # The whole list stays one click away.
    everything = client.get(reverse("job-list")).content.decode()
    assert "<h1>Jobs</h1>" in everything
    assert '<a href="/jobs/" aria-current="page">Jobs</a>' in everything
    assert '<a href="/jobs/?mine=1" >My jobs</a>' in everything


def test_my_jobs_combines_with_the_other_filters_and_its_csv(world: Any) -> None:
    seed_jobs(world, 24)
    client = page_client(world, "manager")
    mine = {"mine": "1", "state": "running"}
    body = client.get(reverse("job-list"), mine).content.decode()
    expected = set(
        Job.objects.filter(submitter=world.users["manager"], state="running").values_list(
            "pk", flat=True
        )
    )
    assert expected
    assert set(_listed_jobs(body)) == expected
    # The box stays ticked, and the CSV link keeps the filter.
    assert 'name="mine" id="id_mine" checked' in body
    response = client.get(reverse("job-list"), {**mine, "format": "csv"})
    csv = b"".join(response.streaming_content).decode()
    assert len(csv.strip().splitlines()) == len(expected) + 1
    # Without the box, the list holds every job of the manager's teams (vision's too).
    every = _listed_jobs(client.get(reverse("job-list"), {"state": "running"}).content.decode())
    assert set(every) > expected
    assert Job.objects.filter(pk__in=every, submitter=world.users["researcher"]).exists()


def test_dashboard_shows_the_users_own_jobs_running_and_waiting_first(world: Any) -> None:
    jobs = seed_jobs(world, 40, teams=[world.vision])
    researcher = world.users["researcher"]
    # One job of the researcher's team was submitted by the manager: not theirs.
    Job.objects.filter(pk=jobs[0].pk).update(submitter=world.users["manager"])
    body = page_client(world, "researcher").get(reverse("dashboard")).content.decode()
    shown = _listed_jobs(body, "my-jobs")
    own = Job.objects.filter(submitter=researcher)
    live = [
        job.pk
        for job in own.filter(state__in=[*ACTIVE_STATES, *WAITING_STATES]).order_by(
            "-submitted_at", "-id"
        )
    ]
    assert len(shown) == 8
    assert shown == live[:8]
    assert jobs[0].pk not in shown
    for pk in shown:
        assert f'<a href="{reverse("job-detail", args=[pk])}">#{pk}</a>' in body
    assert f"8 of {own.count()} shown" in body
    assert '<a href="/jobs/?mine=1">all my jobs →</a>' in body


def test_dashboard_lists_finished_jobs_after_the_live_ones(world: Any) -> None:
    jobs = seed_jobs(world, 8, teams=[world.vision])
    body = page_client(world, "researcher").get(reverse("dashboard")).content.decode()
    shown = _listed_jobs(body, "my-jobs")
    states = [Job.objects.get(pk=pk).state for pk in shown]
    live = [*ACTIVE_STATES, *WAITING_STATES]
    assert sorted(shown) == sorted(job.pk for job in jobs)
    # Every running or waiting job comes before every finished one.
    assert states == sorted(states, key=lambda state: state not in live)
    assert "shown" not in re.search(r'id="my-jobs">(.*?)</section>', body, re.S).group(1)


@pytest.mark.parametrize("persona", ["admin", "other_manager", "researcher"])
def test_dashboard_has_no_my_jobs_panel_for_someone_who_submitted_none(
    world: Any, persona: str
) -> None:
    seed_jobs(world, 12, teams=[world.nlp, world.ops])
    Job.objects.filter(submitter=world.users[persona]).delete()
    body = page_client(world, persona).get(reverse("dashboard")).content.decode()
    assert 'id="my-jobs"' not in body
