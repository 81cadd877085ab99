"""Every page from every persona: who gets the page, who is sent to sign in,
who gets 403 or 404, and that nobody sees another team's jobs or quotas."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from django.urls import reverse

from tests.conftest import PERSONAS, World
from tests.portal.pages.conftest import page_client, seed_jobs

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(db: None, module_world: World) -> World:
    # Built once for the module's hundred tests; each gets its own copy of the instances.
    return copy.deepcopy(module_world)


SIMPLE_PAGES = ["dashboard", "team-list", "job-list", "telemetry", "priority-classes", "tokens"]


@pytest.mark.parametrize("name", SIMPLE_PAGES)
@pytest.mark.parametrize("persona", PERSONAS)
def test_page_opens_for_signed_in_personas_and_asks_others_to_sign_in(
    world: Any, history: Any, persona: str, name: str
) -> None:
    response = page_client(world, persona).get(reverse(name))
    if persona == "anonymous":
        assert response.status_code == 302
        assert response["Location"].startswith(reverse("login"))
    else:
        assert response.status_code == 200
        assert b"Quartermaster" in response.content


# team slug -> personas that may read it
TEAM_READERS = {
    "org": {"admin"},
    "ml": {"admin", "manager"},
    "vision": {"admin", "manager", "researcher"},
    "nlp": {"admin", "manager"},
    "other": {"admin", "other_manager"},
    "ops": {"admin", "other_manager", "other_researcher"},
}


@pytest.mark.parametrize("persona", PERSONAS)
@pytest.mark.parametrize("slug", sorted(TEAM_READERS))
def test_team_page_is_readable_exactly_where_the_api_allows(
    world: Any, persona: str, slug: str
) -> None:
    response = page_client(world, persona).get(reverse("team-detail", args=[slug]))
    if persona == "anonymous":
        assert response.status_code == 302
    elif persona in TEAM_READERS[slug]:
        assert response.status_code == 200
    else:
        assert response.status_code == 404


@pytest.mark.parametrize("persona", PERSONAS)
def test_team_tree_lists_only_readable_teams(world: Any, persona: str) -> None:
    if persona == "anonymous":
        return
    body = page_client(world, persona).get(reverse("team-list")).content.decode()
    for slug, readers in TEAM_READERS.items():
        assert (f'data-team="{slug}"' in body) == (persona in readers), slug


# (quota's team, persona) -> status of the editor
EDITORS = {
    "vision": {
        "admin": 200,
        "manager": 200,
        "researcher": 403,
        "other_manager": 404,
        "other_researcher": 404,
    },
    "ml": {
        "admin": 200,
        "manager": 403,
        "researcher": 404,
        "other_manager": 404,
        "other_researcher": 404,
    },
    "ops": {
        "admin": 200,
        "manager": 404,
        "researcher": 404,
        "other_manager": 200,
        "other_researcher": 403,
    },
}


@pytest.mark.parametrize("persona", PERSONAS)
@pytest.mark.parametrize("slug", sorted(EDITORS))
def test_quota_editor_follows_the_api_rules(world: Any, persona: str, slug: str) -> None:
    quota = world.quota(getattr(world, slug))
    client = page_client(world, persona)
    for url in (reverse("quota-edit", args=[quota.pk]),):
        response = client.get(url)
        if persona == "anonymous":
            assert response.status_code == 302
        else:
            assert response.status_code == EDITORS[slug][persona]
    response = client.post(
        reverse("quota-preview", args=[quota.pk]), {"guarantee": quota.guarantee}
    )
    expected = 302 if persona == "anonymous" else EDITORS[slug][persona]
    assert response.status_code == expected
    response = client.post(
        reverse("quota-edit", args=[quota.pk]),
        {"guarantee": quota.guarantee, "borrow_limit": 5, "action": "save"},
    )
    quota.refresh_from_db()
    if persona != "anonymous" and EDITORS[slug][persona] == 200:
        assert response.status_code == 302
        assert quota.borrow_limit == 5
    else:
        assert quota.borrow_limit is None


@pytest.mark.parametrize("persona", PERSONAS)
def test_job_list_and_job_pages_show_only_readable_teams(world: Any, persona: str) -> None:
    jobs = seed_jobs(world, 12)
    readable = {
        "admin": {"vision", "nlp", "ops"},
        "manager": {"vision", "nlp"},
        "researcher": {"vision"},
        "other_manager": {"ops"},
        "other_researcher": {"ops"},
        "anonymous": set(),
    }[persona]
    client = page_client(world, persona)
    listing = client.get(reverse("job-list"))
    if persona == "anonymous":
        assert listing.status_code == 302
    else:
        body = listing.content.decode()
        for job in jobs:
            assert (f'data-job="{job.pk}"' in body) == (job.team.slug in readable)
    for job in jobs[:3]:
        response = client.get(reverse("job-detail", args=[job.pk]))
        if persona == "anonymous":
            assert response.status_code == 302
        else:
            assert response.status_code == (200 if job.team.slug in readable else 404)


def test_dashboard_of_a_researcher_names_no_other_team(world: Any, history: Any) -> None:
    body = page_client(world, "researcher").get(reverse("dashboard")).content.decode()
    assert 'data-team="vision"' in body
    for slug in ("org", "ml", "nlp", "other", "ops"):
        assert f'data-team="{slug}"' not in body
    # The reclaimed job belongs to ops, which the researcher may not read.
    assert "borrower" not in body


def test_login_and_logout(world: Any) -> None:
    from django.test import Client

    from tests.conftest import PASSWORD

    client = Client()
    response = client.post(reverse("login"), {"username": "researcher", "password": PASSWORD})
    assert response.status_code == 302
    assert response["Location"] == reverse("dashboard")
    assert client.get(reverse("dashboard")).status_code == 200
    wrong = Client().post(reverse("login"), {"username": "researcher", "password": "nope"})
    assert wrong.status_code == 200
    assert b"correct username and password" in wrong.content
    client.post(reverse("logout"))
    assert client.get(reverse("dashboard")).status_code == 302


def test_rank_log_is_scoped_like_the_job(world: Any, history: Any) -> None:
    victim = history.victim
    url = reverse("rank-log", args=[victim.pk, 1, 0])
    assert page_client(world, "researcher").get(url).status_code == 404
    assert page_client(world, "anonymous").get(url).status_code == 302


def test_cancel_follows_the_api_rules(world: Any) -> None:
    from preemption.models import Job

    jobs = seed_jobs(world, 24)
    pending = [job for job in jobs if job.state in ("pending", "requeued")]
    vision_job = next(job for job in pending if job.team_id == world.vision.pk)
    nlp_job = next(job for job in pending if job.team_id == world.nlp.pk)
    ops_job = next(job for job in pending if job.team_id == world.ops.pk)
    url = lambda job: reverse("job-cancel", args=[job.pk])  # noqa: E731
    # Another team's researcher cannot even see the job; a teammate who did not
    # submit it may read it but not cancel it.
    assert page_client(world, "other_researcher").post(url(vision_job)).status_code == 404
    assert page_client(world, "researcher").post(url(nlp_job)).status_code == 404
    Job.objects.filter(pk=ops_job.pk).update(submitter=world.users["admin"])
    assert page_client(world, "other_researcher").post(url(ops_job)).status_code == 403
    assert page_client(world, "anonymous").post(url(vision_job)).status_code == 302
    states = dict(
        Job.objects.filter(pk__in=[vision_job.pk, nlp_job.pk, ops_job.pk]).values_list(
            "pk", "state"
        )
    )
    assert "cancelled" not in states.values()
    # The submitter and a manager above the team may cancel.
    response = page_client(world, "researcher").post(url(vision_job))
    assert response.status_code == 302
    assert page_client(world, "manager").post(url(nlp_job)).status_code == 302
    states = dict(Job.objects.filter(pk__in=[vision_job.pk, nlp_job.pk]).values_list("pk", "state"))
    assert set(states.values()) == {"cancelled"}
    again = page_client(world, "researcher").post(url(vision_job), follow=True)
    assert f"Job {vision_job.pk} is already cancelled." in again.content.decode()
