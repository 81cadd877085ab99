"""One researcher must not be able to fill the shared queue or the API: jobs
waiting to run are capped per person and per team (inherited down the tree,
like Slurm's MaxSubmitJobs on an association), a batch that would pass a cap
is refused whole, and the API is throttled per user and per address. Each
refusal is asserted with its field, its reason and an unchanged database.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from axes.models import AccessAttempt
from django.test import Client
from rest_framework.test import APIClient

from preemption.models import Job, JobState
from quotas.models import Team
from tests import builders
from tests.conftest import database_state


def _job(team: str = "vision") -> dict[str, Any]:
    return {"team": team, "flavor": "h100-80gb", "ranks": 1, "gpus_per_rank": 1, "command": "true"}


def _queued(
    world: Any, team: Any, count: int, *, persona: str = "researcher", **fields: Any
) -> None:
    for _ in range(count):
        builders.job(
            world, team, state=fields.pop("state", JobState.PENDING), submitter=world.users[persona]
        )


def _refused(response: Any, field: str) -> str:
    assert response.status_code == 400, response.content
    body = response.json()
    assert list(body) == [field], body
    return str(body[field][0])


# --- queued jobs per team, inherited down the tree ------------------------------------------


def test_a_limit_on_the_parent_caps_its_sub_team_and_one_more_job_is_refused(world: Any) -> None:
    world.ml.max_queued_jobs = 3
    world.ml.save(update_fields=["max_queued_jobs"])
    _queued(world, world.vision, 3)
    before = database_state()
    reason = _refused(
        world.client("researcher").post("/api/v1/jobs/", _job(), format="json"), "team"
    )
    assert reason == (
        "team vision may have at most 3 queued jobs (it has 3) (set on team ml); "
        "1 more would pass the limit."
    )
    assert database_state() == before


def test_a_batch_that_would_pass_the_limit_is_refused_whole(world: Any) -> None:
    world.vision.max_queued_jobs = 5
    world.vision.save(update_fields=["max_queued_jobs"])
    _queued(world, world.vision, 3)
    before = database_state()
    response = world.client("researcher").post(
        "/api/v1/jobs/batch/", {"jobs": [_job()] * 3}, format="json"
    )
    assert _refused(response, "team") == (
        "team vision may have at most 5 queued jobs (it has 3); 3 more would pass the limit."
    )
    assert database_state() == before
    # Up to the limit is fine.
    accepted = world.client("researcher").post(
        "/api/v1/jobs/batch/", {"jobs": [_job()] * 2}, format="json"
    )
    assert accepted.status_code == 201, accepted.content
    assert Job.objects.filter(team=world.vision).count() == 5


def test_a_sub_team_cannot_widen_the_limit_set_above_it(world: Any) -> None:
    world.ml.max_queued_jobs = 2
    world.ml.save(update_fields=["max_queued_jobs"])
    world.vision.max_queued_jobs = 1000
    world.vision.save(update_fields=["max_queued_jobs"])
    _queued(world, world.vision, 2)
    reason = _refused(
        world.client("researcher").post("/api/v1/jobs/", _job(), format="json"), "team"
    )
    assert "at most 2 queued jobs (it has 2) (set on team ml)" in reason


def test_the_site_default_applies_where_no_team_sets_a_limit(world: Any, settings: Any) -> None:
    settings.QM_MAX_QUEUED_JOBS_PER_TEAM = 2
    _queued(world, world.vision, 2)
    before = database_state()
    reason = _refused(
        world.client("researcher").post("/api/v1/jobs/", _job(), format="json"), "team"
    )
    assert reason.startswith("team vision may have at most 2 queued jobs (it has 2);")
    assert database_state() == before


def test_running_and_finished_jobs_do_not_count(world: Any, settings: Any) -> None:
    settings.QM_MAX_QUEUED_JOBS_PER_TEAM = 2
    for state in (JobState.RUNNING, JobState.SUCCEEDED, JobState.CANCELLED):
        builders.job(world, world.vision, state=state, submitter=world.users["researcher"])
    _queued(world, world.vision, 1, state=JobState.REQUEUED)
    response = world.client("researcher").post("/api/v1/jobs/", _job(), format="json")
    assert response.status_code == 201, response.content


# --- queued jobs per person ------------------------------------------------------------------


def test_one_person_is_capped_across_teams(world: Any, settings: Any) -> None:
    settings.QM_MAX_QUEUED_JOBS_PER_USER = 2
    _queued(world, world.vision, 2, persona="manager")
    before = database_state()
    # The manager may submit to nlp too; the cap is theirs, whatever the team.
    response = world.client("manager").post("/api/v1/jobs/", _job("nlp"), format="json")
    assert _refused(response, "submitter") == (
        "You may have at most 2 queued jobs (you have 2); 1 more would pass the limit."
    )
    assert database_state() == before
    # Another person in the same team is not held up by it.
    assert (
        world.client("researcher").post("/api/v1/jobs/", _job(), format="json").status_code == 201
    )


def test_the_portal_form_shows_the_limit(world: Any, settings: Any) -> None:
    settings.QM_MAX_QUEUED_JOBS_PER_TEAM = 1
    _queued(world, world.vision, 1)
    client = Client()
    client.force_login(world.users["researcher"])
    before = database_state()
    response = client.post(
        "/jobs/new/",
        {
            "team": "vision",
            "flavor": "h100-80gb",
            "ranks": "1",
            "gpus_per_rank": "1",
            "command": "true",
            "retries": "0",
            "topology_required": "required",
        },
    )
    assert response.status_code == 400
    assert "team vision may have at most 1 queued jobs (it has 1)" in response.content.decode()
    assert database_state() == before


# --- request rates ------------------------------------------------------------------------


def test_a_user_over_the_rate_gets_429_with_retry_after(world: Any, settings: Any) -> None:
    settings.QM_API_RATE_USER = "3/minute"
    client = world.client("researcher")
    assert [client.get("/api/v1/jobs/").status_code for _ in range(3)] == [200, 200, 200]
    throttled = client.get("/api/v1/jobs/")
    assert throttled.status_code == 429
    assert "throttled" in throttled.json()["detail"]
    assert 0 < int(throttled["Retry-After"]) <= 60
    # Each user has an allowance of their own.
    assert world.client("manager").get("/api/v1/jobs/").status_code == 200


def test_an_anonymous_address_over_the_rate_gets_429(world: Any, settings: Any) -> None:
    # What an anonymous caller may reach is the token login (the rest answers 401
    # before any counting): a third call in the minute is throttled before the
    # password is even checked.
    settings.QM_API_RATE_ANON = "2/minute"
    body = {"username": "researcher", "password": "guess"}

    def login(address: str) -> int:
        return int(
            APIClient()
            .post("/api/v1/tokens/login/", body, format="json", REMOTE_ADDR=address)
            .status_code
        )

    before = database_state()
    assert [login("10.20.0.1") for _ in range(2)] == [403, 403]
    assert login("10.20.0.1") == 429
    assert login("10.20.0.2") == 403  # another address has its own allowance
    # The throttled call reached no password check: axes counted only the three others.
    assert sum(AccessAttempt.objects.values_list("failures_since_start", flat=True)) == 3
    assert database_state() == before


def test_the_trap_events_endpoint_is_not_throttled(world: Any, settings: Any) -> None:
    # Every rank polls twice a second, and a node's ranks share one address.
    settings.QM_API_RATE_ANON = "1/minute"
    job = builders.job(world, world.vision)
    codes = {
        APIClient().get(f"/api/v1/jobs/{job.pk}/events/", HTTP_AUTHORIZATION="Bearer x").status_code
        for _ in range(4)
    }
    assert codes == {403}


@pytest.mark.parametrize("rate", ["lots", "10/fortnight", "0/minute", "-1/second", "10"])
def test_a_bad_rate_setting_stops_the_start(rate: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", "import portal.settings"],
        env={"QM_API_RATE_USER": rate, "PATH": "/usr/bin:/bin", "QM_VAR_DIR": "/tmp/qm-rate-check"},
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert "ImproperlyConfigured: QM_API_RATE_USER must be a count per period" in result.stderr


def test_an_admin_sets_a_teams_limit_on_the_admin_site(world: Any) -> None:
    admin = Client()
    admin.force_login(world.users["admin"])
    response = admin.post(
        "/admin/quotas/team/add/",
        {
            "slug": "robotics",
            "name": "Robotics",
            "parent": world.ml.pk,
            "weight": "1",
            "max_queued_jobs": "7",
            "quotas-TOTAL_FORMS": "0",
            "quotas-INITIAL_FORMS": "0",
            "memberships-TOTAL_FORMS": "0",
            "memberships-INITIAL_FORMS": "0",
        },
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    assert Team.objects.get(slug="robotics").max_queued_jobs == 7
    page = admin.get(f"/admin/quotas/team/{world.vision.pk}/change/").content.decode()
    assert 'name="max_queued_jobs"' in page


# --- the limits through the REST API -------------------------------------------------------


def test_the_team_api_shows_each_teams_own_limit_and_the_one_in_force(world: Any) -> None:
    world.ml.max_queued_jobs = 40
    world.ml.save(update_fields=["max_queued_jobs"])
    teams = {
        team["slug"]: team
        for team in world.client("manager").get("/api/v1/teams/?page_size=100").json()["results"]
    }
    assert teams["ml"]["max_queued_jobs"] == 40
    assert teams["vision"]["max_queued_jobs"] is None
    assert teams["vision"]["queued_job_limit"] == {"limit": 40, "set_by": "ml"}


def test_an_admin_sets_and_clears_a_teams_limit_through_the_api(world: Any, settings: Any) -> None:
    settings.QM_MAX_QUEUED_JOBS_PER_TEAM = 50
    admin = world.client("admin")
    answer = admin.patch(f"/api/v1/teams/{world.vision.pk}/", {"max_queued_jobs": 500}, "json")
    assert answer.status_code == 200, answer.content
    assert answer.json()["queued_job_limit"] == {"limit": 500, "set_by": "vision"}
    assert Team.objects.get(pk=world.vision.pk).max_queued_jobs == 500
    cleared = admin.patch(f"/api/v1/teams/{world.vision.pk}/", {"max_queued_jobs": None}, "json")
    assert cleared.json()["queued_job_limit"] == {"limit": 50, "set_by": None}
    assert Team.objects.get(pk=world.vision.pk).max_queued_jobs is None


def test_a_manager_may_narrow_a_sub_teams_limit_but_not_widen_it(world: Any, settings: Any) -> None:
    settings.QM_MAX_QUEUED_JOBS_PER_TEAM = 50
    world.ml.max_queued_jobs = 20
    world.ml.save(update_fields=["max_queued_jobs"])
    manager = world.client("manager")
    narrowed = manager.patch(f"/api/v1/teams/{world.vision.pk}/", {"max_queued_jobs": 5}, "json")
    assert narrowed.status_code == 200, narrowed.content
    assert Team.objects.get(pk=world.vision.pk).max_queued_jobs == 5
    before = database_state()
    reason = _refused(
        manager.patch(f"/api/v1/teams/{world.vision.pk}/", {"max_queued_jobs": 21}, "json"),
        "max_queued_jobs",
    )
    assert reason == (
        "Must be at most 20, the limit team ml sets above vision; only platform admins "
        "may raise it (got 21)."
    )
    assert database_state() == before


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (-1, "Ensure this value is greater than or equal to 0."),
        ("many", "A valid integer is required."),
        (10**7, "Ensure this value is less than or equal to 1000000."),
    ],
)
def test_a_bad_limit_is_refused_with_its_reason_and_changes_nothing(
    world: Any, value: Any, reason: str
) -> None:
    before = database_state()
    answer = world.client("admin").patch(
        f"/api/v1/teams/{world.vision.pk}/", {"max_queued_jobs": value}, "json"
    )
    assert _refused(answer, "max_queued_jobs") == reason
    assert database_state() == before


def test_a_manager_cannot_set_the_limit_of_a_team_outside_their_subtree(world: Any) -> None:
    before = database_state()
    answer = world.client("other_manager").patch(
        f"/api/v1/teams/{world.vision.pk}/", {"max_queued_jobs": 1}, "json"
    )
    assert answer.status_code == 404, answer.content
    assert database_state() == before
